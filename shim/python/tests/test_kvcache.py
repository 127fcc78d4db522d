"""The KV-cache example (examples/kvcache.py) runs at tiny sizes on every
data plane: a prefill process publishes its cache writable, this test's
decode process fetches blocks by rows into its own arrays and writes them
back, checks what it read and what it wrote, and prints a table per plane."""

import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "kvcache.py")


class KVCacheExampleTest(unittest.TestCase):

    def test_tiny(self):
        p = subprocess.run([sys.executable, EXAMPLE, "--blocks", "64", "--block-bytes", "16384", "--request", "16",
                            "--rounds", "2", "--iters", "2"],
                           capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, out)
        for plane in ("shm", "tcp", "grpc"):
            self.assertIn("\n%s: 64 blocks of 16 KiB, requests of 16 blocks" % plane, p.stdout, out)
        for op in ("rows", "per-block", "whole", "send_rows", "send/block"):
            self.assertEqual(p.stdout.count("\n| %s | " % op), 3, out)
        self.assertIn("\nOK: ", p.stdout, out)


if __name__ == "__main__":
    unittest.main()
