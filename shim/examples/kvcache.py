"""A paged KV cache moved between a prefill and a decode process by rows.

    python3 shim/examples/kvcache.py [--blocks 4096] [--block-bytes 65536] [--request 256]
        [--transports shm,tcp,grpc] [--rounds 5] [--iters 8] [--seed 1]

Build the library first as the shim's README says (`pip install -e
./shim/python`, or TENSORRPC_LIB=/path/to/libtensorrpc.so); without an
installed package the script puts shim/python on its path itself.

The prefill process (this script with --role prefill, started by the
decode side) owns the cache, a uint8 tensor [blocks, block_bytes] from
Server.empty (pool memory), published writable as "kv" so that writes land
in its memory. The decode process (this script) keeps its own
preallocated arrays and, per data plane, serves requests of --request
random block ids (distinct), measuring:

  rows         fetch(key, rows=ids, out=mine): the request's blocks in one call
  per-block    fetch(key, rows=[b], out=mine[i:i+1]) for each block: a call per block
  whole        fetch(key, out=cache): the whole cache, to pick the blocks from
  send_rows    send_rows(key, ids, mine): the blocks written back in one call
  send/block   send_rows(key, [b], mine[i:i+1]) for each block

Rounds alternate the operations (their order rotates); each round makes
--iters requests per operation. It prints, per plane, a Markdown table of
the median over rounds: the request's blocks per second, the GB/s moved
(whole counts the whole cache, which it moves), and how many times
faster `rows` (or `send_rows`) is. Then it checks that blocks written
with send_rows read back, and that the prefill process's own memory holds
what the decode side wrote, and prints OK.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import tensorrpc
except ImportError:  # not installed: the package of this checkout
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import tensorrpc

KEY = "kv"


def pattern(ids, block_bytes):
    """The contents of blocks ids, shape (len(ids), block_bytes): byte j of
    block b is (j mod 251 + b) mod 256, and its first 8 bytes are b."""
    ids = np.asarray(ids, np.int64)
    base = (np.arange(block_bytes) % 251).astype(np.uint8)
    out = base[None, :] + (ids % 256).astype(np.uint8)[:, None]
    if block_bytes >= 8:
        out[:, :8] = ids.astype("<i8").view(np.uint8).reshape(-1, 8)
    return out


def fill(cache, block_bytes, chunk=256):
    for start in range(0, len(cache), chunk):
        ids = np.arange(start, min(start + chunk, len(cache)))
        cache[start:start + len(ids)] = pattern(ids, block_bytes)


def prefill(args):
    """The prefill process: owns and publishes the cache; prints ADDR; on a
    stdin line "check" says whether its memory holds the pattern; exits
    when stdin closes."""
    srv = tensorrpc.Server(transports=args.transports.split(","))
    cache = srv.empty((args.blocks, args.block_bytes), "uint8")  # pool memory: published without a copy
    fill(cache, args.block_bytes)
    srv.publish(KEY, cache, writable=True)
    print("ADDR " + srv.address, flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            ok = all(np.array_equal(cache[s:s + 256], pattern(np.arange(s, min(s + 256, args.blocks)), args.block_bytes))
                     for s in range(0, args.blocks, 256))
            print("CHECK " + ("ok" if ok else "bad"), flush=True)
    srv.unpublish(KEY)
    del cache
    srv.close()
    return 0


class Decode:
    """The decode side's arrays and operations for one client."""

    def __init__(self, client, args):
        self.c = client
        self.args = args
        self.mine = np.empty((args.request, args.block_bytes), np.uint8)  # the request's blocks
        self.cache = np.empty((args.blocks, args.block_bytes), np.uint8)  # for the whole-tensor baseline
        self.mine[:] = 0
        self.cache[:] = 0  # touch every page before timing

    def rows(self, ids):
        self.c.fetch(KEY, rows=ids, out=self.mine, timeout=60)

    def per_block(self, ids):
        for i, b in enumerate(ids):
            self.c.fetch(KEY, rows=[b], out=self.mine[i:i + 1], timeout=60)

    def whole(self, ids):
        self.c.fetch(KEY, out=self.cache, timeout=600)

    def send_rows(self, ids):
        self.c.send_rows(KEY, ids, self.mine, timeout=60)

    def send_per_block(self, ids):
        for i, b in enumerate(ids):
            self.c.send_rows(KEY, [b], self.mine[i:i + 1], timeout=60)

    def check(self, op, ids):
        """After op's last request: the blocks it fetched are right."""
        got = self.cache[ids] if op == "whole" else self.mine
        if not np.array_equal(got, pattern(ids, self.args.block_bytes)):
            raise AssertionError("%s: the fetched blocks differ from the cache's" % op)


