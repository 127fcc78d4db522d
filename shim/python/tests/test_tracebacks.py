"""A Python handler's exception: the server logs its traceback (logger
"tensorrpc", ERROR) and the client's Error carries it in details (and in
str(err)), while the message (the gRPC status message) stays the short
"ExceptionType: text"."""

import logging
import unittest

import tensorrpc


def divide(meta, ts):
    return meta, [1 / 0]


def refuse(meta, ts):
    raise tensorrpc.NotFoundError("no such thing: %s" % meta.decode())


class TracebackTest(unittest.TestCase):

    def check(self, transport):
        with tensorrpc.Server(output="tensor") as srv, \
                tensorrpc.Client(srv.address, transports=[transport], output="tensor") as c:
            srv.handle("divide", divide)
            srv.handle("refuse", refuse)
            with self.assertLogs("tensorrpc", logging.ERROR) as logs:
                with self.assertRaises(tensorrpc.Error) as cm:
                    c.call("divide", b"x", [b"some bytes"], timeout=10)
            e = cm.exception
            self.assertEqual(e.code, 2)
            self.assertEqual(e.message, "ZeroDivisionError: division by zero")  # the status message
            self.assertIsNotNone(e.details)
            for want in ("Traceback (most recent call last)", "in divide", "1 / 0", "ZeroDivisionError"):
                self.assertIn(want, e.details)
                self.assertIn(want, str(e))
                self.assertIn(want, logs.output[0])
            self.assertIn("'divide'", logs.output[0])
            self.assertEqual(logs.records[0].levelno, logging.ERROR)
            self.assertEqual(logs.records[0].name, "tensorrpc")

            # A tensorrpc.Error keeps its code, and carries its traceback too.
            with self.assertLogs("tensorrpc", logging.ERROR):
                with self.assertRaises(tensorrpc.NotFoundError) as cm:
                    c.call("refuse", b"k", timeout=10)
            self.assertEqual(cm.exception.message, "no such thing: k")
            self.assertIn("in refuse", cm.exception.details)

            # Errors without details have None, and the next call's error
            # does not inherit the previous one's.
            with self.assertRaises(tensorrpc.UnimplementedError) as cm:
                c.call("no-such-method", timeout=10)
            self.assertIsNone(cm.exception.details)
            self.assertNotIn("Traceback", str(cm.exception))

    def test_shm(self):
        self.check("shm")

    def test_grpc(self):
        # The gRPC fallback carries the call and its status on a stream.
        self.check("grpc")


if __name__ == "__main__":
    unittest.main()
