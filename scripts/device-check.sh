#!/usr/bin/env bash
# device-check.sh: everything the GPU machine checks, in one command.
#
#   scripts/device-check.sh build DIR [--dry-run]        on a machine with Go: build into DIR (packed, < 60 MiB)
#   scripts/device-check.sh run DIR [OUTDIR] [--dry-run] on the GPU machine, from the repo root (no Go needed)
#
# run unpacks DIR into a temporary folder and runs, each step bounded by its
# own time limit and by what is left of the run's budget, logged with its
# wall time, going on past failures:
#   1. facts: cores, GPU, driver, torch, the CPU and its large copies
#      (internal/memcopy's benchmark: Go's copy against memcopy.Copy)
#   2. the real-GPU Go tests (TENSORRPC_TEST_CUDA=real, -test.run $CUDA_TESTS):
#      gpudirect's and rpc's CUDA tests (streams, pinned copies, the
#      driver's errors, staged transfers on every plane, CUDA IPC between
#      two processes), then shim/examples/cuda_check.py (torch CUDA tensors
#      through the Python package)
#   3. devbench: pinned/pageable/device copies, Fetch, staged
#      FetchToDevice/SendDevice (shm, tcp) and CUDA IPC, 64 MiB to 1 GiB,
#      each against its ceiling in the same run
#   4. shim/examples/bench_cuda.py: torch's copies and RPC (cuda -> cuda)
#      beside the Python package's CUDA fetch
#   5. the 16-core goals: handoffs, copyshare (shm Fetches of 1 and 4 MiB
#      with and without the copies shared with idle ring receivers,
#      scripts/copyshare-ab.sh), tensorbench (1/4/16/64 streams, the
#      4 KiB call rate), Python vs Go and PyTorch RPC (4 KiB to 256 MiB),
#      examples/allreduce (tcp, shm) against Gloo at P = 4 and 8, and the
#      telemetry's cost (otel.test: 4 KiB Fetches with and without the
#      OpenTelemetry interceptor, the servers in a process of their own)
#   6. the summary: scripts/device_check_summary.py writes summary.md (the
#      steps, then one line per goal: measured, ceiling, ratio, target, met)
#      and results.jsonl (every step's JSON lines, each with its step)
# OUTDIR (default $OUT, else ./device-check-out) receives four files:
# all.log (every step's output, as it goes), summary.md, results.jsonl and
# logs.tgz.
#
# Without a GPU (nvidia-smi lists none) the GPU steps are skipped with that
# reason and the summary says "no GPU"; the 16-core steps still run.
# Environment:
#   DEVICE_CHECK_BUDGET=500   seconds for the whole run (the device tool's
#                             timeout_s 540 leaves the unpacking its time)
#   DEVICE_CHECK_STEPS=a,b    run only those steps (a rerun, a smoke test)
#   DEVICE_CHECK_QUICK=1      small sizes and few iterations (a smoke test)
#   DEVICE_CHECK_GPU=0|1      say whether there is a GPU instead of asking nvidia-smi
# docs/DEVICE.md says how to run it with the device tool.
set -uo pipefail

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
mode=$1 dir=$2
shift 2
dry=0 out=""
for a in "$@"; do
  case $a in
    --dry-run) dry=1 ;;
    -*) usage ;;
    *) out=$a ;;
  esac
done

# CUDA_TESTS selects the real-GPU Go tests in gpudirect.test and rpc.test
# (every test that loads a driver through gpudirect/cudatest is named
# TestCUDA...).
CUDA_TESTS='^TestCUDA'

# What the steps measure; DEVICE_CHECK_QUICK=1 makes them small.
if [ "${DEVICE_CHECK_QUICK:-0}" = 1 ]; then
  DEVBENCH_ARGS='-sizes 4MiB -reps 2'
  BENCH_CUDA_ARGS='--sizes 4K,1M --iters 5 --big-iters 2'
  HANDOFF_CALLS=200
  TENSORBENCH_ARGS='-sizes 4KiB,1MiB -concurrency 1,4 -budget 200ms -reps 3 -min-reps 2'
  SPIN_ARGS='--sizes 4K --rounds 1 --iters 20 --big-iters 2'
  ALLREDUCE_P='2' ALLREDUCE_N=$((1 << 20)) ALLREDUCE_ITERS=2
  OTEL_CALLS=2000x
else
  DEVBENCH_ARGS='-sizes 64MiB,256MiB,1GiB -reps 3'
  BENCH_CUDA_ARGS='--sizes 4K,1M,64M,256M --iters 50 --big-iters 8'
  HANDOFF_CALLS=2000
  TENSORBENCH_ARGS='-sizes 4KiB,1MiB,64MiB -concurrency 1,4,16,64 -budget 500ms'
  SPIN_ARGS='--sizes 4K,1M,16M,256M --rounds 2 --iters 200 --big-iters 8'
  ALLREDUCE_P='4 8' ALLREDUCE_N=$((1 << 24)) ALLREDUCE_ITERS=5
  OTEL_CALLS=45000x
