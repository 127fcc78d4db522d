#!/usr/bin/env bash
# device-check.sh: everything the GPU machine checks, in one command.
#
#   scripts/device-check.sh build DIR [--dry-run]   on a machine with Go: build into DIR (packed, < 60 MiB)
#   scripts/device-check.sh run DIR [OUT] [--dry-run]   on the GPU machine, from the repo root (no Go needed)
#
# run unpacks DIR into a temporary folder and runs, each step bounded by a
# timeout and logged with its wall time, going on past failures:
#   1. facts: cores, GPU, driver, torch
#   2. the real-GPU Go tests (TENSORRPC_TEST_CUDA=real): gpudirect's and
#      rpc's CUDA tests (streams, pinned copies, the driver's errors, staged
#      transfers on every plane, CUDA IPC between two processes)
#   3. devbench: pinned/pageable/device copies, Fetch, staged
#      FetchToDevice/SendDevice (shm, tcp) and CUDA IPC, 64 MiB to 1 GiB,
#      each against its ceiling in the same run
#   4. shim/examples/bench_cuda.py: torch's copies and RPC (cuda -> cuda)
#      beside the Python package's CUDA fetch
#   5. the 16-core goals: handoffs, tensorbench (1/4/16/64 streams, the
#      4 KiB call rate), Python vs Go at 4 KiB / 1 MiB (the default poll
#      spin and TENSORRPC_POLL_US=200), examples/allreduce against Gloo at
#      P = 4 and 8
# and writes OUT (default $OUT, else ./device-check-out): all.log (every
# step's output, as it goes), summary.md, results.jsonl and logs.tgz. The
# steps' time limits add up to about 11 minutes; they take about 6. docs/DEVICE.md says how to run it with the
# device tool.
set -uo pipefail

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
mode=$1 dir=$2
shift 2
dry=0 out=""
for a in "$@"; do
  case $a in
    --dry-run) dry=1 ;;
    *) out=$a ;;
  esac
done

# CUDA_TESTS selects the real-GPU Go tests.
CUDA_TESTS='^TestCUDA'

# step NAME SECONDS CMD...: runs CMD (logged to $T/NAME.log) under a timeout.
step() {
  local name=$1 secs=$2
  shift 2
  # DEVICE_CHECK_STEPS=a,b runs only those steps (a rerun, a smoke test).
  if [ -n "${DEVICE_CHECK_STEPS:-}" ] && [[ ",$DEVICE_CHECK_STEPS," != *",$name,"* ]]; then
    return 0
  fi
  if [ $dry = 1 ]; then
    printf '%-16s (≤ %ss) %s\n' "$name" "$secs" "$*"
    return 0
  fi
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$out/all.log"
  timeout --kill-after=10 "$secs" bash -c "$*" >"$T/$name.log" 2>&1
  local rc=$?
  # Kept as it goes, in OUT: a run cut short still brings back its steps.
  cat "$T/$name.log" >>"$out/all.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/all.log"
  tail -n 25 "$T/$name.log"
  return 0
}

