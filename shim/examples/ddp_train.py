"""Data-parallel training with PyTorch processes that average their gradients
through tensorrpc, checked against a single-process run.

Launch it the way PyTorch jobs are launched, with torchrun (its env://
rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

    # one host, 4 processes
    PYTHONPATH=shim/python torchrun --standalone --nproc_per_node 4 shim/examples/ddp_train.py --transport shm

    # two hosts (here: node 0 at 10.0.0.1), one process each
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr 10.0.0.1 --master_port 29500 \\
        shim/examples/ddp_train.py --transport tcp        # on 10.0.0.1
    torchrun --nnodes 2 --node_rank 1 --nproc_per_node 1 --master_addr 10.0.0.1 --master_port 29500 \\
        shim/examples/ddp_train.py --transport tcp        # on the other host

Started without torchrun (no RANK in the environment) it runs itself under
torchrun's launcher with --nproc (default 2) processes on this host.

Rank 0 runs a tensorrpc.Server on MASTER_ADDR (the address torchrun already
uses to reach node 0) and puts its address in torch.distributed's store; the
other ranks read it from there and connect with a tensorrpc.Client. No
address is passed by hand. Every rank builds the same 2-layer MLP (fixed
seed, float64) and, at every step, computes the gradient of the mean squared
error on its 1/WORLD_SIZE of a fixed batch:

    rank r > 0:  send "grad/<step>/<r>" ─────────► rank 0: take them all
                                                   avg = (g0 + g1 + ...) / W
    rank r > 0:  fetch "avg/<step>" ◄──────────── publish "avg/<step>"
    all:         w -= lr * avg

Each side waits for the key the other one writes (wait=True): without it, a
fetch or take of a key that is not published yet fails at once with
NotFoundError.

Since the shards are equal, the average of the shard gradients is the
full-batch gradient, so every rank must end with the weights of a
single-process run on the full batch; rank 0 checks that (and that every
rank agrees) and exits 1 if it fails, which makes torchrun fail.

No tensor is copied by Python: ranks write their gradient straight into a
pool tensor (Client.empty) that is sent without a copy, rank 0 averages into
a pool tensor (Server.empty) that is published without a copy, and received
tensors are views of pool memory.

With --device cuda every rank trains on GPU LOCAL_RANK (modulo the GPUs it
sees): ranks send their CUDA gradients as they are, rank 0 averages on its
GPU and publishes the CUDA tensor, and ranks fetch the average straight
onto their GPU (fetch(..., device=...)); the library stages each through
host memory (see shim/README.md, "CUDA tensors"). The check against a
single-process run (on the same GPU type) then allows for GPU reductions
that sum in another order.
"""

import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import tensorrpc

BATCH, IN, HIDDEN, OUT = 64, 32, 512, 1  # 17409 parameters: 136 KiB of gradient, over the eager threshold
LR = 0.1
ADDRESS_KEY = "tensorrpc/server_address"


def model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT)).double().to(device)