fi
BUDGET=${DEVICE_CHECK_BUDGET:-500}
RESERVE=15 # seconds kept for the summary and the packing

# step [--gpu] NAME SECONDS CMD: runs CMD (logged to $T/NAME.log) under a
# timeout of SECONDS, or less where the run's budget has less left; a --gpu
# step is skipped without a GPU. Each step's status goes to $T/steps.tsv.
step() {
  local gpu_only=0
  if [ "$1" = --gpu ]; then gpu_only=1; shift; fi
  local name=$1 secs=$2
  shift 2
  if [ -n "${DEVICE_CHECK_STEPS:-}" ] && [[ ",$DEVICE_CHECK_STEPS," != *",$name,"* ]]; then
    return 0
  fi
  if [ $dry = 1 ]; then
    printf '%-16s (≤ %3ss%s) %s\n' "$name" "$secs" "$([ $gpu_only = 1 ] && echo ', GPU')" "$*"
    return 0
  fi
  if [ $gpu_only = 1 ] && [ -n "$nogpu" ]; then
    record "$name" skipped "" 0 "$nogpu"
    return 0
  fi
  local left=$((BUDGET - (SECONDS - run_start) - RESERVE))
  if [ "$left" -lt 5 ]; then
    record "$name" skipped "" 0 "out of the run's budget (DEVICE_CHECK_BUDGET=$BUDGET s)"
    return 0
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  local t0=$SECONDS
  echo "=== $name (≤ ${secs} s): $*" | tee -a "$out/all.log"
  timeout --kill-after=5 "$secs" bash -o pipefail -c "$*" >"$T/$name.log" 2>&1
  local rc=$? status=ok
  case $rc in
    0) ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  # Kept as it goes, in OUTDIR: a run cut short still brings back its steps.
  cat "$T/$name.log" >>"$out/all.log"
  record "$name" "$status" "$rc" $((SECONDS - t0)) ""
  tail -n 25 "$T/$name.log"
}

# record NAME STATUS RC SECONDS NOTE: one line of $T/steps.tsv, and the log.
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$T/steps.tsv"
  echo "=== $1: $2${3:+ (rc=$3)} in $4 s${5:+: $5}" | tee -a "$out/all.log"
}

