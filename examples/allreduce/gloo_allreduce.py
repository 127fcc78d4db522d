"""PyTorch's Gloo all_reduce on the same job as examples/allreduce, for a
comparison in one run: P processes, n float32 elements, one warm-up and
ITERS timed all-reduces, algorithm and bus bandwidth as NCCL's tests (and
examples/allreduce) report them.

    python3 examples/allreduce/gloo_allreduce.py -p 4 -n 16777216 -iters 5
    go run ./examples/allreduce -p 4 -n 16777216 -iters 5 -transports tcp,grpc

It starts its ranks itself (torch.multiprocessing, env:// rendezvous on
127.0.0.1), so it needs no torchrun. Gloo moves bytes over TCP, so the fair
tensorrpc plane to compare with is tcp.
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, n, iters, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.empty(n, dtype=torch.float32)
    times = []
    for it in range(iters + 1):
        x.fill_(float(rank + 1))
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        elapsed = time.perf_counter() - start
        # The slowest rank's time is the all-reduce's time.
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if it > 0:
            times.append(t.item())
        want = world * (world + 1) / 2
        if not bool((x == want).all()):
            raise SystemExit("rank %d: wrong sum" % rank)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-p", type=int, default=4, help="processes")
    ap.add_argument("-n", type=int, default=1 << 24, help="float32 elements")
    ap.add_argument("-iters", type=int, default=5, help="timed all-reduces after one warm-up")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.p, args.n, args.iters, port, q)) for r in range(args.p)]
    for p in procs:
        p.start()
    times = q.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit("a rank failed with exit code %d" % p.exitcode)
    mean = sum(times) / len(times)
    algbw = args.n * 4 / mean
    busbw = algbw * 2 * (args.p - 1) / args.p
    print("gloo all_reduce: %d processes, n = %d float32 (%.0f MiB), %d timed: %.2f ms, algbw %.2f GB/s, busbw %.2f GB/s"
          % (args.p, args.n, args.n * 4 / (1 << 20), args.iters, mean * 1e3, algbw / 1e9, busbw / 1e9))


if __name__ == "__main__":
    main()