OPS = [  # name, method, bytes moved per request (None: the request's blocks), baseline of
    ("rows", "rows", None, None),
    ("per-block", "per_block", None, "rows"),
    ("whole", "whole", "cache", "rows"),
    ("send_rows", "send_rows", None, None),
    ("send/block", "send_per_block", None, "send_rows"),
]


def measure(client, args, rng):
    """{op: [seconds per request, one per round]}."""
    d = Decode(client, args)
    times = {name: [] for name, _, _, _ in OPS}
    ids = rng.choice(args.blocks, args.request, replace=False)
    for name, method, _, _ in OPS:  # warm-up: pool growth, registrations, page faults
        getattr(d, method)(ids)
    for r in range(args.rounds):
        order = OPS[r % len(OPS):] + OPS[:r % len(OPS)]
        for name, method, _, _ in order:
            sends = name.startswith("send")
            if sends:
                # mine holds the blocks of ids: the sends write them back
                # where they came from, so the cache keeps its contents.
                d.rows(ids)
                batches = [ids] * args.iters
            else:
                batches = [rng.choice(args.blocks, args.request, replace=False) for _ in range(args.iters)]
            fn = getattr(d, method)
            t0 = time.perf_counter()
            for b in batches:
                fn(b)
            times[name].append((time.perf_counter() - t0) / args.iters)
            if not sends:
                d.check(name, batches[-1])
    return times


def verify(client, args, rng):
    """send_rows lands: marked blocks read back, then the originals are
    restored."""
    ids = rng.choice(args.blocks, args.request, replace=False)
    marked = 255 - pattern(ids, args.block_bytes)
    client.send_rows(KEY, ids, marked, timeout=60)
    back = np.empty_like(marked)
    client.fetch(KEY, rows=ids, out=back, timeout=60)
    if not np.array_equal(back, marked):
        raise AssertionError("blocks written with send_rows did not read back")
    client.send_rows(KEY, ids, pattern(ids, args.block_bytes), timeout=60)


def report(plane, times, args):
    block = args.block_bytes
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print("\n%s: %d blocks of %d KiB, requests of %d blocks, median of %d rounds x %d requests\n"
          % (plane, args.blocks, block >> 10, args.request, args.rounds, args.iters))
    print("| op | calls/request | ms/request | blocks/s | GB/s | time / one-call op |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _, moved, baseline in OPS:
        t = med[name]
        nbytes = args.blocks * block if moved == "cache" else args.request * block
        calls = args.request if name in ("per-block", "send/block") else 1
        faster = "%.1f" % (t / med[baseline]) if baseline else ""
        print("| %s | %d | %.2f | %.0f | %.2f | %s |" % (name, calls, t * 1e3, args.request / t, nbytes / t / 1e9, faster))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--blocks", type=int, default=4096, help="blocks in the cache")
    ap.add_argument("--block-bytes", type=int, default=64 << 10, help="bytes per block")
    ap.add_argument("--request", type=int, default=256, help="blocks per request")
    ap.add_argument("--transports", default="shm,tcp,grpc", help="data planes, one after the other")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=8, help="requests per operation per round")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.role == "prefill":
        return prefill(args)
    if not 0 < args.request <= args.blocks:
        ap.error("--request must be between 1 and --blocks")

    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(tensorrpc.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "prefill", "--blocks", str(args.blocks),
           "--block-bytes", str(args.block_bytes), "--transports", args.transports]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("ADDR "):
            raise SystemExit("kvcache: the prefill process did not start (%r)" % line)
        addr = line.split()[1]
        rng = np.random.default_rng(args.seed)
        for plane in args.transports.split(","):
            with tensorrpc.Client(addr, transports=[plane]) as c:
                if c.transport != plane:
                    raise SystemExit("kvcache: asked for %s, got %s" % (plane, c.transport))
                report(plane, measure(c, args, rng), args)
                verify(c, args, rng)
        proc.stdin.write("check\n")
        proc.stdin.flush()
        line = proc.stdout.readline().strip()
        if line != "CHECK ok":
            raise SystemExit("kvcache: the prefill process's cache is not what the decode side wrote (%r)" % line)
        print("\nOK: fetched blocks checked, blocks written back read back, the prefill cache holds them")
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
