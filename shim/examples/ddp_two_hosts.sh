#!/usr/bin/env bash
# Runs examples/ddp_train.py on two "hosts" made of network namespaces joined
# by a veth pair, one torchrun per host, exactly as on two machines:
#
#   sudo bash shim/examples/ddp_two_hosts.sh [--transport tcp|grpc] [--steps N] [--nproc N]
#
# node 0 (10.210.0.1, namespace trpc-ddp0) runs rank 0 and torchrun's
# rendezvous (MASTER_ADDR); node 1 (10.210.0.2, trpc-ddp1) joins it. The
# tensorrpc server address travels through torch.distributed's store, not on
# the command line. Needs root, iproute2, torch and a built libtensorrpc.so
# (pip install ./shim/python, or bash shim/install.sh). The namespaces are
# removed on exit.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
transport=tcp steps=10 nproc=1
while [ $# -gt 0 ]; do
  case "$1" in
    --transport) transport="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    *) echo "usage: $0 [--transport tcp|grpc] [--steps N] [--nproc N]" >&2; exit 2 ;;
  esac
done
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
  echo "ddp_two_hosts: needs root and iproute2 (ip netns)" >&2; exit 2
fi

ns0=trpc-ddp0 ns1=trpc-ddp1
cleanup() { ip netns del "$ns0" 2>/dev/null || true; ip netns del "$ns1" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$ns0"
ip netns add "$ns1"
ip link add trpc-ddp-a netns "$ns0" type veth peer name trpc-ddp-b netns "$ns1"
ip -n "$ns0" addr add 10.210.0.1/24 dev trpc-ddp-a
ip -n "$ns1" addr add 10.210.0.2/24 dev trpc-ddp-b
for ns in "$ns0" "$ns1"; do
  ip -n "$ns" link set lo up
done
ip -n "$ns0" link set trpc-ddp-a up
ip -n "$ns1" link set trpc-ddp-b up

# Flags this torch's torchrun needs (ddp_train.torchrun_workarounds says why).
read -r -a workaround < <("$python" -c 'import sys; sys.path.insert(0, sys.argv[1]); import ddp_train; print(" ".join(ddp_train.torchrun_workarounds()))' "$here")

run_node() {
  local ns="$1" rank="$2"
  ip netns exec "$ns" "$python" -m torch.distributed.run "${workaround[@]}" \
    --nnodes 2 --node_rank "$rank" --nproc_per_node "$nproc" \
    --master_addr 10.210.0.1 --master_port 29531 \
    "$here/ddp_train.py" --transport "$transport" --steps "$steps"
}
run_node "$ns0" 0 &
node0=$!
run_node "$ns1" 1 &
node1=$!
rc=0
wait "$node1" || rc=$?
wait "$node0" || rc=$?
exit "$rc"
