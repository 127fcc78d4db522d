"""Data-parallel training with two PyTorch processes that average their
gradients through tensorrpc, checked against a single-process run.

    PYTHONPATH=shim/python /usr/bin/python3 shim/examples/ddp_train.py [--steps N] [--transport shm|tcp|grpc]

Rank 0 (this process) runs a tensorrpc.Server and starts rank 1 as a child
process, which connects with a tensorrpc.Client. Both build the same 2-layer
MLP (fixed seed, float64) and, at every step, compute the gradient of the
mean squared error on their half of a fixed batch:

    rank 1:  send "grad/<step>" ───────────────► rank 0: take "grad/<step>"
                                                  avg = (g0 + g1) / 2
    rank 1:  fetch "avg/<step>" ◄─────────────── publish "avg/<step>"
    both:    w -= lr * avg

Each side waits for the key the other one writes (wait=True): without it, a
fetch or take of a key that is not published yet fails at once with
NotFoundError.

Since the halves are equal, the average of the two half-batch gradients is
the full-batch gradient, so both ranks must end with the weights of a
single-process run on the full batch; rank 0 checks that with
torch.allclose at a tight tolerance and exits 1 if it fails.

No tensor is copied by Python: rank 1 writes its gradient straight into a
pool tensor (Client.empty) that is sent without a copy, rank 0 averages
into a pool tensor (Server.empty) that is published without a copy, and
received tensors are views of pool memory.
"""

import argparse
import os
import subprocess
import sys

import torch

import tensorrpc

BATCH, IN, HIDDEN, OUT = 64, 32, 512, 1  # 17409 parameters: 136 KiB of gradient, over the eager threshold
LR = 0.1


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT)).double()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    w = torch.randn(IN, OUT, generator=g, dtype=torch.float64)
    return x, torch.sin(x @ w)


def gradient(net, x, y, out=None):
    """The flattened gradient of the MSE on (x, y), written into out."""
    net.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()], out=out)


def apply(net, grad):
    with torch.no_grad():
        i = 0
        for p in net.parameters():
            p -= LR * grad[i:i + p.numel()].view_as(p)
            i += p.numel()


def flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def shard(rank):
    x, y = data()
    half = BATCH // 2
    return x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]


def rank0(steps, transport):
    net = model()
    x, y = shard(0)
    n = sum(p.numel() for p in net.parameters())
    with tensorrpc.Server(transports=[transport], output="torch") as srv:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", "1", "--steps", str(steps),
                                  "--transport", transport, "--address", srv.address])
        try:
            for step in range(steps):
                g0 = gradient(net, x, y)
                g1 = srv.take("grad/%d" % step, wait=True, timeout=60)  # a view of rank 1's gradient in our pool
                avg = srv.empty(n, torch.float64)
                torch.add(g0, g1, out=avg).mul_(0.5)
                srv.publish("avg/%d" % step, avg)  # a pool tensor: no copy
                # Rank 1 sent grad/<step> after fetching avg/<step-1>.
                srv.unpublish("avg/%d" % (step - 1))
                apply(net, avg)
                del g1, avg
            theirs = srv.take("params", wait=True, timeout=60)
            srv.unpublish("avg/%d" % (steps - 1))
            same = torch.equal(theirs, flat(net))
            del theirs
        finally:
            if child.wait(timeout=60) != 0:
                raise SystemExit("rank 1 failed with exit code %d" % child.returncode)
        left = srv.close()

    ref = model()
    xs, ys = data()
    for _ in range(steps):
        apply(ref, gradient(ref, xs, ys))
    diff = (flat(net) - flat(ref)).abs().max().item()
    ok = same and torch.allclose(flat(net), flat(ref), rtol=1e-12, atol=1e-14)
    print("ddp_train: %d steps over %s, %d parameters: ranks agree: %s; max |ddp - single| = %.3g; %s"
          % (steps, transport, n, same, diff, "OK" if ok else "MISMATCH"))
    if left:
        print("ddp_train: %d pool buffers still live" % left)
    return 0 if ok and not left else 1


def rank1(steps, transport, address):
    net = model()
    x, y = shard(1)
    n = sum(p.numel() for p in net.parameters())
    with tensorrpc.Client(address, transports=[transport], output="torch") as c:
        for step in range(steps):
            g = c.empty(n, torch.float64)  # pool memory: sending it costs no copy
            gradient(net, x, y, out=g)
            c.send("grad/%d" % step, g, timeout=60)
            avg = c.fetch("avg/%d" % step, wait=True, timeout=60)  # rank 0 publishes it once it has our gradient
            apply(net, avg)
            del g, avg
        c.send("params", flat(net), timeout=60)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp", "grpc"])
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank == 1:
        return rank1(args.steps, args.transport, args.address)
    return rank0(args.steps, args.transport)


if __name__ == "__main__":
    sys.exit(main())
