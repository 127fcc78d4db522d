"""Measures a Python-to-Python tensor transfer against the same transfer
Go-to-Go, per data plane.

    PYTHONPATH=shim/python /usr/bin/python3 shim/examples/bench_transfer.py [--size BYTES] [--iters N] [--transports shm,tcp]

For each transport it runs, in two processes each:
  Go:     gopeer bench-serve  + gopeer bench-client   (shim/internal/gopeer)
  Python: tests/peer.py bench-serve + this process as the client
and times, after one warm-up, ITERS transfers of each kind:
  fetch         the client fetches the server's published pool tensor
                (and releases it: `del` in Python, Release in Go);
  send_pool     the client sends a tensor in its pool (Python: Client.empty,
                Go: Client.NewTensor): no copy before the data plane;
  send_wrapped  the client sends a tensor over its own memory (a NumPy
                array / rpc.WrapTensor): one copy into the pool first.
Go and Python rounds alternate (--rounds, and which goes first alternates
too) so that both see the same machine state; it prints the median and best throughput of each side and the
Python/Go ratios. gopeer is $TENSORRPC_GOPEER, else built with `go build`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))

import tensorrpc  # noqa: E402
from _common import Peer, python_peer  # noqa: E402


def gopeer_binary(tmp):
    p = os.environ.get("TENSORRPC_GOPEER")
    if p:
        return p
    p = os.path.join(tmp, "gopeer")
    subprocess.run(["go", "build", "-o", p, "./shim/internal/gopeer"], cwd=os.path.join(HERE, "..", ".."), check=True)
    return p


def measure(f, iters):
    f()  # warm-up: pool growth, page faults
    ds = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        ds.append(time.perf_counter() - t0)
    return ds


def go_run(gopeer, transport, size, iters):
    srv = Peer([gopeer, "bench-serve", "-transports", transport, "-size", str(size)])
    try:
        addr = srv.read_line("ADDR ")
        out = subprocess.run([gopeer, "bench-client", "-addr", addr, "-transports", transport,
                              "-size", str(size), "-iters", str(iters)], capture_output=True, text=True, check=True)
        res = {r["op"]: r["times_s"] for r in json.loads(out.stdout)}
        code, _, err = srv.stop()
        if code != 0:
            raise RuntimeError("gopeer bench-serve: " + err)
        return res
    finally:
        srv.close()


def python_run(transport, size, iters):
    srv = Peer(python_peer("bench-serve", transport, str(size)))
    try:
        addr = srv.read_line("ADDR ")
        res = {}
        with tensorrpc.Client(addr, transports=[transport]) as c:
            if c.transport != transport:
                raise RuntimeError("negotiated %s, not %s" % (c.transport, transport))

            def fetch():
                a = c.fetch("bench")
                del a

            pooled = c.empty(size, "uint8")
            pooled[:] = 1
            wrapped = np.ones(size, np.uint8)
            res["fetch"] = measure(fetch, iters)
            res["send_pool"] = measure(lambda: c.send("sent", pooled), iters)
            res["send_wrapped"] = measure(lambda: c.send("sent", wrapped), iters)
            del pooled
        code, out, err = srv.stop()
        if code != 0:
            raise RuntimeError("peer.py bench-serve: " + out + err)
        return res
    finally:
        srv.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=10, help="transfers per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating Go and Python rounds")
    ap.add_argument("--transports", default="shm,tcp")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gopeer = gopeer_binary(tmp)
        print("%d-byte tensor; %d alternating rounds of %d timed transfers (after a warm-up) per side;"
              " two processes per side" % (args.size, args.rounds, args.iters))
        print("%-5s %-13s %9s %9s %9s %9s %8s %8s" % (
            "plane", "op", "Go med", "Py med", "Go best", "Py best", "med Py/Go", "best Py/Go"))
        print("%-5s %-13s %9s %9s %9s %9s" % ("", "", "GB/s", "GB/s", "GB/s", "GB/s"))
        for transport in args.transports.split(","):
            go, py = {}, {}
            for r in range(args.rounds):
                sides = [(go, lambda: go_run(gopeer, transport, args.size, args.iters)),
                         (py, lambda: python_run(transport, args.size, args.iters))]
                for acc, run in sides if r % 2 == 0 else sides[::-1]:  # alternate who goes first
                    for op, ts in run().items():
                        acc.setdefault(op, []).extend(ts)
            for op in ("fetch", "send_pool", "send_wrapped"):
                gm, pm = statistics.median(go[op]), statistics.median(py[op])
                gb, pb = min(go[op]), min(py[op])
                gbps = lambda t: args.size / t / 1e9  # noqa: E731
                print("%-5s %-13s %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f" % (
                    transport, op, gbps(gm), gbps(pm), gbps(gb), gbps(pb), gm / pm, gb / pb))


if __name__ == "__main__":
    main()
