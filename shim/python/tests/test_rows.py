"""Rows and the caller's memory: fetch(out=) lands the bytes exactly in the
caller's array and nowhere else, fetch(rows=) returns exactly the rows
asked for, send_rows writes rows of a tensor published writable, each over
shm, tcp and grpc in this process; the same against a Python and a Go
server in another process, with writers in other processes at once; and
on tcp the caller's memory moves without a copy into the pool."""

import contextlib
import gc
import threading
import unittest

import numpy as np

import tensorrpc
import _need
from _common import (ROWS_COLS, ROWS_N, Peer, gopeer, python_peer, rows_pattern, rows_setup, write_rows,
                     written_row)

TRANSPORTS = ["shm", "tcp", "grpc"]
GUARD = 4096  # bytes of sentinel on each side of an out array
SENTINEL = 0xA5


def guarded(shape, dtype=np.float32):
    """(buffer, out): out, of shape and dtype, is the middle of a larger
    byte buffer filled with SENTINEL, GUARD bytes from either end."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    buf = np.full(n + 2 * GUARD, SENTINEL, np.uint8)
    return buf, buf[GUARD:GUARD + n].view(dtype).reshape(shape)


class RowsCase(unittest.TestCase):

    def setUp(self):
        gc.collect()
        self.live = tensorrpc.live_tensors()

    def tearDown(self):
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), self.live, "tensors handed out and never released")

    def assert_code(self, cls, code, fn, *args, **kw):
        with self.assertRaises(cls) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.code, code)
        return cm.exception

    def assert_guards(self, buf, what):
        self.assertTrue((buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all(),
                        "%s: bytes outside out were written" % what)

    def assert_untouched(self, buf, what):
        self.assertTrue((buf == SENTINEL).all(), "%s: out was written" % what)


class RowsTest(RowsCase):
    """Server and clients in this process, on each data plane."""

    @contextlib.contextmanager
    def session(self, transport, **client_kw):
        with tensorrpc.Server(transports=[transport]) as srv, \
                tensorrpc.Client(srv.address, transports=[transport], **client_kw) as c:
            self.assertEqual(c.transport, transport)
            rows_setup(srv)
            yield srv, c
            srv.unpublish("kv")
            srv.unpublish("ro")

    def test_fetch_into(self):
        want = rows_pattern()
        cases = [
            (None, want),  # the whole tensor: 1 MiB, over the data plane
            ([5, 0, 63, 5], want[[5, 0, 63, 5]]),  # rows, a repeat among them, over the data plane
            ([7], want[[7]]),  # one row: inline
            (np.array([62, 1], np.int32), want[[62, 1]]),  # rows as an integer array
        ]
        for transport in TRANSPORTS:
            with self.session(transport) as (srv, c):
                for rows, expect in cases:
                    with self.subTest(transport=transport, rows=rows if rows is None else list(rows)):
                        buf, out = guarded(expect.shape)
                        got = c.fetch("kv", out=out, rows=rows, timeout=30)
                        self.assertIs(got, out)
                        self.assertTrue(np.array_equal(out, expect))
                        self.assert_guards(buf, "fetch into out")
                with self.subTest(transport=transport, out="pool tensor"):
                    with c.empty((2, ROWS_COLS), "float32", output="tensor") as t:
                        self.assertIs(c.fetch("kv", out=t, rows=[3, 9]), t)
                        self.assertTrue(np.array_equal(t.numpy(), want[[3, 9]]))
                with self.subTest(transport=transport, out="bytearray"):
                    raw = bytearray(ROWS_COLS * 4)
                    mv = memoryview(raw).cast("f", (1, ROWS_COLS))  # a writable buffer, no NumPy
                    self.assertIs(c.fetch("kv", out=mv, rows=[11]), mv)
                    self.assertEqual(bytes(raw), want[[11]].tobytes())

    def test_fetch_into_torch(self):
        torch = _need.module(self, "torch", "python3-torch")
        want = rows_pattern()
        for transport in TRANSPORTS:
            with self.subTest(transport=transport), self.session(transport) as (srv, c):
                big = torch.full((ROWS_COLS * 5,), -1.0)
                out = big[ROWS_COLS:4 * ROWS_COLS].view(3, ROWS_COLS)  # contiguous, in the middle
                self.assertIs(c.fetch("kv", out=out, rows=torch.tensor([40, 2, 17])), out)
                self.assertTrue(np.array_equal(out.numpy(), want[[40, 2, 17]]))
                self.assertTrue(bool((big[:ROWS_COLS] == -1).all()) and bool((big[4 * ROWS_COLS:] == -1).all()))
                whole = torch.empty(ROWS_N, ROWS_COLS)
                c.fetch("kv", out=whole)
                self.assertTrue(np.array_equal(whole.numpy(), want))

    def test_fetch_into_refused(self):
        # A wrong out is refused with InvalidArgumentError and not written.
        for transport in TRANSPORTS:
            with self.session(transport) as (srv, c):
                cases = {
                    "shape (whole)": ((ROWS_N - 1, ROWS_COLS), np.float32, None),
                    "shape (rows)": ((2, ROWS_COLS), np.float32, [1, 2, 3]),
                    "row shape": ((2, ROWS_COLS // 2), np.float32, [1, 2]),
                    "flat": ((ROWS_N * ROWS_COLS,), np.float32, None),
                    "dtype": ((ROWS_N, ROWS_COLS), np.int32, None),
                    "dtype (rows)": ((2, ROWS_COLS * 4), np.uint8, [1, 2]),
                }
                for name, (shape, dtype, rows) in cases.items():
                    with self.subTest(transport=transport, case=name):
                        buf, out = guarded(shape, dtype)
                        e = self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out, rows=rows)
                        self.assertIn("kv", str(e))
                        self.assert_untouched(buf, name)
                with self.subTest(transport=transport, case="missing key"):
                    buf, out = guarded((2, ROWS_COLS))
                    self.assert_code(tensorrpc.NotFoundError, 5, c.fetch, "nope", out=out)
                    self.assert_untouched(buf, "missing key")
        # Refused before the library is asked: read-only, non-contiguous,
        # a lease, no rows.
        with self.session("shm") as (srv, c):
            ro = np.zeros((ROWS_N, ROWS_COLS), np.float32)
            ro.flags.writeable = False
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=ro)
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=np.zeros((ROWS_COLS, ROWS_N), np.float32).T)
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=bytes(16), rows=[0])
            lease = c.fetch("kv", lease=True, output="tensor")
            self.assertTrue(lease.readonly)
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=lease)
            lease.release()
            buf, out = guarded((1, ROWS_COLS))
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out, lease=True)
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out, rows=[])
            self.assert_untouched(buf, "refused in Python")

    def test_fetch_into_same_out_again(self):
        # The client remembers how it described the last out; an out
        # changed in place since (shape, dtype, writability, memory) is
        # described again, and refused or written where it now is.
        import weakref
        want = rows_pattern()
        flat = (ROWS_N * ROWS_COLS,)
        for transport in TRANSPORTS:
            with self.subTest(transport=transport), self.session(transport) as (srv, c):
                out = np.zeros((ROWS_N, ROWS_COLS), np.float32)
                for _ in range(3):
                    out[:] = 0
                    self.assertIs(c.fetch("kv", out=out, timeout=30), out)
                    self.assertTrue(np.array_equal(out, want))
                out[:] = 0
                out.shape = flat  # in place: the same memory, another shape
                self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out)
                out.shape = (ROWS_N, ROWS_COLS)
                out.dtype = np.int32  # in place, the same itemsize
                self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out)
                out.dtype = np.float32
                out.flags.writeable = False
                self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out)
                out.flags.writeable = True
                self.assertTrue((out == 0).all(), "a refused fetch wrote out")
                # New memory under the same array object.
                out.resize((ROWS_N + 1, ROWS_COLS), refcheck=False)
                self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out)
                out.resize((ROWS_N, ROWS_COLS), refcheck=False)
                out[:] = 0
                c.fetch("kv", out=out, timeout=30)
                self.assertTrue(np.array_equal(out, want))
                # A fetch into the remembered out that times out keeps it
                # alive until close(), as a first one does; the client
                # keeps no other reference (NumPy's resize would refuse a
                # weak one).
                self.assert_code(tensorrpc.DeadlineExceededError, 4, c.fetch, "kv", out=out, timeout=0)
                out.resize((ROWS_N, ROWS_COLS + 1), refcheck=False)  # no weak reference either
                out.resize((ROWS_N, ROWS_COLS), refcheck=False)
                ref = weakref.ref(out)
                del out
                gc.collect()
                self.assertIsNotNone(ref(), "out was freed before close()")
                with c._lock:
                    c._late_outs.clear()
                gc.collect()
                self.assertIsNone(ref(), "the client keeps the last out alive")

    def test_fetch_into_same_torch_out_again(self):
        torch = _need.module(self, "torch", "python3-torch")
        want = rows_pattern()
        with self.session("tcp") as (srv, c):
            out = torch.zeros(ROWS_N, ROWS_COLS)
            c.fetch("kv", out=out, timeout=30)
            self.assertTrue(np.array_equal(out.numpy(), want))
            old = out.clone()
            out.set_(torch.zeros(ROWS_N, ROWS_COLS))  # other memory, the same tensor object
            c.fetch("kv", out=out, timeout=30)
            self.assertTrue(np.array_equal(out.numpy(), want))
            out.resize_(ROWS_N - 1, ROWS_COLS)
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out)
            out.set_(torch.zeros(ROWS_COLS, ROWS_N).t())  # not contiguous
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", out=out)
            self.assertTrue(bool((out == 0).all()) and np.array_equal(old.numpy(), want))

    def test_timed_out_out_kept_until_close(self):
        # rpc waits for a read under way when a fetch into out fails; the
        # client still keeps out alive until close(), belt and braces.
        import weakref
        with tensorrpc.Server(transports=["tcp"]) as srv:
            rows_setup(srv)
            c = tensorrpc.Client(srv.address, transports=["tcp"])
            out = np.empty((ROWS_N, ROWS_COLS), np.float32)
            ref = weakref.ref(out)
            self.assert_code(tensorrpc.DeadlineExceededError, 4, c.fetch, "kv", out=out, timeout=0)
            del out
            gc.collect()
            self.assertIsNotNone(ref(), "out was freed before close()")
            c.close()
            gc.collect()
            self.assertIsNone(ref(), "out kept after close")
            srv.unpublish("kv")
            srv.unpublish("ro")

    def test_rows(self):
        want = rows_pattern()
        for transport in TRANSPORTS:
            with self.session(transport) as (srv, c):
                with self.subTest(transport=transport, case="exact rows"):
                    for rows in ([0], [63, 0, 31], [9, 9, 9, 2], list(range(ROWS_N))[::-1], np.arange(10, 20, dtype=np.uint8)):
                        got = c.fetch("kv", rows=rows, timeout=30)
                        self.assertEqual(got.shape, (len(rows), ROWS_COLS))
                        self.assertTrue(np.array_equal(got, want[np.asarray(rows, np.int64)]), list(rows))
                    with c.fetch("kv", rows=[4, 1], output="tensor") as t:
                        self.assertEqual(t.shape, (2, ROWS_COLS))
                with self.subTest(transport=transport, case="out of range"):
                    before = c.stats()
                    allocs = c.pool_stats()["allocs"]
                    for rows in ([ROWS_N], [0, 1, ROWS_N + 100], [-1], [2, -5]):
                        self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", rows=rows)
                        buf, out = guarded((len(rows), ROWS_COLS))  # the right shape: only the rows are wrong
                        self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", rows=rows, out=out)
                        self.assert_untouched(buf, "rows %s" % rows)
                    after = c.stats()
                    for k in ("transfers", "data_plane_bytes", "inline_bytes", "stream_bytes", "copies"):
                        self.assertEqual(after[k], before[k], "%s moved: %s -> %s" % (k, before, after))
                    self.assertEqual(c.pool_stats()["allocs"], allocs)
                with self.subTest(transport=transport, case="bad rows"):
                    for rows in ([], "ab", [1.5], np.array([[1, 2]]), np.array([1.0]), 3, [1 << 63]):
                        self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", rows=rows)
                    self.assert_code(tensorrpc.NotFoundError, 5, c.fetch, "nope", rows=[0])
                    srv.publish("scalar", np.float32(1.5))
                    self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "scalar", rows=[0])
                    srv.unpublish("scalar")

    def test_send_rows(self):
        for transport in TRANSPORTS:
            with self.session(transport) as (srv, c):
                want = rows_pattern()
                with self.subTest(transport=transport, case="rows land"):
                    for rows in ([3, 60, 10], [33]):  # data plane, inline
                        src = np.stack([written_row(r, 0) for r in rows])
                        c.send_rows("kv", rows, src, timeout=30)
                        want[rows] = src
                        self.assertTrue(np.array_equal(c.fetch("kv"), want))
                        self.assertTrue(np.array_equal(srv.fetch("kv"), want))  # in place, in the server's tensor
                    torch = _need.module(self, "torch", "python3-torch")
                    c.send_rows("kv", np.array([20, 21]), torch.full((2, ROWS_COLS), 7.0))
                    want[[20, 21]] = 7.0
                    self.assertTrue(np.array_equal(c.fetch("kv"), want))
                with self.subTest(transport=transport, case="refused"):
                    src = np.ones((2, ROWS_COLS), np.float32)
                    e = self.assert_code(tensorrpc.PermissionDeniedError, 7, c.send_rows, "ro", [0, 1], src)
                    self.assertIsInstance(e, PermissionError)
                    self.assertIn("writable", str(e))
                    self.assertTrue(np.array_equal(c.fetch("ro"), rows_pattern()))
                    self.assert_code(tensorrpc.NotFoundError, 5, c.send_rows, "nope", [0, 1], src)
                    for rows, bad in (([1, 1], src), ([0, ROWS_N], src), ([0, -1], src), ([0], src),
                                      ([0, 1], src.astype(np.float64)), ([0, 1], np.ones((2, ROWS_COLS + 1), np.float32)),
                                      ([], src[:0]), ([0, 1], np.float32(1))):
                        self.assert_code(tensorrpc.InvalidArgumentError, 3, c.send_rows, "kv", rows, bad)
                    self.assertTrue(np.array_equal(c.fetch("kv"), want), "a refused send_rows wrote")

    def test_concurrent_send_rows(self):
        # Four writers (two clients, two threads each) write disjoint rows
        # at once, several rounds; every row holds its last round's value.
        rounds = 5
        for transport in TRANSPORTS:
            with self.subTest(transport=transport), self.session(transport) as (srv, c):
                with tensorrpc.Client(srv.address, transports=[transport]) as c2:
                    writers = [(c, list(range(0, ROWS_N, 4))), (c, list(range(1, ROWS_N, 4))),
                               (c2, list(range(2, ROWS_N, 4))), (c2, [r for r in range(3, ROWS_N, 4)][::-1])]
                    errors = []

                    def write(client, rows):
                        try:
                            write_rows(client, rows, rounds)
                        except Exception as e:  # reported below
                            errors.append(e)

                    threads = [threading.Thread(target=write, args=w) for w in writers]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(60)
                    self.assertFalse(any(t.is_alive() for t in threads), "writers hang")
                    self.assertEqual(errors, [])
                    want = np.stack([written_row(r, rounds - 1) for r in range(ROWS_N)])
                    self.assertTrue(np.array_equal(c2.fetch("kv"), want))
                    self.assertTrue(np.array_equal(srv.fetch("kv"), want))

    def test_no_copy_on_tcp(self):
        # On tcp the caller's memory is sent and received in place: the
        # client's copies stay 0 (data-plane sizes; inline ones are copied
        # into the frame). On shm too, where cross-memory attach works.
        big = rows_pattern()
        with self.session("tcp") as (srv, c):
            c.send("sent", big)
            self.assertTrue(np.array_equal(srv.take("sent"), big))
            out = np.empty_like(big)
            c.fetch("kv", out=out)
            rows_out = np.empty((8, ROWS_COLS), np.float32)
            c.fetch("kv", rows=list(range(8, 16)), out=rows_out)
            c.send_rows("kv", list(range(30, 38)), rows_out)
            torch = _need.module(self, "torch", "python3-torch")
            c.send("sent", torch.from_numpy(big))
            srv.take("sent")
            self.assertEqual(c.stats()["copies"], 0, c.stats())
            self.assertEqual(c.stats()["copied_bytes"], 0)
        with self.session("shm") as (srv, c):
            # shm reads caller memory by cross-memory attach (in one
            # process it always can): no copy either.
            c.send("sent", big)
            self.assertEqual(c.stats()["copies"], 0)
            self.assertTrue(np.array_equal(srv.take("sent"), big))


class RowsProcessTest(RowsCase):
    """A server in another process (Python and Go), written by clients in
    this process and in other processes at once."""

    def against(self, args, transport):
        p = Peer(args)
        self.addCleanup(p.close)
        addr = p.read_line("ADDR ")
        want = rows_pattern()
        with tensorrpc.Client(addr, transports=[transport]) as c:
            self.assertEqual(c.transport, transport)
            buf, out = guarded((4, ROWS_COLS))
            self.assertIs(c.fetch("kv", rows=[60, 0, 6, 60], out=out, timeout=30), out)
            self.assertTrue(np.array_equal(out, want[[60, 0, 6, 60]]))
            self.assert_guards(buf, "fetch into out")
            buf, out = guarded((2, ROWS_COLS))
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", rows=[0, ROWS_N], out=out)
            self.assert_code(tensorrpc.InvalidArgumentError, 3, c.fetch, "kv", rows=[0, 1, 2], out=out)
            self.assert_untouched(buf, "refused")
            self.assert_code(tensorrpc.PermissionDeniedError, 7, c.send_rows, "ro", [0], want[:1])
            # Writers: two threads here, two processes.
            rounds = 3
            others = [Peer(python_peer("write-rows", addr, transport, ",".join(str(r) for r in range(k, ROWS_N, 4)),
                                       str(rounds))) for k in (2, 3)]
            for o in others:
                self.addCleanup(o.close)
            errors = []

            def write(rows):
                try:
                    with tensorrpc.Client(addr, transports=[transport]) as w:
                        write_rows(w, rows, rounds)
                except Exception as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=write, args=(list(range(k, ROWS_N, 4)),)) for k in (0, 1)]
            for t in threads:
                t.start()
            for o in others:
                code, stdout, stderr = o.stop(timeout=60)
                self.assertEqual(code, 0, "writer failed:\n%s\n%s" % (stdout, stderr))
                self.assertIn("OK transport=" + transport, stdout)
            for t in threads:
                t.join(60)
            self.assertFalse(any(t.is_alive() for t in threads), "writers hang")
            self.assertEqual(errors, [])
            want = np.stack([written_row(r, rounds - 1) for r in range(ROWS_N)])
            self.assertTrue(np.array_equal(c.fetch("kv"), want))
            self.assertTrue(np.array_equal(c.fetch("ro"), rows_pattern()))
        code, stdout, stderr = p.stop()
        self.assertEqual(code, 0, "server failed:\n%s\n%s" % (stdout, stderr))
        self.assertIn("POOL allocs=0", stdout)

    def test_python_server(self):
        for transport in ("shm", "tcp", "grpc"):
            with self.subTest(transport=transport):
                self.against(python_peer("serve-rows", transport), transport)

    def test_go_server(self):
        if not gopeer():
            _need.missing(self, "TENSORRPC_GOPEER (the gopeer binary)",
                          "go build -o gopeer ./shim/internal/gopeer and set TENSORRPC_GOPEER")
        for transport in ("shm", "tcp", "grpc"):
            with self.subTest(transport=transport):
                self.against([gopeer(), "serve-rows", "-transports", transport], transport)


if __name__ == "__main__":
    unittest.main()
