"""Shared by the tests and peer.py: the test pattern (the same as
shim/internal/gopeer's), the server and client halves of the cross-process
protocol, and helpers to run peer processes.

Protocol: a server publishes "srv/<dtype>/<size>" for every dtype and the
two sizes and serves "echo" (reply = request, metadata prefixed with
"echo:"); a client fetches each, checks it bit for bit, sends it back as
"back/<dtype>/<size>" and calls "echo"; the server then checks "back/*".
"""

import ctypes
import os
import selectors
import subprocess
import sys
import time

import numpy as np

import tensorrpc

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable
SIZES = {"small": (3, 5), "large": (4, 25000)}  # under / over the eager threshold
NAMES = list(tensorrpc.DTYPES)  # in wire-number order: bool is 1, ... complex128 is 15


def pattern(name, shape):
    """The bytes of the test tensor of dtype name: byte i is (131*i + 7 +
    wire number) mod 256, its low bit only for bool."""
    itemsize = tensorrpc.DTYPES[name][1] // 8
    n = int(np.prod(shape, dtype=np.int64)) * itemsize
    raw = ((np.arange(n, dtype=np.uint64) * 131 + 7 + NAMES.index(name) + 1) & 0xFF).astype(np.uint8)
    if name == "bool":
        raw &= 1
    return raw.tobytes()


def numpy_pattern(name, shape):
    """The test tensor as a NumPy array (not for bfloat16)."""
    return np.frombuffer(pattern(name, shape), dtype=name).reshape(shape)


def filled(owner, name, shape):
    """A pool tensor of owner (Server or Client) holding the pattern, as a
    tensorrpc.Tensor: works for every dtype, bfloat16 included, without
    torch."""
    t = owner.empty(shape, name, output="tensor")
    data = pattern(name, shape)
    ctypes.memmove(t.data_ptr, data, len(data))
    return t


def tensor_bytes(t):
    """The bytes of a tensorrpc.Tensor, NumPy array or torch tensor."""
    if isinstance(t, tensorrpc.Tensor):
        return ctypes.string_at(t.data_ptr, t.nbytes) if t.nbytes else b""
    if isinstance(t, np.ndarray):
        return t.tobytes()
    import torch
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_tensor(what, t, name, shape):
    dtype = t.dtype if isinstance(t, tensorrpc.Tensor) else str(t.dtype).replace("torch.", "")
    if dtype != name or tuple(t.shape) != tuple(shape):
        raise AssertionError("%s: got %s%s, want %s%s" % (what, dtype, tuple(t.shape), name, shape))
    if tensor_bytes(t) != pattern(name, shape):
        raise AssertionError("%s: bytes differ from the pattern" % what)


def serve_setup(srv):
    """The server half: publish srv/* and serve echo."""
    for name in NAMES:
        for size, shape in SIZES.items():
            with filled(srv, name, shape) as t:
                srv.publish("srv/%s/%s" % (name, size), t)
    srv.handle("echo", lambda meta, ts: (b"echo:" + meta, ts), output="tensor")


def serve_check(srv):
    """Checks back/* and returns how many tensors came back."""
    n = 0
    for name in NAMES:
        for size, shape in SIZES.items():
            # The client sent these before it ended; wait (up to 5 s) for a
            # transfer that may still be landing rather than fail NOT_FOUND.
            with srv.take("back/%s/%s" % (name, size), wait=True, timeout=5, output="tensor") as t:
                check_tensor("back/%s/%s" % (name, size), t, name, shape)
            n += 1
    return n


def client_checks(c):
    """The client half against a server running serve_setup (Python) or
    gopeer serve (Go)."""
    for name in NAMES:
        for size, shape in SIZES.items():
            key = "%s/%s" % (name, size)
            with c.fetch("srv/" + key, timeout=10, output="tensor") as t:
                check_tensor("srv/" + key, t, name, shape)
                c.send("back/" + key, t)  # a pool tensor: no copy
        reqs = [filled(c, name, shape) for shape in SIZES.values()]
        meta, outs = c.call("echo", name.encode(), reqs, timeout=10, output="tensor")
        if meta != b"echo:" + name.encode() or len(outs) != 2:
            raise AssertionError("echo %s: metadata %r, %d tensors" % (name, meta, len(outs)))
        for t, shape in zip(outs, SIZES.values()):
            check_tensor("echo " + name, t, name, shape)
            t.release()
        for t in reqs:
            t.release()


# The tensors of the rows tests, published by rows_setup (Python) and
# gopeer serve-rows (Go): float32 (ROWS_N, ROWS_COLS), element j of row r
# holding r*ROWS_COLS + j, as "kv" (writable) and "ro" (not writable).
ROWS_N, ROWS_COLS = 64, 4096  # 16 KiB rows: a few of them pass the eager threshold


def rows_pattern():
    return np.arange(ROWS_N * ROWS_COLS, dtype=np.float32).reshape(ROWS_N, ROWS_COLS)


def rows_setup(srv):
    """Publishes "kv" (writable, in place: a pool tensor) and "ro"."""
    with srv.empty((ROWS_N, ROWS_COLS), "float32", output="tensor") as t:
        t.numpy()[:] = rows_pattern()
        srv.publish("kv", t, writable=True)
    srv.publish("ro", rows_pattern())  # its own copy in the pool


def written_row(r, round_):
    """What round round_ of a writer writes into row r."""
    return np.full(ROWS_COLS, 1e6 + 1000 * round_ + r, np.float32)


def write_rows(c, rows, rounds):
    """send_rows of rows, each holding written_row(r, i) in round i; the
    last round's values stay."""
    for i in range(rounds):
        c.send_rows("kv", rows, np.stack([written_row(r, i) for r in rows]), timeout=30)


class Peer:
    """A peer process: a server prints "ADDR host:port" and serves until
    stop(); a client runs and exits."""

    def __init__(self, args, env=None):
        self.args = args
        # Unbuffered: readline then reads no further than its line, so that
        # a second read_line's select sees the lines after it (a buffered
        # reader could have taken them in with the first).
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, bufsize=0)

    def read_line(self, prefix, timeout=30):
        """Waits for the stdout line starting with prefix and returns the rest."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not sel.select(deadline - time.monotonic()):
                    break
                line = self.proc.stdout.readline().decode()
                if not line:
                    break
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
        finally:
            sel.close()
        self.kill()
        raise AssertionError("%s: no %r line; stderr:\n%s" % (self.args, prefix, self.proc.stderr.read().decode()))

    def stop(self, stdin=b"", timeout=30):
        """Sends stdin, closes it, waits; returns (exit code, stdout, stderr)."""
        try:
            out, err = self.proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out.decode(), err.decode()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        """Idempotent clean-up for addCleanup."""
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()


def gopeer():
    """The gopeer binary from $TENSORRPC_GOPEER, or None."""
    p = os.environ.get("TENSORRPC_GOPEER")
    return p if p and os.path.exists(p) else None


def python_peer(*args):
    return [PYTHON, os.path.join(HERE, "peer.py")] + list(args)
