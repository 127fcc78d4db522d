"""CUDA tensors between two processes on one GPU: PyTorch's own copies and
RPC (TensorPipe with device_maps, cuda -> cuda) beside the tensorrpc
Python package, in one run. Needs torch with CUDA; prints a Markdown
table and one JSON line per measurement.

    PYTHONPATH=shim/python python3 shim/examples/bench_cuda.py [--sizes 4K,1M,64M,256M] [--iters 50]

Cases (p50 over --iters calls after a warm-up; GB/s at the p50):
  torch-pinned-htod / -dtoh     torch copy_ between a pinned host tensor and the GPU
  torch-pageable-htod / -dtoh   the same from pageable host memory
  torch-dtod                    a device-to-device copy on the GPU
  torch-rpc                     rpc_sync returning a CUDA tensor of the size
                                (TensorPipe, device_maps {0: 0}), callee in
                                another process
  trpc-fetch-cuda               tensorrpc Client.fetch(key, device="cuda:0")
                                of a CUDA tensor a Server in another process
                                published (staged through pinned host memory,
                                or CUDA IPC where both sides negotiate it)
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    return int(s[:-1]) * SIZES[s[-1]] if s[-1] in SIZES else int(s)


def timed(fn, iters, sync):
    fn()
    sync()
    ds = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ds.append(time.perf_counter() - t0)
    return statistics.median(ds)


def torch_copies(torch, n, iters):
    dev = torch.device("cuda:0")
    sync = torch.cuda.synchronize
    d0 = torch.empty(n, dtype=torch.uint8, device=dev)
    d1 = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(n, dtype=torch.uint8)
    out = {}
    out["torch-pinned-htod"] = timed(lambda: d0.copy_(pinned, non_blocking=True), iters, sync)
    out["torch-pinned-dtoh"] = timed(lambda: pinned.copy_(d0, non_blocking=True), iters, sync)
    out["torch-pageable-htod"] = timed(lambda: d0.copy_(pageable), iters, sync)
    out["torch-pageable-dtoh"] = timed(lambda: pageable.copy_(d0), iters, sync)
    out["torch-dtod"] = timed(lambda: d1.copy_(d0), iters, sync)
    return out


# ---- torch RPC: a callee process holding CUDA tensors, a caller timing rpc_sync.

def _cuda_tensor_of(size):
    import torch
    t = _held.get(size)
    if t is None:
        t = _held[size] = torch.ones(size, dtype=torch.uint8, device="cuda:0")
    return t


_held = {}


def torch_rpc_worker(port, rank):
    import torch
    import torch.distributed.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:%d" % port, num_worker_threads=4, rpc_timeout=300)
    opts.set_device_map("w0" if rank == 1 else "w1", {0: 0})
    rpc.init_rpc("w%d" % rank, rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 1:
        print("READY", flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            size, iters = map(int, line.split())
            f = lambda: rpc.rpc_sync("w0", _cuda_tensor_of, args=(size,))
            print(json.dumps(timed(f, iters, torch.cuda.synchronize)), flush=True)
    rpc.shutdown()


def trpc_server_worker():
    """A tensorrpc Server publishing CUDA tensors of the sizes asked on stdin."""
    import torch
    import tensorrpc
    with tensorrpc.Server() as srv:
        print("ADDR " + srv.address, flush=True)
        held = []
        for line in sys.stdin:
            if not line.strip():
                break
            size = int(line)
            t = torch.ones(size, dtype=torch.uint8, device="cuda:0")
            held.append(t)
            srv.publish("cuda/%d" % size, t)
            torch.cuda.synchronize()
            print("OK", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,1M,64M,256M")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--big-iters", type=int, default=10, help="iterations at 16 MiB and above")
    ap.add_argument("--torch-rpc-worker", nargs=2, metavar=("PORT", "RANK"), help=argparse.SUPPRESS)
    ap.add_argument("--trpc-server", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_rpc_worker:
        return torch_rpc_worker(int(a.torch_rpc_worker[0]), int(a.torch_rpc_worker[1]))
    if a.trpc_server:
        return trpc_server_worker()
    import torch
    if not torch.cuda.is_available():
        print("bench_cuda: torch has no CUDA here; nothing to measure")
        return 0
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    rows = []

    def add(case, n, secs, note=""):
        rows.append({"case": case, "bytes": n, "p50_us": secs * 1e6, "gb_per_s": n / secs / 1e9 if secs > 0 else 0, "note": note})

    for n in sizes:
        iters = a.iters if n < 16 << 20 else a.big_iters
        for case, secs in torch_copies(torch, n, iters).items():
            add(case, n, secs)

    env = dict(os.environ, GLOG_minloglevel="2")
    port = free_port()
    me = os.path.abspath(__file__)
    callee = subprocess.Popen([sys.executable, me, "--torch-rpc-worker", str(port), "0"], stdin=subprocess.DEVNULL, env=env)
    caller = subprocess.Popen([sys.executable, me, "--torch-rpc-worker", str(port), "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        if caller.stdout.readline().strip() == "READY":
            for n in sizes:
                caller.stdin.write("%d %d\n" % (n, a.iters if n < 16 << 20 else a.big_iters))
                caller.stdin.flush()
                add("torch-rpc", n, json.loads(caller.stdout.readline()))
        else:
            print("bench_cuda: torch RPC did not start", file=sys.stderr)
    except (ValueError, OSError) as e:  # the rows so far still print
        print("bench_cuda: torch RPC failed: %s" % e, file=sys.stderr)
    finally:
        try:
            caller.stdin.close()
        except OSError:
            pass
        for p in (caller, callee):
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()

    try:
        import tensorrpc
    except ImportError as e:
        tensorrpc = None
        print("bench_cuda: tensorrpc not importable (%s); its rows are missing" % e, file=sys.stderr)
    if tensorrpc is not None:
        srv = subprocess.Popen([sys.executable, me, "--trpc-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            addr = srv.stdout.readline().split()[1]
            with tensorrpc.Client(addr) as c:
                for n in sizes:
                    srv.stdin.write("%d\n" % n)
                    srv.stdin.flush()
                    srv.stdout.readline()
                    f = lambda: c.fetch("cuda/%d" % n, device="cuda:0", output="torch")
                    secs = timed(f, a.iters if n < 16 << 20 else a.big_iters, torch.cuda.synchronize)
                    st = c.stats()
                    add("trpc-fetch-cuda", n, secs, "ipc=%s" % st.get("ipc", "?"))
        except Exception as e:  # an older package, or a failed fetch: the torch rows still print
            print("bench_cuda: tensorrpc CUDA fetch not available: %s" % e, file=sys.stderr)
        finally:
            srv.stdin.close()
            srv.wait(timeout=60)

    print("| case | size | p50 µs | GB/s at p50 | note |\n|---|--:|--:|--:|---|")
    for r in rows:
        print("| %s | %d | %.1f | %.2f | %s |" % (r["case"], r["bytes"], r["p50_us"], r["gb_per_s"], r["note"]))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
