"""Fetch latency of a published tensor: the Python client (each output
form) against the Go client, and PyTorch's own RPC, in one run.

    PYTHONPATH=shim/python /usr/bin/python3 shim/examples/bench_latency.py \\
        [--sizes 4K,64K,1M,16M,256M] [--transports shm,tcp] [--rounds 4] [--iters 200] [--no-torch-rpc]

For each transport and size one Go server (gopeer bench-serve) publishes a
tensor of that size (pseudo-random bytes, which the tcp plane's auto
compression samples and sends as they are), and the rounds alternate (who
goes first alternates too) between:
  go             gopeer bench-client -ops fetch: rpc.Client.Fetch + Release;
  c              bench_capi.c, compiled here with cc when there is one: the
                 C ABI from a C thread (trpc_client_fetch + the deleter),
                 which is go plus what the ABI costs;
  py-raw         the same two C functions called from Python with ctypes,
                 none of the package's Python around them: c plus what
                 ctypes costs (py-tensor less py-raw is the package's own
                 Python);
  socket, socket2  (tcp only) the kernel's ceiling between the same two
                 processes: gopeer bench-client -ops socket asks the
                 server's raw TCP socket for the same bytes and reads them
                 into one buffer, over one connection, or over two at once
                 (half each, as a striped Fetch's two lanes);
  py-tensor      Client.fetch(key, output="tensor"), then dropped;
  py-numpy       the same, output="numpy";
  py-torch       the same, output="torch";
  py-out         Client.fetch(key, out=array): into one NumPy array of the
                 tensor's dtype and shape, made once (what a framework
                 refreshing its own tensors does; on tcp the server writes
                 a tensor of up to 4 MiB straight into it);
  go-out         its Go counterpart, gopeer bench-client -ops fetch_into:
                 rpc.Client.Fetch with rpc.Into, into one Go slice of the
                 tensor's dtype and shape (py-out less go-out is what the
                 Python and the C ABI around it cost);
  torch-rpc      torch.distributed.rpc.rpc_sync (TensorPipe backend, two
                 processes of their own) returning a uint8 tensor of the
                 size that the callee holds; shm: TensorPipe's "shm"
                 transport and "cma" channel, tcp: "uv" and "basic";
                 stopped (SIGSTOP) outside its own rounds, as its shm
                 transport busy-polls two cores while idle.
Every client is a process of its own, talking to a server in another
process, and measures each call with its own clock after a warm-up call.
Sizes up to 1 MiB make --iters calls per round, larger ones enough to
move --big-bytes (512 MiB) a round and at least --big-iters (at 16 MiB,
32: with 8, a p50 of 32 calls moved 10-30% from run to run here). It prints a Markdown table (p50, p99, GB/s at p50, and the
ratios to go's p50 and of torch-rpc's p50 to py-tensor's, all from this run;
"by round": the median over rounds of a round's p50 against the go round's
of the same round, which a host whose speed drifts between rounds moves
less than the ratio of the pooled p50s;
and the client process's voluntary context switches per call, all threads:
how often one of its threads slept and was woken) and one JSON line per
case. gopeer is $TENSORRPC_GOPEER, else built with
`go build`. Torch RPC runs where torch is importable (not with
--no-torch-rpc).
"""

import argparse
import ctypes
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))

import tensorrpc  # noqa: E402
from _common import Peer  # noqa: E402

