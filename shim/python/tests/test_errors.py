"""Bad arguments and misuse raise clear exceptions carrying a status code,
and leave the library working: nothing crashes, nothing leaks."""

import ctypes
import gc
import time
import unittest

import numpy as np

import tensorrpc
from tensorrpc import _lib

import _need


class ErrorTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.srv = tensorrpc.Server()
        cls.c = tensorrpc.Client(cls.srv.address)
        cls.srv.handle("echo", lambda meta, ts: (meta, ts))

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.srv.close()

    def tearDown(self):
        # After every failure the session still works.
        x = np.arange(10, dtype=np.int32)
        self.c.send("alive", x)
        self.assertTrue((self.srv.take("alive", timeout=5) == x).all())
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), 0)

    def assert_code(self, cls, code, fn, *args, **kw):
        with self.assertRaises(cls) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.code, code)
        self.assertEqual(cm.exception.code_name, {v: k for k, v in tensorrpc.CODES.items()}[code])
        return cm.exception

    def test_wrong_dtype(self):
        for bad in (np.array(["a", "b"]), np.zeros(3, dtype=object), np.zeros(3, dtype=np.longdouble),
                    np.zeros(3, dtype=">f4"), np.zeros(3, dtype=[("a", "i4")]), np.zeros(2, dtype="datetime64[s]")):
            with self.subTest(dtype=bad.dtype):
                e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", bad)
                self.assertIn("dtype", str(e))
                self.assertIsInstance(e, ValueError)
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.empty, (3,), "float128")
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.empty, (3,), "str")

    def test_not_a_tensor(self):
        for bad in ([1, 2, 3], None, "abc", 3.5):
            with self.subTest(value=bad):
                self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", bad)
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, 42, np.zeros(3))  # key

    def test_non_contiguous(self):
        a = np.arange(100, dtype=np.float32).reshape(10, 10)
        for bad in (a[:, 1], a.T, a[::2]):
            e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", bad)
            self.assertIn("contiguous", str(e))
        e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.srv.publish, "k", a.T)
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.call, "echo", b"", [a[:, ::2]])

    def test_torch_arguments(self):
        torch = _need.module(self, "torch", "python3-torch")
        t = torch.arange(100, dtype=torch.float32).reshape(10, 10)
        e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", t.t())
        self.assertIn("contiguous", str(e))
        e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", torch.empty(3, device="meta"))
        self.assertIn("device", str(e))
        e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", torch.zeros(3, 3).to_sparse())
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.send, "k", torch.zeros(3, dtype=torch.cfloat).conj())
        # uint16 has no torch dtype in torch 1.13
        self.srv.publish("u16", np.arange(3, dtype=np.uint16))
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.fetch, "u16", output="torch")
        self.srv.unpublish("u16")

    def test_bfloat16_to_numpy(self):
        with self.c.empty((4,), "bfloat16", output="tensor") as t:
            self.c.send("bf", t)
        e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.srv.take, "bf")
        self.assertIn("bfloat16", str(e))

    def test_bad_options(self):
        self.assert_code(tensorrpc.InvalidArgumentError, 3, tensorrpc.Server, transports=["carrier-pigeon"])
        self.assert_code(tensorrpc.InvalidArgumentError, 3, tensorrpc.Client, self.srv.address, transports="nope")
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.fetch, "k", output="pandas")
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.fetch, "k", timeout=-1)
        self.assert_code(tensorrpc.InvalidArgumentError, 3, tensorrpc.Server, "not an address")
        self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.empty, (-1, 3), "float32")

    def test_options_layout(self):
        # _lib.Options mirrors trpc_options of tensorrpc.h field by field;
        # data_address (ABI version 2) is appended after the version-1 fields.
        self.assertEqual([n for n, _ in _lib.Options._fields_],
                         ["transports", "eager_threshold", "pool_limit", "max_tensor_bytes",
                          "connect_timeout_ms", "data_address"])
        self.assertEqual(_lib.Options.data_address.offset, 40)
        self.assertEqual(ctypes.sizeof(_lib.Options), 48)
        self.assertEqual(_lib.lib.trpc_abi_version(), _lib.ABI_VERSION)

    def test_data_address(self):
        # A data address for the tcp data plane; a client ignores it.
        for addr in ("127.0.0.1", "127.0.0.1:0"):
            with self.subTest(data_address=addr):
                with tensorrpc.Server(transports=["tcp"], data_address=addr) as srv, \
                        tensorrpc.Client(srv.address, transports=["tcp"]) as c:
                    self.assertEqual(c.transport, "tcp")
                    x = np.arange(50000, dtype=np.float32)  # over the eager threshold
                    srv.publish("k", x)
                    self.assertTrue((c.fetch("k") == x).all())
                    srv.unpublish("k")
        # An address that is not this host's (TEST-NET-1) reaches the tcp
        # data plane, which cannot listen there: the session falls back.
        with tensorrpc.Server(transports=["tcp", "grpc"], data_address="192.0.2.1") as srv, \
                tensorrpc.Client(srv.address, transports=["tcp", "grpc"]) as c:
            self.assertEqual(c.transport, "grpc")
        self.assert_code(tensorrpc.InvalidArgumentError, 3, tensorrpc.Server, data_address=5)
        with self.assertRaises(TypeError):
            tensorrpc.Client(self.srv.address, data_address="127.0.0.1")

    def test_closed_client_and_server(self):
        srv = tensorrpc.Server()
        c = tensorrpc.Client(srv.address)
        c.close()
        c.close()  # twice is fine
        for fn, args in ((c.fetch, ("k",)), (c.send, ("k", np.zeros(3))), (c.call, ("echo",)),
                         (c.empty, ((3,), "int8")), (c.stats, ()), (c.pool_stats, ()),
                         (c.send_rows, ("k", [0], np.zeros((1, 3))))):
            with self.subTest(fn=fn.__name__):
                e = self.assert_code(tensorrpc.FailedPreconditionError, 9, fn, *args)
                self.assertIn("closed", str(e))
        srv.close()
        for fn, args in ((srv.publish, ("k", np.zeros(3))), (srv.fetch, ("k",)), (srv.handle, ("m", print))):
            with self.subTest(fn=fn.__name__):
                self.assert_code(tensorrpc.FailedPreconditionError, 9, fn, *args)

    def test_closed_handles_in_c(self):
        # The C ABI refuses stale handles by itself.
        err = ctypes.c_void_p()
        dl = _lib.DLTensor()
        code = _lib.lib.trpc_client_send(987654321, b"k", ctypes.byref(dl), -1, ctypes.byref(err))
        self.assertEqual(code, 9)
        self.assertIn("closed or unknown", _lib.take_string(err.value))

    def test_bad_dltensor_in_c(self):
        # Malformed DLTensors straight into the C ABI: each is refused.
        buf = (ctypes.c_float * 8)()
        shape = (ctypes.c_int64 * 2)(2, 4)
        good_strides = (ctypes.c_int64 * 2)(4, 1)
        bad_strides = (ctypes.c_int64 * 2)(1, 2)

        def dl(**kw):
            d = _lib.DLTensor()
            d.data = ctypes.addressof(buf)
            d.device = _lib.DLDevice(1, 0)
            d.ndim = 2
            d.dtype = _lib.DLDataType(2, 32, 1)
            d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
            for k, v in kw.items():
                setattr(d, k, v)
            return d

        h = self.c._handle()
        cases = {
            "device": dl(device=_lib.DLDevice(4, 0)),  # kDLOpenCL (CUDA, 2, is taken: test_cuda)
            "lanes": dl(dtype=_lib.DLDataType(2, 32, 4)),
            "dtype code": dl(dtype=_lib.DLDataType(9, 32, 1)),
            "bits": dl(dtype=_lib.DLDataType(2, 24, 1)),
            "strides": dl(strides=ctypes.cast(bad_strides, ctypes.POINTER(ctypes.c_int64))),
            "null data": dl(data=None),
            "null shape": dl(shape=None),
            "ndim": dl(ndim=-1),
            "rank": dl(ndim=33),
        }
        for name, d in cases.items():
            with self.subTest(case=name):
                err = ctypes.c_void_p()
                self.assertEqual(_lib.lib.trpc_client_send(h, b"k", ctypes.byref(d), -1, ctypes.byref(err)), 3)
                self.assertTrue(_lib.take_string(err.value))
        err = ctypes.c_void_p()
        self.assertEqual(_lib.lib.trpc_client_send(h, b"k", None, -1, ctypes.byref(err)), 3)
        _lib.take_string(err.value)
        # Compact strides are accepted.
        d = dl(strides=ctypes.cast(good_strides, ctypes.POINTER(ctypes.c_int64)))
        self.assertEqual(_lib.lib.trpc_client_send(h, b"k", ctypes.byref(d), -1, None), 0)
        self.assertEqual(self.srv.take("k").tolist(), [[0.0] * 4] * 2)

    def test_timeout_and_missing(self):
        # A key that is not published fails at once, as rpc's Fetch does ...
        for fn in (self.c.fetch, self.srv.fetch, self.srv.take):
            with self.subTest(fn=fn.__qualname__):
                start = time.monotonic()
                e = self.assert_code(tensorrpc.NotFoundError, 5, fn, "never", timeout=30)
                self.assertLess(time.monotonic() - start, 10)
                self.assertIn("never", str(e))
                self.assertIsInstance(e, LookupError)
        # ... unless the caller waits for it, until the timeout.
        self.assert_code(tensorrpc.DeadlineExceededError, 4, self.c.fetch, "never", wait=True, timeout=0.05)
        self.assert_code(tensorrpc.DeadlineExceededError, 4, self.srv.fetch, "never", wait=True, timeout=0.05)
        self.assert_code(tensorrpc.DeadlineExceededError, 4, self.srv.take, "never", wait=True, timeout=0.05)
        self.assert_code(tensorrpc.UnimplementedError, 12, self.c.call, "no-such-method")

    def test_unknown_fetch_flags_in_c(self):
        out, err = ctypes.c_void_p(), ctypes.c_void_p()
        self.assertEqual(_lib.lib.trpc_client_fetch(self.c._handle(), b"k", 4, 1000, ctypes.byref(out),
                                                    ctypes.byref(err)), 3)
        self.assertIn("flags", _lib.take_string(err.value))
        self.assertEqual(_lib.lib.trpc_server_fetch(self.srv._handle(), b"k", 4, 1000, ctypes.byref(out),
                                                    ctypes.byref(err)), 3)
        self.assertIn("flags", _lib.take_string(err.value))

    def test_rows_in_c(self):
        # The rows functions of ABI version 4 refuse bad arguments by
        # themselves.
        h, srv = self.c._handle(), self.srv._handle()
        buf = (ctypes.c_float * 8)()
        shape = (ctypes.c_int64 * 2)(2, 4)
        d = _lib.DLTensor()
        d.data = ctypes.addressof(buf)
        d.device = _lib.DLDevice(1, 0)
        d.ndim = 2
        d.dtype = _lib.DLDataType(2, 32, 1)
        d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        self.assertEqual(_lib.lib.trpc_server_publish_flags(srv, b"m", ctypes.byref(d), _lib.PUBLISH_WRITABLE, None), 0)
        rows = (ctypes.c_int64 * 2)(1, 0)
        out = ctypes.c_void_p()
        calls = {
            "fetch_into: NULL rows": lambda err: _lib.lib.trpc_client_fetch_into(
                h, b"m", ctypes.byref(d), None, 2, 0, 1000, err),
            "fetch_into: flags": lambda err: _lib.lib.trpc_client_fetch_into(
                h, b"m", ctypes.byref(d), rows, 2, 4, 1000, err),
            "fetch_into: NULL key": lambda err: _lib.lib.trpc_client_fetch_into(
                h, None, ctypes.byref(d), rows, 2, 0, 1000, err),
            "fetch_into: NULL dst": lambda err: _lib.lib.trpc_client_fetch_into(h, b"m", None, rows, 2, 0, 1000, err),
            "fetch_rows: no rows": lambda err: _lib.lib.trpc_client_fetch_rows(
                h, b"m", rows, 0, 0, 1000, ctypes.byref(out), err),
            "fetch_rows: NULL rows": lambda err: _lib.lib.trpc_client_fetch_rows(
                h, b"m", None, 2, 0, 1000, ctypes.byref(out), err),
            "fetch_rows: flags": lambda err: _lib.lib.trpc_client_fetch_rows(
                h, b"m", rows, 2, 4, 1000, ctypes.byref(out), err),
            "fetch_rows: NULL out": lambda err: _lib.lib.trpc_client_fetch_rows(h, b"m", rows, 2, 0, 1000, None, err),
            "fetch_rows: too many": lambda err: _lib.lib.trpc_client_fetch_rows(
                h, b"m", rows, (1 << 20) + 1, 0, 1000, ctypes.byref(out), err),
            "send_rows: no rows": lambda err: _lib.lib.trpc_client_send_rows(h, b"m", None, 0, ctypes.byref(d), 1000, err),
            "send_rows: NULL src": lambda err: _lib.lib.trpc_client_send_rows(h, b"m", rows, 2, None, 1000, err),
            "publish_flags: flags": lambda err: _lib.lib.trpc_server_publish_flags(srv, b"m", ctypes.byref(d), 6, err),
        }
        for name, call in calls.items():
            with self.subTest(case=name):
                err = ctypes.c_void_p()
                self.assertEqual(call(ctypes.byref(err)), 3)
                self.assertTrue(_lib.take_string(err.value))
        self.assertIsNone(out.value)
        # The same rows, well formed, work.
        self.assertEqual(_lib.lib.trpc_client_fetch_into(h, b"m", ctypes.byref(d), rows, 2, 0, 1000, None), 0)
        self.assertEqual(_lib.lib.trpc_client_send_rows(h, b"m", rows, 2, ctypes.byref(d), 1000, None), 0)
        self.assertTrue(self.srv.unpublish("m"))

    def test_handler_errors(self):
        def fails(meta, ts):
            raise KeyError("boom")

        def bad_code(meta, ts):
            raise tensorrpc.ResourceExhaustedError("too big")

        def bad_reply(meta, ts):
            return b"", [np.zeros(4)[::2]]

        self.srv.handle("fails", fails)
        self.srv.handle("bad_code", bad_code)
        self.srv.handle("bad_reply", bad_reply)
        with self.assertLogs("tensorrpc", "ERROR") as logs:  # each with its traceback
            e = self.assert_code(tensorrpc.Error, 2, self.c.call, "fails", b"", [np.zeros(100000)])
            self.assertIn("KeyError", str(e))
            self.assert_code(tensorrpc.ResourceExhaustedError, 8, self.c.call, "bad_code")
            e = self.assert_code(tensorrpc.InvalidArgumentError, 3, self.c.call, "bad_reply")
            self.assertIn("contiguous", str(e))
        self.assertEqual(len(logs.records), 3)

    def test_too_large(self):
        with tensorrpc.Server(max_tensor_bytes=1 << 20) as srv, tensorrpc.Client(srv.address) as c:
            self.assert_code(tensorrpc.ResourceExhaustedError, 8, c.send, "k", np.zeros(1 << 20, np.uint16))


if __name__ == "__main__":
    unittest.main()