def data(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    w = torch.randn(IN, OUT, generator=g, dtype=torch.float64)
    return x.to(device), torch.sin(x @ w).to(device)


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


def shard(rank, world, device):
    x, y = data(device)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def store_from_env():
    """torch.distributed's store for this job, from torchrun's env://
    variables (the same store init_process_group would use)."""
    timeout = datetime.timedelta(seconds=120)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return store, rank, world


def rank0(store, world, steps, transport, device):
    net = model(device)
    x, y = shard(0, world, device)
    cuda = device.type == "cuda"
    n = sum(p.numel() for p in net.parameters())
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if host == "localhost":
        host = "127.0.0.1"
    with tensorrpc.Server("%s:0" % host, transports=[transport], output="torch") as srv:
        store.set(ADDRESS_KEY, srv.address)
        for step in range(steps):
            # On the CPU a pool tensor (published without a copy), on a GPU
            # a CUDA tensor (published staged).
            avg = torch.empty(n, dtype=torch.float64, device=device) if cuda else srv.empty(n, torch.float64)
            gradient(net, x, y, out=avg)
            for r in range(1, world):
                g = srv.take("grad/%d/%d" % (step, r), wait=True, timeout=60)  # a view of rank r's gradient in our pool
                avg.add_(g.to(device))
                del g
            avg.mul_(1.0 / world)
            srv.publish("avg/%d" % step, avg)
            # Every rank sent grad/<step> after fetching avg/<step-1>.
            srv.unpublish("avg/%d" % (step - 1))
            apply(net, avg)
            del avg
        same = True
        for r in range(1, world):
            theirs = srv.take("params/%d" % r, wait=True, timeout=60)
            same = same and torch.equal(theirs, flat(net).cpu())
            del theirs
        srv.unpublish("avg/%d" % (steps - 1))
        # Close only once every rank has closed its client: a server that
        # goes away while a rank's last send is being acknowledged fails
        # that send with Unavailable, though its bytes arrived.
        store.wait(["tensorrpc/done/%d" % r for r in range(1, world)])
        left = srv.close()

    ref = model(device)
    xs, ys = data(device)
    for _ in range(steps):
        apply(ref, gradient(ref, xs, ys))
    diff = (flat(net) - flat(ref)).abs().max().item()
    rtol, atol = (1e-10, 1e-12) if cuda else (1e-12, 1e-14)
    ok = same and torch.allclose(flat(net), flat(ref), rtol=rtol, atol=atol)
    print("ddp_train: %d ranks, %d steps over %s on %s, %d parameters: ranks agree: %s; max |ddp - single| = %.3g; %s"
          % (world, steps, transport, device.type, n, same, diff, "OK" if ok else "MISMATCH"), flush=True)
    if left:
        print("ddp_train: %d pool buffers still live" % left)
    return 0 if ok and not left else 1


def rank_r(store, rank, world, steps, transport, device):
    net = model(device)
    x, y = shard(rank, world, device)
    cuda = device.type == "cuda"
    n = sum(p.numel() for p in net.parameters())
    address = store.get(ADDRESS_KEY).decode()  # waits until rank 0 has set it
    with tensorrpc.Client(address, transports=[transport], output="torch") as c:
        for step in range(steps):
            # On the CPU pool memory (sending it costs no copy), on a GPU a
            # CUDA tensor (sent staged).
            g = torch.empty(n, dtype=torch.float64, device=device) if cuda else c.empty(n, torch.float64)
            gradient(net, x, y, out=g)
            c.send("grad/%d/%d" % (step, rank), g, timeout=60)
            # Rank 0 publishes it once it has every gradient; with a GPU it
            # lands in device memory.
            avg = c.fetch("avg/%d" % step, wait=True, timeout=60, device=device if cuda else None)
            apply(net, avg)
            del g, avg
        c.send("params/%d" % rank, flat(net), timeout=60)
    store.set("tensorrpc/done/%d" % rank, "1")
    return 0


def torchrun_workarounds():
    """Flags this torch's torchrun needs to start at all: Debian bookworm's
    torch 1.13 on Python 3.11 cannot parse its default --redirects/--tee
    (an IntFlag change); a mapping for a local rank that does not exist
    sidesteps that and changes nothing."""
    try:
        from torch.distributed.elastic.multiprocessing.api import Std
        broken = Std.from_str("0") is None
    except Exception:
        broken = False
    return ["--redirects", "9:0", "--tee", "9:0"] if broken else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp", "grpc"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where ranks train: cuda uses GPU LOCAL_RANK (modulo the GPUs visible)")
    ap.add_argument("--nproc", type=int, default=2,
                    help="processes to start on this host when run without torchrun (default 2)")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        # Not under torchrun: be our own launcher, as `torchrun --standalone` would be.
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_workarounds(), "--standalone",
               "--nproc_per_node", str(args.nproc), os.path.abspath(__file__), "--steps", str(args.steps), "--transport", args.transport,
               "--device", args.device]
        return subprocess.call(cmd)
    store, rank, world = store_from_env()
    if BATCH % world:
        raise SystemExit("ddp_train: WORLD_SIZE %d does not divide the batch of %d" % (world, BATCH))
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("ddp_train: --device cuda, but this PyTorch sees no CUDA device")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if rank == 0:
        return rank0(store, world, args.steps, args.transport, device)
    return rank_r(store, rank, world, args.steps, args.transport, device)


if __name__ == "__main__":
    sys.exit(main())
