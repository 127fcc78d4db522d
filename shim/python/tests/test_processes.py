"""Tensors between processes: Python to Python, a Go server with a Python
client and a Python server with a Go client, over shm and tcp (and the gRPC
fallback once). Every dtype, eager and data-plane sized, checked bit for bit
in both directions (see _common.py for the protocol)."""

import gc
import unittest

import tensorrpc
import _need
from _common import Peer, client_checks, gopeer, python_peer, serve_check, serve_setup

TRANSPORTS = ["shm", "tcp"]


class ProcessTest(unittest.TestCase):

    def against_server(self, args, transport):
        """This process is the client of a peer server."""
        p = Peer(args)
        self.addCleanup(p.close)
        addr = p.read_line("ADDR ")
        with tensorrpc.Client(addr, transports=[transport]) as c:
            self.assertEqual(c.transport, transport)
            client_checks(c)
            self.assertEqual(c.stats()["errors"], 0)
        code, out, err = p.stop(b"check\n")
        self.assertEqual(code, 0, "server failed:\n%s\n%s" % (out, err))
        self.assertIn("BACK ok 30", out)
        self.assertIn("POOL allocs=0", out)
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), 0)

    def against_client(self, args_for, transport):
        """This process is the server of a peer client."""
        with tensorrpc.Server(transports=[transport]) as srv:
            serve_setup(srv)
            p = Peer(args_for(srv.address))
            self.addCleanup(p.close)
            code, out, err = p.stop(timeout=60)
            self.assertEqual(code, 0, "client failed:\n%s\n%s" % (out, err))
            self.assertIn("OK transport=" + transport, out)
            self.assertEqual(serve_check(srv), 30)
            self.assertEqual(srv.stats()["errors"], 0)
            for name in tensorrpc.DTYPES:
                for size in ("small", "large"):
                    srv.unpublish("srv/%s/%s" % (name, size))
            gc.collect()
            self.assertEqual(srv.pool_stats()["allocs"], 0)
        self.assertEqual(srv.close(), 0)

    def test_python_server_python_client(self):
        for transport in TRANSPORTS:
            with self.subTest(transport=transport):
                self.against_server(python_peer("serve", transport), transport)

    def test_python_client_python_server(self):
        for transport in TRANSPORTS:
            with self.subTest(transport=transport):
                self.against_client(lambda addr: python_peer("client", addr, transport), transport)

    def test_grpc_fallback_between_processes(self):
        self.against_server(python_peer("serve", "grpc"), "grpc")

    def test_go_server_python_client(self):
        if not gopeer():
            _need.missing(self, "TENSORRPC_GOPEER (the gopeer binary)",
                          "go build -o gopeer ./shim/internal/gopeer and set TENSORRPC_GOPEER")
        for transport in TRANSPORTS:
            with self.subTest(transport=transport):
                self.against_server([gopeer(), "serve", "-transports", transport], transport)

    def test_python_server_go_client(self):
        if not gopeer():
            _need.missing(self, "TENSORRPC_GOPEER (the gopeer binary)",
                          "go build -o gopeer ./shim/internal/gopeer and set TENSORRPC_GOPEER")
        for transport in TRANSPORTS:
            with self.subTest(transport=transport):
                self.against_client(lambda addr: [gopeer(), "client", "-addr", addr, "-transports", transport],
                                    transport)


if __name__ == "__main__":
    unittest.main()