BIG = 1 << 20  # sizes above this make --big-iters calls per round
OUTPUTS = ("tensor", "numpy", "torch")


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("IB")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def size_name(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d %s" % (n >> shift, unit)
    return "%d B" % n


def gopeer_binary(tmp):
    p = os.environ.get("TENSORRPC_GOPEER")
    if p:
        return p
    p = os.path.join(tmp, "gopeer")
    subprocess.run(["go", "build", "-o", p, "./shim/internal/gopeer"], cwd=os.path.join(HERE, "..", ".."), check=True)
    return p


def percentile(ds, q):
    s = sorted(ds)
    return s[min(len(s) - 1, int(q * len(s)))]


# --- PyTorch RPC -----------------------------------------------------------

_held = {}


def _tensor_of(size):
    """Runs in the callee: the tensor of size bytes it returns (made once)."""
    import torch
    t = _held.get(size)
    if t is None:
        t = _held[size] = torch.ones(size, dtype=torch.uint8)
    return t


def torch_rpc_worker(rank, transport, port):
    """A process of the torch RPC pair: rank 0 (the callee) waits for the
    shutdown; rank 1 reads "SIZE ITERS" lines from stdin and prints the
    times of ITERS rpc_sync calls (after one warm-up) as a JSON line."""
    import torch.distributed.rpc as rpc
    if transport == "shm":
        tr, ch = ["shm"], ["cma", "basic"]
    else:
        tr, ch = ["uv"], ["basic"]
    opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:%d" % port, num_worker_threads=4,
                                           rpc_timeout=300, _transports=tr, _channels=ch)
    rpc.init_rpc("w%d" % rank, rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 1:
        print("READY", flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            size, iters = map(int, line.split())
            rpc.rpc_sync("w0", _tensor_of, args=(size,))
            ds = []
            switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            for _ in range(iters):
                t0 = time.perf_counter()
                t = rpc.rpc_sync("w0", _tensor_of, args=(size,))
                ds.append(time.perf_counter() - t0)
                del t
            switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches
            print(json.dumps([ds, switches / iters]), flush=True)
    rpc.shutdown()


class TorchRPC:
    """The two processes of a torch RPC pair on one transport. Between its
    own rounds the pair is stopped (SIGSTOP): idle, TensorPipe's shm
    transport busy-polls, and its two processes took both cores of the
    2-core VM (6 s of CPU in 3 s) from the other clients' rounds."""

    def __init__(self, transport):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-rpc-worker", transport, str(port)]
        env = dict(os.environ, GLOG_minloglevel="2")  # TensorPipe's shutdown notes
        self.callee = subprocess.Popen(cmd + ["0"], stdin=subprocess.DEVNULL, env=env)
        self.caller = subprocess.Popen(cmd + ["1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.caller.stdout.readline()
        if line.strip() != "READY":
            self.close()
            raise RuntimeError("torch rpc worker did not start")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig):
        for p in (self.callee, self.caller):
            if p.poll() is None:
                os.kill(p.pid, sig)

    def run(self, size, iters):
        self._signal(signal.SIGCONT)
        try:
            self.caller.stdin.write("%d %d\n" % (size, iters))
            self.caller.stdin.flush()
            return json.loads(self.caller.stdout.readline())
        finally:
            self._signal(signal.SIGSTOP)

    def close(self):
        self._signal(signal.SIGCONT)
        try:
            self.caller.stdin.close()
        except OSError:
            pass
        for p in (self.caller, self.callee):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def torch_available():
    try:
        import torch.distributed.rpc as rpc
        return rpc.is_available()
    except ImportError:
        return False


# --- tensorrpc -------------------------------------------------------------

def go_round(gopeer, addr, transport, size, iters, op="fetch"):
    out = subprocess.run([gopeer, "bench-client", "-addr", addr, "-transports", transport, "-size", str(size),
                          "-iters", str(iters), "-ops", op], capture_output=True, text=True, check=True)
    (r,) = json.loads(out.stdout)
    return r["times_s"], r["voluntary_switches_per_op"]


def c_binary(tmp):
    """bench_capi.c compiled against the library the package loads, or
    None (and why, on stderr) where it cannot be: no C compiler, no
    tensorrpc.h beside this script's checkout."""
    from tensorrpc import _lib

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    src = os.path.join(HERE, "bench_capi.c")
    inc = os.path.join(HERE, "..", "capi")
    if not cc or not os.path.exists(os.path.join(inc, "tensorrpc.h")):
        print("bench_latency: no C compiler or no shim/capi/tensorrpc.h: the c row is left out", file=sys.stderr)
        return None
    exe = os.path.join(tmp, "bench_capi")
    out = subprocess.run([cc, "-O2", "-o", exe, "-I", inc, src, os.path.abspath(_lib.library_path())],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print("bench_latency: compiling bench_capi.c failed, the c row is left out:\n" + out.stderr, file=sys.stderr)
        return None
    return exe


def socket_round(gopeer, socket_addr, op, size, iters):
    out = subprocess.run([gopeer, "bench-client", "-socket", socket_addr, "-size", str(size),
                          "-iters", str(iters), "-ops", op], capture_output=True, text=True, check=True)
    (r,) = json.loads(out.stdout)
    return r["times_s"], r["voluntary_switches_per_op"]


def c_round(exe, addr, transport, iters):
    out = subprocess.run([exe, addr, transport, str(iters)], capture_output=True, text=True, check=True)
    ds, switches = json.loads(out.stdout)
    return ds, switches


def raw_round(c, iters):
    """python_round without the package's Python: trpc_client_fetch and
    the deleter called with ctypes, as Client.fetch and Tensor.__del__
    call them."""
    from tensorrpc import _core

    fetch, release, clock = _core.lib.trpc_client_fetch, _core.lib.trpc_managed_deleter, time.perf_counter
    h = c._handle()
    res = _core._Results()
    err = ctypes.byref(res, _core._SECOND)
    ds = []

    def once():
        code = fetch(h, b"bench", 0, -1, res, err)
        if code != 0:
            _core._raise(code, res[1])
        release(res[0])

    once()  # warm-up
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(iters):
        t0 = clock()
        code = fetch(h, b"bench", 0, -1, res, err)
        if code != 0:
            _core._raise(code, res[1])
        release(res[0])
        ds.append(clock() - t0)
    return ds, (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches) / iters


def python_round(c, output, iters):
    fetch, clock = c.fetch, time.perf_counter
    fetch("bench", output=output)  # warm-up (dropped at once)
    ds = []
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(iters):
        t0 = clock()
        a = fetch("bench", output=output)
        del a
        ds.append(clock() - t0)
    return ds, (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches) / iters


def out_round(c, iters):
    """python_round for fetch(out=array), into one array made from a
    first fetch."""
    import numpy as np  # as output="numpy" needs it

    fetch, clock = c.fetch, time.perf_counter
    out = np.empty_like(fetch("bench", output="numpy"))
    fetch("bench", out=out)  # warm-up
    ds = []
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(iters):
        t0 = clock()
        fetch("bench", out=out)
        ds.append(clock() - t0)
    return ds, (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches) / iters


def measure_plane(gopeer, cbench, transport, size, iters, rounds, torch_rpc):
    """{case: ([seconds], [voluntary switches per call, by round])} for
    one transport and size, rounds alternating."""
    srv = Peer([gopeer, "bench-serve", "-transports", transport, "-size", str(size)])
    try:
        addr = srv.read_line("ADDR ")
        socket_addr = srv.read_line("SOCKET ") if transport == "tcp" else None
        res = {}
        with tensorrpc.Client(addr, transports=[transport]) as c:
            if c.transport != transport:
                raise RuntimeError("negotiated %s, not %s" % (c.transport, transport))
            cases = [("go", lambda: go_round(gopeer, addr, transport, size, iters))]
            if cbench is not None:
                cases.append(("c", lambda: c_round(cbench, addr, transport, iters)))
            cases.append(("py-raw", lambda: raw_round(c, iters)))
            if transport == "tcp":
                cases += [(op, lambda op=op: socket_round(gopeer, socket_addr, op, size, iters))
                          for op in ("socket", "socket2")]
            cases += [("py-" + o, lambda o=o: python_round(c, o, iters)) for o in OUTPUTS]
            cases.append(("py-out", lambda: out_round(c, iters)))
            cases.append(("go-out", lambda: go_round(gopeer, addr, transport, size, iters, "fetch_into")))
            if torch_rpc is not None:
                cases.append(("torch-rpc", lambda: torch_rpc.run(size, iters)))
            for r in range(rounds):
                for name, run in cases if r % 2 == 0 else cases[::-1]:
                    ds, switches = run()
                    res.setdefault(name, ([], [], []))
                    res[name][0].extend(ds)
                    res[name][1].append(switches)
                    res[name][2].append(percentile(ds, 0.5))
        code, _, err = srv.stop()
        if code != 0:
            raise RuntimeError("gopeer bench-serve: " + err)
        return res
    finally:
        srv.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M,256M")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per case")
    ap.add_argument("--iters", type=int, default=200, help="calls per round, sizes up to 1 MiB")
    ap.add_argument("--big-iters", type=int, default=8, help="least calls per round, larger sizes")
    ap.add_argument("--big-bytes", default="512M", help="bytes per round of a size's calls, larger sizes")
    ap.add_argument("--no-torch-rpc", action="store_true")
    ap.add_argument("--torch-rpc-worker", nargs=3, metavar=("TRANSPORT", "PORT", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_rpc_worker:
        transport, port, rank = args.torch_rpc_worker
        torch_rpc_worker(int(rank), transport, int(port))
        return
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    use_torch = not args.no_torch_rpc and torch_available()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gopeer = gopeer_binary(tmp)
        cbench = c_binary(tmp)
        for transport in args.transports.split(","):
            trpc = TorchRPC(transport) if use_torch else None
            try:
                for size in sizes:
                    iters = args.iters if size <= BIG else max(args.big_iters, parse_size(args.big_bytes) // size)
                    res = measure_plane(gopeer, cbench, transport, size, iters, args.rounds, trpc)
                    go50 = percentile(res["go"][0], 0.5)
                    py50 = percentile(res["py-tensor"][0], 0.5)
                    go_rounds = res["go"][2]
                    for case, (ds, switches, round_p50s) in res.items():
                        p50, p99 = percentile(ds, 0.5), percentile(ds, 0.99)
                        row = {"transport": transport, "bytes": size, "case": case, "n": len(ds),
                               "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "min_us": min(ds) * 1e6,
                               "p50_GBps": size / p50 / 1e9, "p50_over_go": p50 / go50,
                               "p50_over_go_by_round": statistics.median(
                                   c / g for c, g in zip(round_p50s, go_rounds)),
                               "switches_per_call": statistics.median(switches)}
                        if case == "torch-rpc":
                            row["p50_over_py_tensor"] = p50 / py50
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                if trpc is not None:
                    trpc.close()
    print()
    print("%d alternating rounds; %d calls per round up to 1 MiB, above as many as move %s and at least %d;"
          " one process per client, server in another" % (args.rounds, args.iters, args.big_bytes, args.big_iters))
    print()
    print("| plane | size | client | p50 µs | p99 µs | min µs | GB/s at p50 | p50 / go p50 | by round | torch-rpc p50 / py-tensor p50 | switches/call |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print("| %s | %s | %s | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %s | %.1f |" % (
            r["transport"], size_name(r["bytes"]), r["case"], r["p50_us"], r["p99_us"], r["min_us"],
            r["p50_GBps"], r["p50_over_go"], r["p50_over_go_by_round"],
            "%.2f" % r["p50_over_py_tensor"] if "p50_over_py_tensor" in r else "",
            r["switches_per_call"]))


if __name__ == "__main__":
    main()