build() {
  local root
  root=$(cd "$(dirname "$0")/.." && pwd)
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  local B=$dir/bin
  local flags=(-ldflags=-s\ -w)
  run_or_say() { if [ $dry = 1 ]; then echo "$*"; else echo "+ $*"; "$@" || exit 1; fi; }
  export CGO_ENABLED=1
  run_or_say mkdir -p "$B"
  (cd "$root" &&
    run_or_say go test -c -ldflags='-s -w' -o "$B/gpudirect.test" ./gpudirect &&
    run_or_say go test -c -ldflags='-s -w' -o "$B/rpc.test" ./rpc &&
    run_or_say go build -ldflags='-s -w' -o "$B/allreduce" ./examples/allreduce &&
    run_or_say go build -ldflags='-s -w' -buildmode=c-shared -o "$B/libtensorrpc.so" ./shim/capi &&
    run_or_say go build -ldflags='-s -w' -o "$B/gopeer" ./shim/internal/gopeer) || exit 1
  (cd "$root/benchmarks" &&
    run_or_say go build -ldflags='-s -w' -o "$B/tensorbench" ./cmd/tensorbench &&
    run_or_say go build -ldflags='-s -w' -o "$B/handoffs" ./cmd/handoffs &&
    run_or_say go build -ldflags='-s -w' -o "$B/devbench" ./cmd/devbench) || exit 1
  unset -f run_or_say
  if [ $dry = 1 ]; then
    echo "tar cJf $dir/bins.txz -C $B . && rm -r $B   (checked < 60 MiB)"
    return
  fi
  rm -f "$B"/*.h
  XZ_OPT=-T2 tar cJf "$dir/bins.txz" -C "$B" . && rm -r "$B"
  local size
  size=$(du -sm "$dir" | cut -f1)
  echo "device-check: $dir holds ${size} MiB"
  [ "$size" -lt 60 ] || { echo "device-check: $dir is over 60 MiB"; exit 1; }
}

run() {
  local root
  root=$(pwd)
  [ -f "$root/scripts/device-check.sh" ] || { echo "run from the repository root"; exit 2; }
  out=${out:-${OUT:-$root/device-check-out}}
  if [ $dry = 1 ]; then
    T='$TMPDIR'
  else
    T=$(mktemp -d)
  fi
  if [ $dry = 0 ]; then
    mkdir -p "$out" "$T/bin"
    tar xJf "$dir/bins.txz" -C "$T/bin" || { echo "cannot unpack $dir/bins.txz"; exit 1; }
  fi
  local B=$T/bin
  local py="PYTHONPATH=$root/shim/python TENSORRPC_LIB=$B/libtensorrpc.so TENSORRPC_GOPEER=$B/gopeer PYTHONUNBUFFERED=1"
  step facts 20 "nproc; uname -r; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv; python3 -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())'"
  step gpudirect-tests 45 "cd $root/gpudirect && TENSORRPC_TEST_CUDA=real $B/gpudirect.test -test.run '$CUDA_TESTS' -test.v -test.count=1"
  step rpc-tests 90 "cd $root/rpc && TENSORRPC_TEST_CUDA=real $B/rpc.test -test.run '$CUDA_TESTS' -test.v -test.count=1"
  step devbench 120 "$B/devbench -sizes 64MiB,256MiB,1GiB -reps 3 -json > $T/devbench.jsonl; $B/devbench -sizes 64MiB -reps 3"
  step bench-cuda 120 "$py python3 $root/shim/examples/bench_cuda.py --sizes 4K,1M,64M,256M --iters 50 --big-iters 8 | tee $T/bench-cuda.out"
  step handoffs 40 "$B/handoffs -n 2000 -json > $T/handoffs.jsonl; cat $T/handoffs.jsonl | cut -c1-160"
  step tensorbench 100 "$B/tensorbench -sections transfers -cases tcp-socket,unix-socket,memcpy,trpc-tcp,trpc-shm,call-rate,call-rate-inline -sizes 4KiB,1MiB,64MiB -concurrency 1,4,16,64 -payloads random -budget 500ms -jsonl $T/tensorbench.jsonl"
  step python-spin 80 "$py python3 $root/shim/examples/bench_latency.py --sizes 4K,1M --rounds 2 --iters 200 --no-torch-rpc > $T/python-spin50.md; TENSORRPC_POLL_US=200 $py python3 $root/shim/examples/bench_latency.py --sizes 4K,1M --rounds 2 --iters 200 --no-torch-rpc > $T/python-spin200.md; grep -h '| \\(go\\|py-tensor\\) |' $T/python-spin*.md"
  step allreduce 100 "for p in 4 8; do $B/allreduce -p \$p -n 16777216 -iters 5 -transports tcp,grpc | tail -1; python3 $root/examples/allreduce/gloo_allreduce.py -p \$p -n 16777216 -iters 5 | tail -1; done"
  [ $dry = 1 ] && return
  summarize > "$out/summary.md" 2>&1
  cat "$out/summary.md"
  cat "$T"/*.jsonl > "$out/results.jsonl" 2>/dev/null
  grep -h '^{' "$T/bench-cuda.out" >> "$out/results.jsonl" 2>/dev/null
  tar czf "$out/logs.tgz" -C "$T" --exclude=bin . 2>/dev/null
  echo "device-check: results in $out"
}

# summarize prints the goals of issue 26 (device) measured in this run.
summarize() {
  python3 - "$T" <<'PY'
import json, os, sys
T = sys.argv[1]
def lines(name):
    p = os.path.join(T, name)
    if not os.path.exists(p):
        return []
    return [json.loads(l) for l in open(p) if l.startswith("{")]
dev = {(r["case"], r["bytes"]): r for r in lines("devbench.jsonl")}
cuda = {(r["case"], r["bytes"]): r for r in lines("bench-cuda.out")}
print("| goal | measured | target | met |\n|---|---|---|---|")
def row(goal, value, target, ok):
    print("| %s | %s | %s | %s |" % (goal, value, target, "yes" if ok else "no"))
M = 1 << 20
for way, tc in (("htod", "torch-pinned-htod"), ("dtoh", "torch-pinned-dtoh")):
    g, t = dev.get(("pinned-" + way, 256 * M)), cuda.get((tc, 256 * M))
    if g and t and not g.get("error"):
        r = g["gb_per_s"] / t["gb_per_s"]
        row("gpudirect pinned %s / torch pinned, 256 MiB" % way, "%.2f (%.1f / %.1f GB/s)" % (r, g["gb_per_s"], t["gb_per_s"]), ">= 0.8", r >= 0.8)
for case in ("fetchtodevice-shm", "senddevice-shm", "fetchtodevice-tcp", "senddevice-tcp", "ipc-fetchtodevice"):
    for n in (64 * M, 256 * M, 1024 * M):
        r = dev.get((case, n))
        if not r:
            continue
        if r.get("error"):
            row("%s %d MiB" % (case, n // M), "error: " + r["error"][:80], "", False)
            continue
        target = 0.5 if case.startswith("ipc") else 0.8
        row("%s %d MiB / %s" % (case, n // M, r.get("ceiling", "?")), "%.2f (%.1f GB/s)" % (r.get("of_ceiling", 0), r["gb_per_s"]), ">= %.1f" % target, r.get("of_ceiling", 0) >= target)
for n in (64 * M, 256 * M):
    i, t = dev.get(("ipc-fetchtodevice", n)), cuda.get(("torch-rpc", n))
    if i and t and not i.get("error"):
        r = i["gb_per_s"] / t["gb_per_s"]
        row("CUDA IPC / torch RPC cuda->cuda, %d MiB" % (n // M), "%.2f (%.1f / %.1f GB/s)" % (r, i["gb_per_s"], t["gb_per_s"]), ">= 1.5", r >= 1.5)
for n in (4 << 10, M):
    p, t = cuda.get(("trpc-fetch-cuda", n)), cuda.get(("torch-rpc", n))
    if p and t:
        r = p["p50_us"] / t["p50_us"]
        row("Python CUDA fetch p50 / torch RPC p50, %s" % ("4 KiB" if n < M else "1 MiB"), "%.2f (%.0f / %.0f us)" % (r, p["p50_us"], t["p50_us"]), "<= 0.25", r <= 0.25)
PY
}

case $mode in
  build) build ;;
  run) run ;;
  *) usage ;;
esac
