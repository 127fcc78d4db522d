"""Every dtype round-trips bit-exactly through publish/fetch, send/take and
call, over each data plane, as NumPy arrays, torch tensors (bfloat16
included) and tensorrpc.Tensors."""

import gc
import unittest

import numpy as np

import tensorrpc
import _need
from _common import NAMES, check_tensor, filled, numpy_pattern, pattern, tensor_bytes

TRANSPORTS = ["shm", "tcp", "grpc"]
SHAPES = [(), (0,), (3, 5), (4, 25000)]  # scalar, empty, eager, data plane
TORCH_NAMES = [n for n in NAMES if n not in ("uint16", "uint32", "uint64")]  # torch 1.13 has no such dtypes


def torch_pattern(name, shape):
    import torch
    if 0 in shape:
        return torch.empty(shape, dtype=getattr(torch, name))
    raw = torch.frombuffer(bytearray(pattern(name, shape)), dtype=torch.uint8)
    return raw.view(getattr(torch, name)).reshape(shape)


class RoundTripTest(unittest.TestCase):

    def setUp(self):
        self.live = tensorrpc.live_tensors()

    def tearDown(self):
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), self.live, "tensors handed out and never released")

    def roundtrip(self, transport, names, make, output):
        with tensorrpc.Server(transports=[transport], output=output) as srv, \
                tensorrpc.Client(srv.address, transports=[transport], output=output) as c:
            self.assertEqual(c.transport, transport)
            baseline = srv.pool_stats()["allocs"]  # the session's own buffers
            srv.handle("echo", lambda meta, ts: (meta, ts))
            for name in names:
                for shape in SHAPES:
                    with self.subTest(transport=transport, dtype=name, shape=shape):
                        x = make(name, shape)
                        srv.publish("k", x)
                        check_tensor("fetch", c.fetch("k", timeout=10), name, shape)
                        c.send("s", x, timeout=10)
                        check_tensor("take", srv.take("s", timeout=10), name, shape)
                        meta, outs = c.call("echo", name, [x, x], timeout=10)
                        self.assertEqual(meta, name.encode())
                        self.assertEqual(len(outs), 2)
                        for o in outs:
                            check_tensor("call", o, name, shape)
                        del outs
            srv.unpublish("k")
            gc.collect()
            self.assertEqual(srv.pool_stats()["allocs"], baseline)

    def test_numpy(self):
        for transport in TRANSPORTS:
            self.roundtrip(transport, [n for n in NAMES if n != "bfloat16"], numpy_pattern, "numpy")

    def test_torch(self):
        _need.module(self, "torch", "python3-torch")
        for transport in TRANSPORTS:
            self.roundtrip(transport, TORCH_NAMES, torch_pattern, "torch")

    def test_tensor_objects(self):
        # tensorrpc.Tensor carries every dtype, bfloat16 and uint64 included,
        # without NumPy or torch having to know it.
        with tensorrpc.Server() as srv, tensorrpc.Client(srv.address) as c:
            for name in NAMES:
                for shape in SHAPES:
                    with self.subTest(dtype=name, shape=shape):
                        with filled(c, name, shape) as t:
                            c.send("s", t)
                        with srv.take("s", output="tensor") as got:
                            check_tensor("take", got, name, shape)
                            srv.publish("k", got)
                        with c.fetch("k", output="tensor") as got:
                            check_tensor("fetch", got, name, shape)
            srv.unpublish("k")

    def test_dlpack_consumers(self):
        # A Tensor is a DLPack producer for NumPy and torch; each view keeps
        # the memory alive after the Tensor is released.
        with tensorrpc.Server() as srv, tensorrpc.Client(srv.address) as c:
            srv.publish("k", numpy_pattern("float32", (4, 25000)))
            t = c.fetch("k", output="tensor")
            a = np.from_dlpack(t)
            b = t.numpy()
            t.release()
            self.assertEqual(a.tobytes(), pattern("float32", (4, 25000)))
            self.assertEqual(tensor_bytes(b), pattern("float32", (4, 25000)))
            try:
                import torch
            except ImportError:
                return
            t = c.fetch("k", output="tensor")
            u = torch.utils.dlpack.from_dlpack(t)
            del t
            gc.collect()
            self.assertEqual(tensor_bytes(u), pattern("float32", (4, 25000)))


if __name__ == "__main__":
    unittest.main()
