"""Lifetimes: a received tensor stays valid until it is released or
collected, whatever happens to the server, the client or the Tensor it came
from; then the pools return to their baseline, and to zero after close."""

import gc
import unittest

import numpy as np

import tensorrpc
from _common import numpy_pattern, pattern, tensor_bytes

SHAPE = (4, 25000)  # over the eager threshold: a data-plane transfer


def wait_for(cond, timeout=5.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class LifetimeTest(unittest.TestCase):

    def setUp(self):
        gc.collect()
        self.live = tensorrpc.live_tensors()
        self.srv = tensorrpc.Server()
        self.c = tensorrpc.Client(self.srv.address)
        # The session holds a few buffers of its own on each side.
        self.srv_base = self.srv.pool_stats()["allocs"]
        self.c_base = self.c.pool_stats()["allocs"]

    def tearDown(self):
        self.c.close()
        self.srv.close()
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), self.live)

    def assert_baseline(self):
        gc.collect()
        self.assertTrue(wait_for(lambda: self.srv.pool_stats()["allocs"] == self.srv_base),
                        "server pool: %s" % self.srv.pool_stats())
        self.assertEqual(self.c.pool_stats()["allocs"], self.c_base)
        self.assertEqual(tensorrpc.live_tensors(), self.live)

    def test_valid_until_collected(self):
        want = pattern("float32", SHAPE)
        self.srv.publish("k", numpy_pattern("float32", SHAPE))
        a = self.c.fetch("k")
        view = a[1:3]  # a view keeps the memory alive too
        self.assertEqual(self.c.pool_stats()["allocs"], self.c_base + 1)
        # Replacing and removing the published tensor does not touch ours.
        self.srv.publish("k", np.zeros(SHAPE, np.float32))
        self.srv.unpublish("k")
        self.assertEqual(a.tobytes(), want)
        del a
        gc.collect()
        self.assertEqual(self.c.pool_stats()["allocs"], self.c_base + 1)
        self.assertEqual(view.tobytes(), np.frombuffer(want, np.float32).reshape(SHAPE)[1:3].tobytes())
        del view
        self.assert_baseline()

    def test_tensor_release(self):
        t = self.c.empty(SHAPE, "float64", output="tensor")
        a = t.numpy()
        a[:] = 7.0
        t.release()
        t.release()  # twice is fine
        with self.assertRaises(tensorrpc.InvalidArgumentError):
            t.numpy()
        with self.assertRaises(tensorrpc.InvalidArgumentError):
            self.c.send("x", t)
        self.assertTrue((a == 7.0).all())  # the view outlives the Tensor
        self.assertEqual(self.c.pool_stats()["allocs"], self.c_base + 1)
        del a
        self.assert_baseline()

    def test_with_block_releases(self):
        with self.c.empty(SHAPE, "int32", output="tensor") as t:
            self.assertEqual(self.c.pool_stats()["allocs"], self.c_base + 1)
            self.assertEqual(t.shape, SHAPE)
        self.assert_baseline()

    def test_outlives_client_and_server(self):
        srv = tensorrpc.Server()
        srv.publish("k", numpy_pattern("int64", SHAPE))
        c = tensorrpc.Client(srv.address)
        a = c.fetch("k")
        b = srv.fetch("k", output="torch")
        self.assertEqual(c.close(), 1)  # a is still live, and valid
        self.assertEqual(srv.close(), 1)  # so is b
        self.assertEqual(a.tobytes(), pattern("int64", SHAPE))
        self.assertEqual(tensor_bytes(b), pattern("int64", SHAPE))
        del a, b
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), self.live)

    def test_handler_keeps_request(self):
        kept = []
        self.srv.handle("keep", lambda meta, ts: kept.extend(ts))
        self.c.call("keep", b"", [numpy_pattern("uint16", SHAPE)])
        self.assertEqual(len(kept), 1)
        self.assertEqual(kept[0].tobytes(), pattern("uint16", SHAPE))  # after the handler returned
        self.assertEqual(self.srv.pool_stats()["allocs"], self.srv_base + 1)
        kept.clear()
        self.assert_baseline()

    def test_lease(self):
        self.srv.publish("k", numpy_pattern("float32", SHAPE))
        a = self.c.fetch("k", lease=True)
        self.assertEqual(self.c.stats()["leases"], 1)
        self.assertEqual(a.tobytes(), pattern("float32", SHAPE))
        self.assertEqual(self.c.pool_stats()["allocs"], self.c_base)  # the server's memory, no copy
        self.srv.unpublish("k")
        self.assertEqual(a.tobytes(), pattern("float32", SHAPE))  # the lease holds the buffer
        self.assertEqual(self.srv.pool_stats()["allocs"], self.srv_base + 1)
        del a
        self.assert_baseline()

    def test_zero_copy_send(self):
        # A pool tensor from empty() is sent without a copy; so is a NumPy
        # array on shm, which the server reads by cross-memory attach (in
        # one process it always can; on tcp it is read through the socket:
        # test_rows.RowsTest.test_no_copy_on_tcp).
        x = self.c.empty(SHAPE, "float32")
        x[:] = 1.5
        self.c.send("a", x)
        self.assertEqual(self.c.stats()["copies"], 0)
        self.c.send("b", np.full(SHAPE, 1.5, np.float32))
        self.assertEqual(self.c.stats()["copies"], 0)
        self.assertTrue((self.srv.take("a") == 1.5).all())
        self.assertTrue((self.srv.take("b") == 1.5).all())
        del x
        self.assert_baseline()

    def test_zero_copy_publish_and_reply(self):
        t = self.srv.empty(SHAPE, "float32")
        t[:] = 2.0
        before = self.srv.stats()["copies"]
        self.srv.publish("k", t)
        self.srv.handle("same", lambda meta, ts: (meta, ts))
        _, out = self.c.call("same", b"", [self.c.fetch("k")])
        self.assertTrue((out[0] == 2.0).all())
        self.assertEqual(self.srv.stats()["copies"], before)
        self.srv.unpublish("k")
        del t, out
        self.assert_baseline()


if __name__ == "__main__":
    unittest.main()
