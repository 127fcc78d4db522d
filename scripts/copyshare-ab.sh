#!/usr/bin/env bash
# copyshare-ab.sh BINDIR [SECONDS]: shm Fetches of 1 and 4 MiB with the
# process's copies shared with idle ring receivers (TENSORRPC_COPY=share)
# and not (TENSORRPC_COPY=auto, the default), in alternating rounds: in one process (tensorbench, 1 and 16 streams,
# against memcpy) and with the client in a process of its own (gopeer
# bench-serve and bench-client, 2000 Fetches, the median). BINDIR holds
# tensorbench and gopeer (scripts/device-check.sh build). Prints one line
# per measurement: "copyshare copy=V where=W size=N ..." .
set -uo pipefail
B=${1:?usage: copyshare-ab.sh BINDIR [SECONDS]}
budget=${2:-60}
end=$((SECONDS + budget))
tmp=$(mktemp -d)
trap 'pkill -f "gopeer bench-serve -transports shm -size" 2>/dev/null; rm -rf "$tmp"' EXIT
for round in 1 2; do
  for v in auto share; do
    [ $SECONDS -lt $end ] || exit 0
    TENSORRPC_COPY=$v timeout 30 "$B/tensorbench" -sections transfers -cases memcpy,trpc-shm -sizes 1MiB,4MiB \
      -concurrency 1,16 -payloads random -budget 300ms >"$tmp/tb.txt" 2>&1
    for s in 1 16; do
      line=$(grep -A6 "Fraction of the ceiling, $s stream" "$tmp/tb.txt" | grep '^| trpc-shm' | tr -d ' ' | cut -d'|' -f4,5)
      echo "copyshare copy=$v where=one-process streams=$s round=$round fraction-of-memcpy(1MiB|4MiB)=$line"
    done
    for n in 1048576 4194304; do
      [ $SECONDS -lt $end ] || exit 0
      rm -f "$tmp/srv.out"
      (sleep 20 | TENSORRPC_COPY=$v "$B/gopeer" bench-serve -transports shm -size $n >"$tmp/srv.out" 2>&1 &)
      for _ in $(seq 100); do grep -q '^ADDR' "$tmp/srv.out" 2>/dev/null && break; sleep 0.05; done
      addr=$(awk '/^ADDR/{print $2}' "$tmp/srv.out")
      med=$(TENSORRPC_COPY=$v timeout 20 "$B/gopeer" bench-client -addr "$addr" -transports shm -size $n -iters 2000 -ops fetch 2>&1 |
        grep -o '"median_s":[0-9.e-]*' | cut -d: -f2)
      pkill -f "gopeer bench-serve -transports shm -size $n" 2>/dev/null
      echo "copyshare copy=$v where=two-processes streams=1 round=$round size=$n median_s=$med"
    done
  done
done
