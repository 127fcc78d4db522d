"""Several Python threads use one client while the server's Python handler
runs on library threads: calls release the GIL, handlers take it."""

import gc
import threading
import time
import unittest

import numpy as np

import tensorrpc


class ConcurrencyTest(unittest.TestCase):

    def test_threads(self):
        with tensorrpc.Server() as srv, tensorrpc.Client(srv.address) as c:
            srv.handle("scale", lambda meta, ts: (meta, [t * float(meta.decode()) for t in ts]))
            errors = []

            def worker(i):
                try:
                    for j in range(20):
                        x = np.full(50000 + i, float(j), np.float64)  # over the eager threshold
                        meta, (y,) = c.call("scale", str(i).encode(), [x], timeout=30)
                        assert meta == str(i).encode() and (y == j * i).all(), (i, j)
                        key = "t%d" % i
                        c.send(key, x, timeout=30)
                        assert (srv.take(key, timeout=30) == j).all()
                except Exception as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            self.assertFalse(any(t.is_alive() for t in threads), "threads hang")
            self.assertEqual(errors, [])
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), 0)

    def test_wait_for_key(self):
        # fetch and take with wait=True return once another thread
        # publishes or sends the key; without wait they fail at once.
        with tensorrpc.Server() as srv, tensorrpc.Client(srv.address) as c:
            got = {}

            def fetch(name, fn, key):
                try:
                    got[name] = fn(key, wait=True, timeout=30)
                except Exception as e:  # checked below
                    got[name] = e

            threads = [threading.Thread(target=fetch, args=a) for a in (
                ("client", c.fetch, "later"), ("server", srv.fetch, "later"), ("take", srv.take, "sent"))]
            for t in threads:
                t.start()
            time.sleep(0.2)
            self.assertEqual(got, {}, "fetches with wait=True returned before the keys existed")
            x = np.arange(50000, dtype=np.float64)  # over the eager threshold
            srv.publish("later", x)
            c.send("sent", x)
            for t in threads:
                t.join(30)
            self.assertFalse(any(t.is_alive() for t in threads), "fetches hang")
            for name in ("client", "server", "take"):
                self.assertIsInstance(got[name], np.ndarray, "%s: %r" % (name, got[name]))
                self.assertTrue((got[name] == x).all(), name)
            with self.assertRaises(tensorrpc.NotFoundError):
                srv.take("sent")  # taken above
            with self.assertRaises(tensorrpc.NotFoundError) as cm:
                c.fetch("never-published")
            # The advice names Python's API, not Go's or the C ABI's.
            self.assertIn("wait=True", str(cm.exception))
            self.assertNotIn("rpc.WaitForKey", str(cm.exception))
            self.assertNotIn("TRPC_FETCH_WAIT", str(cm.exception))
            srv.unpublish("later")
            got.clear()
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), 0)

    def test_gil_released_while_fetch_waits(self):
        # A fetch waiting for its key (wait=True) holds no GIL: while it
        # waits, another Python thread keeps counting and this thread
        # publishes the key. Were the GIL held, neither could run until the
        # fetch timed out, and the fetch would fail with a deadline instead
        # of returning the tensor.
        for output in ("numpy", "torch", "tensor"):
            if output == "torch":
                # Imported here: the first fetch with output="torch" imports
                # torch, and under the counting thread's grip on the GIL that
                # import alone took more than the test's 30 s now and then.
                import torch  # noqa: F401
            with self.subTest(output=output), tensorrpc.Server() as srv, tensorrpc.Client(srv.address) as c:
                got, counter, stop = {}, [0], threading.Event()
                entering = threading.Event()

                def fetch():
                    entering.set()
                    try:
                        got["value"] = c.fetch("gil", wait=True, timeout=20, output=output)
                    except Exception as e:  # checked below
                        got["value"] = e
                    got["count_at_return"] = counter[0]

                def count():
                    while not stop.is_set():
                        counter[0] += 1

                counting = threading.Thread(target=count)
                fetching = threading.Thread(target=fetch)
                counting.start()
                fetching.start()
                entering.wait(20)
                time.sleep(0.2)  # into the library's wait
                before = counter[0]
                while counter[0] == before:  # the counting thread runs while the fetch waits
                    time.sleep(0.001)
                self.assertNotIn("value", got, "fetch with wait=True returned before the key was published (a deadline: the GIL was held?)")
                x = np.arange(1000, dtype=np.float32)
                srv.publish("gil", x)
                fetching.join(30)
                stop.set()
                counting.join(30)
                self.assertFalse(fetching.is_alive() or counting.is_alive(), "threads hang")
                v = got["value"]
                self.assertNotIsInstance(v, Exception)
                a = v.numpy() if output != "numpy" else v
                self.assertTrue((np.asarray(a) == x).all())
                self.assertGreater(got["count_at_return"], before)
                del v, a
                got.clear()
            gc.collect()
            self.assertEqual(tensorrpc.live_tensors(), 0)

    def test_close_while_fetching(self):
        # A fetch waiting in the library for a key fails cleanly when the
        # client is closed under it.
        srv = tensorrpc.Server()
        c = tensorrpc.Client(srv.address)
        result = []

        def fetch():
            try:
                c.fetch("never", wait=True, timeout=30)
            except tensorrpc.Error as e:
                result.append(e)

        t = threading.Thread(target=fetch)
        t.start()
        t.join(0.2)
        self.assertTrue(t.is_alive(), "fetch with wait=True did not wait: %r" % result)
        c.close()
        srv.close()
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(result), 1)
        self.assertIsInstance(result[0], tensorrpc.Error)


if __name__ == "__main__":
    unittest.main()
