"""CUDA tensors through the Python package on a real GPU, with torch: the
check that CI (which has no GPU and no CUDA build of torch) cannot run.

    PYTHONPATH=shim/python python3 shim/examples/cuda_check.py   # pip install -e ./shim/python first

For every plane (shm, tcp, grpc) and dtype (float16, bfloat16, float32,
int64), sizes 0, 4 KiB and 64 MiB: a torch CUDA tensor made by kernels
queued on a side stream is sent from inside that stream's context (the
package asks for __dlpack__(stream=1), and torch makes the legacy stream
wait for its current one), fetched back onto cuda:0 as a torch tensor and
compared with torch.equal; a call with CUDA request tensors to a handler
that replies with CUDA tensors; and at the end the library's device memory
is back to at most one empty arena. It prints one line per case and "cuda
check OK", or exits 1.
"""

import gc
import sys

import torch

import tensorrpc

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int64)
SIZES = (0, 4096, 64 << 20)  # bytes


def make(dtype, nbytes, device):
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    if dtype.is_floating_point:
        return torch.randn(n, device=device).to(dtype).mul_(3)
    return torch.randint(-1 << 40, 1 << 40, (n,), device=device, dtype=dtype)


def main():
    if not torch.cuda.is_available():
        print("cuda_check: this PyTorch sees no CUDA device", file=sys.stderr)
        return 1
    dev = torch.device("cuda", 0)
    print("cuda_check: %s, torch %s, %d CUDA devices (driver: %d)"
          % (torch.cuda.get_device_name(dev), torch.__version__, torch.cuda.device_count(),
             tensorrpc.cuda_device_count()))
    ok = True
    with tensorrpc.Server(output="torch") as srv:
        srv.handle("double", lambda meta, ts: (meta, [t.to(dev) * 2 for t in ts]))
        for transport in ("shm", "tcp", "grpc"):
            with tensorrpc.Client(srv.address, transports=[transport], output="torch") as c:
                for dtype in DTYPES:
                    for nbytes in SIZES:
                        side = torch.cuda.Stream()
                        with torch.cuda.stream(side):
                            x = make(dtype, nbytes, dev)
                            c.send("x", x)  # the kernels above are queued on side
                        back = c.fetch("x", device=dev)
                        host = srv.take("x")
                        good = back.device == dev and torch.equal(back, x) and torch.equal(host, x.cpu())
                        if nbytes <= 4096 and dtype != torch.int64:
                            _, (y,) = c.call("double", b"", [x], timeout=60)
                            good = good and torch.equal(y, (x * 2).cpu())
                        print("%-4s %-15s %9d bytes: %s" % (transport, dtype, nbytes, "ok" if good else "MISMATCH"))
                        ok = ok and good
                        del x, back, host
                        gc.collect()
    gc.collect()
    st = tensorrpc.device_memory_stats(dev)
    print("cuda_check: library device memory after: %s" % st)
    ok = ok and st["buffers"] == 0 and st["arenas"] <= 1
    print("cuda check OK" if ok else "cuda check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
