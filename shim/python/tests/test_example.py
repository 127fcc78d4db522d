"""The data-parallel training example reaches the weights of a
single-process run."""

import os
import subprocess
import sys
import unittest

import _need

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "ddp_train.py")


class ExampleTest(unittest.TestCase):

    def test_ddp_train(self):
        _need.module(self, "torch", "python3-torch")
        for transport in ("shm", "tcp"):
            with self.subTest(transport=transport):
                p = subprocess.run([sys.executable, EXAMPLE, "--steps", "10", "--transport", transport],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn("ranks agree: True", p.stdout)
                self.assertIn("OK", p.stdout)


if __name__ == "__main__":
    unittest.main()