build() {
  local root
  root=$(cd "$(dirname "$0")/.." && pwd)
  if [ $dry = 0 ]; then
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
  fi
  local B=$dir/bin
  run_or_say() { if [ $dry = 1 ]; then echo "$*"; else echo "+ $*"; "$@" || exit 1; fi; }
  export CGO_ENABLED=1
  [ $dry = 1 ] || rm -rf "$B" "$dir/bins.txz" "$dir/BUILD"
  run_or_say mkdir -p "$B"
  (cd "$root" &&
    run_or_say go test -c -ldflags='-s -w' -o "$B/gpudirect.test" ./gpudirect &&
    run_or_say go test -c -ldflags='-s -w' -o "$B/rpc.test" ./rpc &&
    run_or_say go test -c -ldflags='-s -w' -o "$B/memcopy.test" ./internal/memcopy &&
    run_or_say go build -ldflags='-s -w' -o "$B/allreduce" ./examples/allreduce &&
    run_or_say go build -ldflags='-s -w' -buildmode=c-shared -o "$B/libtensorrpc.so" ./shim/capi &&
    run_or_say go build -ldflags='-s -w' -o "$B/gopeer" ./shim/internal/gopeer) || exit 1
  (cd "$root/benchmarks" &&
    run_or_say go build -ldflags='-s -w' -o "$B/tensorbench" ./cmd/tensorbench &&
    run_or_say go build -ldflags='-s -w' -o "$B/handoffs" ./cmd/handoffs &&
    run_or_say go build -ldflags='-s -w' -o "$B/streams" ./cmd/streams &&
    run_or_say go build -ldflags='-s -w' -o "$B/devbench" ./cmd/devbench) || exit 1
  (cd "$root/otel" &&
    run_or_say go test -c -ldflags='-s -w' -o "$B/otel.test" .) || exit 1
  unset -f run_or_say
  if [ $dry = 1 ]; then
    echo "XZ_OPT=-T2 tar cJf $dir/bins.txz -C $B . && rm -r $B   (fails at 60 MiB or more)"
    return
  fi
  rm -f "$B"/*.h
  {
    echo "commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) with $(go version | cut -d' ' -f3-)"
    echo "unpacked: $(du -sm "$B" | cut -f1) MiB"
    (cd "$B" && ls -s --block-size=M .)
  } >"$dir/BUILD"
  XZ_OPT=-T2 tar cJf "$dir/bins.txz" -C "$B" . && rm -r "$B"
  cat "$dir/BUILD"
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
  run_start=$SECONDS
  nogpu=""
  if [ $dry = 1 ]; then
    T='$TMPDIR'
    echo "unpack $dir/bins.txz into \$TMPDIR/bin; run, within DEVICE_CHECK_BUDGET=$BUDGET s (GPU steps skipped without a GPU):"
  else
    T=$(mktemp -d)
    mkdir -p "$out" "$T/bin"
    : >"$out/all.log"
    tar xJf "$dir/bins.txz" -C "$T/bin" || { echo "cannot unpack $dir/bins.txz"; exit 1; }
    cp "$dir/BUILD" "$T/BUILD" 2>/dev/null
    case ${DEVICE_CHECK_GPU:-} in
      0) nogpu="no GPU: DEVICE_CHECK_GPU=0" ;;
      1) ;;
      *) nvidia-smi -L 2>/dev/null | grep -q '^GPU ' ||
        nogpu="no GPU: nvidia-smi $(command -v nvidia-smi >/dev/null && echo 'lists none' || echo 'is not installed')" ;;
    esac
    [ -z "$nogpu" ] || echo "device-check: $nogpu; the GPU steps are skipped" | tee -a "$out/all.log"
  fi
  local B=$T/bin
  local py="PYTHONPATH=$root/shim/python TENSORRPC_LIB=$B/libtensorrpc.so TENSORRPC_GOPEER=$B/gopeer PYTHONUNBUFFERED=1"
  step facts 20 "nproc; uname -r; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv; python3 -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())'; grep -m1 'model name' /proc/cpuinfo; grep -ow -m1 fsrm /proc/cpuinfo || echo 'no fsrm'; $B/memcopy.test -test.run XXX -test.bench Copy -test.benchtime 20x; true"
  step --gpu gpudirect-tests 45 "cd $root/gpudirect && TENSORRPC_TEST_CUDA=real $B/gpudirect.test -test.run '$CUDA_TESTS' -test.v -test.count=1"
  step --gpu rpc-tests 90 "cd $root/rpc && TENSORRPC_TEST_CUDA=real $B/rpc.test -test.run '$CUDA_TESTS' -test.v -test.count=1"
  step --gpu cuda-check 60 "$py python3 $root/shim/examples/cuda_check.py"
  step --gpu devbench 120 "$B/devbench $DEVBENCH_ARGS -json > $T/devbench.jsonl; cat $T/devbench.jsonl"
  step --gpu bench-cuda 120 "$py python3 $root/shim/examples/bench_cuda.py $BENCH_CUDA_ARGS | tee $T/bench-cuda.jsonl"
  step handoffs 40 "$B/handoffs -n $HANDOFF_CALLS -json > $T/handoffs.jsonl; $B/handoffs -n $HANDOFF_CALLS -streams 16 -size 1048576 -cases fetch-tcp,fetch-shm -json >> $T/handoffs.jsonl; cut -c1-160 $T/handoffs.jsonl"
  step streams 30 "$B/streams -duration 2s -json > $T/streams.jsonl; TENSORRPC_LANES=1 $B/streams -duration 2s -json >> $T/streams.jsonl; cat $T/streams.jsonl"
  step copyshare 60 "bash $root/scripts/copyshare-ab.sh $B 55"
  step tensorbench 100 "$B/tensorbench -sections transfers -cases tcp-socket,unix-socket,memcpy,trpc-tcp,trpc-shm,call-rate,call-rate-inline $TENSORBENCH_ARGS -payloads random -jsonl $T/tensorbench.jsonl"
  step python-spin 120 "$py python3 $root/shim/examples/bench_latency.py $SPIN_ARGS > $T/python-spin50.jsonl; grep -h '| \\(go\\|c\\|py-raw\\|py-tensor\\|torch-rpc\\|socket\\|socket2\\) |' $T/python-spin50.jsonl"
  step otel 45 "$B/otel.test -test.run XXX -test.bench Fetch4KiBTwoProcesses -test.benchtime $OTEL_CALLS"
  step allreduce 100 "for p in $ALLREDUCE_P; do for plane in tcp shm; do echo \"allreduce-run plane=\$plane p=\$p\"; $B/allreduce -p \$p -n $ALLREDUCE_N -iters $ALLREDUCE_ITERS -transports \$plane,grpc | tail -1; done; echo \"allreduce-run plane=gloo p=\$p\"; python3 $root/examples/allreduce/gloo_allreduce.py -p \$p -n $ALLREDUCE_N -iters $ALLREDUCE_ITERS 2>&1 | tail -1; done"
  if [ $dry = 1 ]; then
    printf '%-16s (≤ %3ss) %s\n' summary "$RESERVE" "python3 scripts/device_check_summary.py \$TMPDIR OUTDIR (summary.md, results.jsonl); tar czf OUTDIR/logs.tgz; OUTDIR/all.log as it goes"
    return
  fi
  python3 "$root/scripts/device_check_summary.py" "$T" "$out" "$nogpu" 2>&1 | tee -a "$out/all.log"
  tar czf "$out/logs.tgz" -C "$T" --exclude=bin . 2>/dev/null
  rm -rf "$T"
  echo "device-check: results in $out ($(ls "$out" | tr '\n' ' '))"
}

case $mode in
  build) build ;;
  run) run ;;
  *) usage ;;
esac
