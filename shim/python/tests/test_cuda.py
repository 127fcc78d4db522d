"""CUDA tensors (DLPack kDLCUDA) through the package, on the driver
emulator ($TENSORRPC_CUDA_LIBRARY) instead of a GPU: DLPack producers made
by hand over emulator memory are sent, called with, published and returned
from handlers; fetch(device="cuda:0") returns tensors in device memory the
library allocated; the bytes are compared through the driver. No CUDA build
of torch is needed."""

import gc
import os
import subprocess
import sys
import unittest

import _common
import _cudaemu
import tensorrpc
from tensorrpc import _lib

SHAPES = {"small": (3, 5), "large": (4, 25000)}  # under / over the eager threshold
HALF = ("float16", "bfloat16")


class CUDATest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.drv = _cudaemu.Driver()
        cls.srv = tensorrpc.Server(output="tensor")
        cls.srv.handle("echo", lambda meta, ts: (meta, ts), output="tensor")
        cls.producers = []

        def to_device(meta, ts):
            # Reply with CUDA tensors (hand-made producers over device memory).
            outs = []
            for t in ts:
                p = _cudaemu.CUDAProducer(cls.drv, t.dtype, t.shape, bytes(t))
                cls.producers.append(p)
                outs.append(p)
            return meta, outs
        cls.srv.handle("to_device", to_device, output="tensor")

    @classmethod
    def tearDownClass(cls):
        gc.collect()
        for p in cls.producers:
            p.free()
        cls.srv.close()
        cls.drv.close()

    def setUp(self):
        gc.collect()
        self.live = tensorrpc.live_tensors()

    def tearDown(self):
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), self.live, "tensors leaked")
        st = tensorrpc.device_memory_stats("cuda:0")
        self.assertEqual((st["buffers"], st["bytes"]), (0, 0), "device memory leaked: %s" % st)
        self.assertLessEqual(st["arenas"], 1, st)  # one empty arena is kept

    def producer(self, name, shape, **kw):
        p = _cudaemu.CUDAProducer(self.drv, name, shape, _common.pattern(name, shape), **kw)
        self.addCleanup(p.free)
        return p

    def test_device_count(self):
        self.assertEqual(tensorrpc.cuda_device_count(), 1)

    def test_send_fetch_every_dtype(self):
        """A hand-made kDLCUDA producer of every dtype (float16 and
        bfloat16 included) sent on shm, tcp and grpc lands bit-exact, and
        fetch(device="cuda:0") brings it back into device memory."""
        for transport in ("shm", "tcp", "grpc"):
            with tensorrpc.Client(self.srv.address, transports=[transport], output="tensor") as c:
                for name in _common.NAMES:
                    for size, shape in SHAPES.items():
                        with self.subTest(transport=transport, dtype=name, size=size):
                            key = "cuda/%s/%s/%s" % (transport, name, size)
                            p = self.producer(name, shape, versioned=(size == "small"))
                            c.send(key, p)
                            self.assertEqual(p.streams, [1], "the consumer passes the legacy default stream")
                            gc.collect()
                            self.assertEqual(p.deleted, 1, "the capsule's tensor is deleted after the send")
                            p.free()
                            _common.check_tensor(key, self.srv.fetch(key), name, shape)
                            t = c.fetch(key, device="cuda:0")
                            self.assertEqual(t.__dlpack_device__(), (2, 0))
                            self.assertEqual(t.device, "cuda:0")
                            self.assertEqual((t.dtype, t.shape), (name, shape))
                            self.assertEqual(_cudaemu.device_bytes(self.drv, t), _common.pattern(name, shape))
                            t.release()
                            self.srv.unpublish(key)

    def test_fetched_tensor_goes_back(self):
        """A tensor fetched onto the device is sent, called with and
        published from its device memory; its DLPack capsules are kDLCUDA."""
        shape = (64, 1000)
        for name in HALF:
            with self.subTest(dtype=name), tensorrpc.Client(self.srv.address, output="tensor") as c:
                self.srv.publish("h", _common.filled(self.srv, name, shape))
                t = c.fetch("h", device="cuda")
                st = tensorrpc.device_memory_stats()
                self.assertEqual((st["buffers"], st["bytes"]), (1, t.nbytes))
                c.send("h2", t)
                _common.check_tensor("h2", self.srv.take("h2"), name, shape)
                meta, (r,) = c.call("echo", b"m", [t], timeout=10)
                self.assertEqual(meta, b"m")
                _common.check_tensor("echo", r, name, shape)
                cap = t.__dlpack__(max_version=(1, 0))
                self.assertEqual(_lib.capsule_get_name(cap), b"dltensor_versioned")
                del cap
                with self.assertRaises(BufferError):
                    t.__dlpack__(max_version=(1, 0), copy=True)
                with self.assertRaises(BufferError):
                    t.__dlpack__(dl_device=(1, 0))
                for f in (t.numpy, t.memoryview, t.tobytes):
                    with self.assertRaises(tensorrpc.InvalidArgumentError):
                        f()
                del r
                t.release()
                self.srv.unpublish("h")

    def test_call_and_handler(self):
        """CUDA request tensors of call, and CUDA tensors a handler returns,
        arrive bit-exact."""
        with tensorrpc.Client(self.srv.address, output="tensor") as c:
            for name in HALF + ("float32", "int64"):
                for size, shape in SHAPES.items():
                    with self.subTest(dtype=name, size=size):
                        p = self.producer(name, shape)
                        meta, (r,) = c.call("echo", b"x", [p], timeout=10)
                        self.assertEqual(p.streams, [1])
                        gc.collect()
                        p.free()
                        _common.check_tensor("echo", r, name, shape)
                        with _common.filled(c, name, shape) as cpu:
                            meta, (r2,) = c.call("to_device", b"y", [cpu], timeout=10)
                        self.assertEqual(meta, b"y")
                        _common.check_tensor("to_device", r2, name, shape)
                        self.assertEqual(self.producers[-1].streams, [1])
                        del r, r2

    def test_publish_and_offsets(self):
        """A Server publishes a CUDA tensor (kept on its device); a
        producer's byte_offset is honoured; a 0-byte CUDA tensor moves."""
        with tensorrpc.Client(self.srv.address, output="tensor") as c:
            p = self.producer("float16", (7, 9), byte_offset=256)
            self.srv.publish("pub", p)
            _common.check_tensor("pub", c.fetch("pub"), "float16", (7, 9))
            self.srv.unpublish("pub")
            e = self.producer("bfloat16", (0, 4))
            c.send("empty", e)
            got = self.srv.take("empty")
            self.assertEqual((got.dtype, got.shape), ("bfloat16", (0, 4)))
            self.srv.publish("empty", got)
            t = c.fetch("empty", device="cuda:0")
            self.assertEqual((t.dtype, t.shape, t.device), ("bfloat16", (0, 4), "cuda:0"))
            del got, t
            self.srv.unpublish("empty")

    def test_publish_in_place(self):
        """A CUDA tensor published on a server with CUDA stays on its
        device: the server holds the producer's DLPack tensor (its deleter
        not called) until the key is unpublished, replaced or taken, or the
        server closes; fetches, host and onto cuda:0, get its bytes. Client
        and server are one process, which CUDA IPC refuses (the driver
        opens no handle in the process that exported it): the fetches
        stage. The device-to-device fetch between two processes is tested
        in Go (rpc's TestCUDAIPC on the emulator, TestFetchDeviceIPC over
        a fake driver). A failure midway ends the publish before the
        producer's memory is freed, not at the class's teardown."""
        want = _common.pattern("float32", (64, 1000))
        with tensorrpc.Client(self.srv.address, output="tensor") as c:
            for end in ("unpublish", "replace", "take", "close"):
                srv = self.srv if end != "close" else tensorrpc.Server(output="tensor")
                cl = c if end != "close" else tensorrpc.Client(srv.address, output="tensor")
                p = self.producer("float32", (64, 1000))
                srv.publish("inplace", p)
                # Cleanups run last first: this one before p.free.
                if end == "close":
                    self.addCleanup(srv.close)
                    self.addCleanup(cl.close)
                else:
                    self.addCleanup(srv.unpublish, "inplace")
                self.assertEqual(p.deleted, 0, end)
                self.assertEqual(bytes(cl.fetch("inplace")), want)
                t = cl.fetch("inplace", device="cuda:0")
                self.assertEqual(_cudaemu.device_bytes(self.drv, t), want)
                t.release()
                self.assertEqual(p.deleted, 0, "released while published (%s)" % end)
                if end == "unpublish":
                    self.assertTrue(srv.unpublish("inplace"))
                elif end == "replace":
                    srv.publish("inplace", b"x")
                    srv.unpublish("inplace")
                elif end == "take":
                    self.assertEqual(bytes(srv.take("inplace")), want)
                else:
                    cl.close()
                    srv.close()
                self.assertEqual(p.deleted, 1, "the producer's deleter after %s" % end)

    def test_large_allocation_and_arena_reuse(self):
        """A tensor above 16 MiB gets device memory of its own, given back
        with it; small ones share an arena."""
        with tensorrpc.Client(self.srv.address, output="tensor") as c:
            big = (5, 1 << 20)  # 20 MiB of float32
            self.srv.publish("big", _common.filled(self.srv, "float32", big))
            t = c.fetch("big", device="cuda:0")
            self.assertEqual(_cudaemu.device_bytes(self.drv, t), _common.pattern("float32", big))
            before = tensorrpc.device_memory_stats()
            self.assertGreaterEqual(before["arena_bytes"], t.nbytes)
            t.release()
            self.srv.unpublish("big")
            self.srv.publish("s", _common.filled(self.srv, "int8", (100,)))
            ts = [c.fetch("s", device="cuda:0") for _ in range(5)]
            st = tensorrpc.device_memory_stats()
            self.assertEqual((st["buffers"], st["arenas"]), (5, 1), st)
            self.assertEqual(len({t.data_ptr for t in ts}), 5)
            del ts
            self.srv.unpublish("s")

    def test_errors(self):
        """A device the driver does not have, out= and rows= on a device,
        NumPy output of device memory, and unsupported streams through the
        C ABI are refused clearly, and nothing leaks."""
        self.srv.publish("e", _common.filled(self.srv, "float32", (4,)))
        with tensorrpc.Client(self.srv.address, output="tensor") as c:
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "no CUDA device 3"):
                c.fetch("e", device="cuda:3")
            p = self.producer("float32", (4,), device_id=3)
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "no CUDA device 3"):
                c.send("x", p)
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "no CUDA device 3"):
                c.call("echo", b"", [p], timeout=10)
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "device"):
                c.fetch("e", device="tpu:0")
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "does not combine"):
                c.fetch("e", device="cuda:0", rows=[0])
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "NumPy"):
                c.fetch("e", device="cuda:0", output="numpy")
            with self.assertRaisesRegex(tensorrpc.NotFoundError, "missing"):
                c.fetch("missing", device="cuda:0")
            q = self.producer("float32", (4,))
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "CPU memory only"):
                c.fetch("e", out=q)
            with self.assertRaisesRegex(tensorrpc.InvalidArgumentError, "CPU"):
                c.send_rows("e", [0], self.producer("float32", (1, 4)))
            # Memory the driver does not know as device memory: its error.
            host = bytearray(16)
            bad = _cudaemu.CUDAProducer(self.drv, "float32", (4,), ptr=_lib.ctypes.addressof(
                (_lib.ctypes.c_char * 16).from_buffer(host)))
            with self.assertRaisesRegex(tensorrpc.Error, "cuda:0"):
                c.send("x", bad)
            # Streams the library does not order after, straight into the C ABI.
            from tensorrpc._tensors import describe
            desc = describe(q)
            for stream, code in ((2, "UNIMPLEMENTED"), (12345, "UNIMPLEMENTED")):
                err = _lib.ctypes.c_void_p()
                rc = _lib.lib.trpc_client_send_device(c._handle(), b"s", _lib.ctypes.byref(desc.dl), stream, 10000,
                                                      _lib.ctypes.byref(err))
                self.assertEqual(rc, tensorrpc.CODES[code], _lib.take_string(err.value))
            del desc
        self.srv.unpublish("e")

    def test_no_driver(self):
        """Without a CUDA driver, device calls fail with
        FailedPreconditionError naming it; CPU tensors still move."""
        code = (
            "import tensorrpc\n"
            "with tensorrpc.Server() as s, tensorrpc.Client(s.address, output='tensor') as c:\n"
            "    s.publish('k', b'abc')\n"
            "    assert bytes(c.fetch('k')) == b'abc'\n"
            "    for f in (tensorrpc.cuda_device_count, lambda: c.fetch('k', device='cuda:0')):\n"
            "        try:\n"
            "            f()\n"
            "        except tensorrpc.FailedPreconditionError as e:\n"
            "            assert 'no CUDA driver' in str(e) and 'nonexistent' in str(e), e\n"
            "        else:\n"
            "            raise AssertionError('no error')\n"
            "print('no driver OK')\n")
        env = dict(os.environ, TENSORRPC_CUDA_LIBRARY="/nonexistent/libcuda.so.1")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        self.assertIn("no driver OK", out.stdout, out.stdout + out.stderr)


if __name__ == "__main__":
    unittest.main()
