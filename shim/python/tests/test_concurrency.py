"""Several Python threads use one client while the server's Python handler
runs on library threads: calls release the GIL, handlers take it."""

import gc
import threading
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

    def test_close_while_fetching(self):
        # A fetch blocked in the library fails cleanly when the client is
        # closed under it.
        srv = tensorrpc.Server()
        c = tensorrpc.Client(srv.address)
        result = []

        def fetch():
            try:
                c.fetch("never", timeout=30)
            except tensorrpc.Error as e:
                result.append(e)

        t = threading.Thread(target=fetch)
        t.start()
        t.join(0.2)
        c.close()
        srv.close()
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(result), 1)
        self.assertIsInstance(result[0], tensorrpc.Error)


if __name__ == "__main__":
    unittest.main()
