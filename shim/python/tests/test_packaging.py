"""Packaging: the version's single source, the in-tree build backend's
metadata, wheel (RECORD hashes, tags) and sdist, and the package working
without NumPy and torch (bytes and buffers in, Tensor objects out).

The install itself (pip install ./shim/python in a fresh venv, offline)
is shim_test.go's TestPythonInstall."""

import base64
import csv
import hashlib
import importlib
import io
import os
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import unittest
import zipfile

import tensorrpc

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shim/python
sys.path.insert(0, os.path.join(PROJECT, "_build"))
import tensorrpc_build as backend  # noqa: E402


class VersionTest(unittest.TestCase):

    def test_version(self):
        self.assertEqual(tensorrpc.__version__, backend.version())
        self.assertRegex(tensorrpc.__version__, r"^\d+\.\d+\.\d+")
        project = backend.load_pyproject()["project"]
        self.assertEqual(project["dynamic"], ["version"])
        self.assertNotIn("version", project)

    def test_toml_fallback(self):
        # Pythons before 3.11 have no tomllib: the backend's own parser
        # must read pyproject.toml the same.
        with open(os.path.join(PROJECT, "pyproject.toml"), "rb") as f:
            text = f.read().decode()
        try:
            tomllib = importlib.import_module("tomllib")
        except ImportError:
            self.skipTest("no tomllib to compare with (Python < 3.11)")
        self.assertEqual(backend._parse_toml_subset(text), tomllib.loads(text))

    def test_py_typed(self):
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(tensorrpc.__file__), "py.typed")))


class BackendTest(unittest.TestCase):

    def test_metadata(self):
        with tempfile.TemporaryDirectory() as d:
            dist_info = backend.prepare_metadata_for_build_wheel(d)
            self.assertEqual(dist_info, "tensorrpc-%s.dist-info" % tensorrpc.__version__)
            with open(os.path.join(d, dist_info, "METADATA")) as f:
                meta = f.read()
            with open(os.path.join(d, dist_info, "WHEEL")) as f:
                wheel = f.read()
        for line in ("Metadata-Version: 2.1", "Name: tensorrpc", "Version: " + tensorrpc.__version__,
                     "Requires-Python: >=3.9", "Provides-Extra: numpy", "Provides-Extra: torch",
                     'Requires-Dist: numpy>=1.22; extra == "numpy"', 'Requires-Dist: torch>=1.13; extra == "torch"'):
            self.assertIn(line + "\n", meta)
        # No unconditional dependency: NumPy and torch are extras.
        self.assertNotIn("Requires-Dist: numpy>=1.22\n", meta)
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        self.assertIn("Tag: py3-none-%s\n" % platform, wheel)
        self.assertIn("Root-Is-Purelib: false\n", wheel)
        self.assertEqual(backend.get_requires_for_build_wheel(), [])

    def test_wheel(self):
        with tempfile.TemporaryDirectory() as d:
            name = backend.build_wheel(d)
            self.assertEqual(name, "tensorrpc-%s-%s.whl" % (tensorrpc.__version__, backend.wheel_tag()))
            self.assertEqual(os.listdir(d), [name])  # no leftovers
            with zipfile.ZipFile(os.path.join(d, name)) as z:
                names = z.namelist()
                record = z.read("tensorrpc-%s.dist-info/RECORD" % tensorrpc.__version__).decode()
                rows = list(csv.reader(io.StringIO(record)))
                self.assertEqual(sorted(r[0] for r in rows), sorted(names))
                for path, digest, size in rows:
                    if path.endswith("/RECORD"):
                        self.assertEqual((digest, size), ("", ""))
                        continue
                    data = z.read(path)
                    want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                    self.assertEqual(digest, "sha256=" + want, path)
                    self.assertEqual(int(size), len(data), path)
        for want in ("tensorrpc/__init__.py", "tensorrpc/_version.py", "tensorrpc/py.typed",
                     "tensorrpc/libtensorrpc.so", "tensorrpc/tensorrpc.h", "tensorrpc/libtensorrpc.h"):
            self.assertIn(want, names)
        self.assertFalse([n for n in names if "__pycache__" in n or n.endswith(".pyc")])

    def test_sdist(self):
        with tempfile.TemporaryDirectory() as d:
            name = backend.build_sdist(d)
            with tarfile.open(os.path.join(d, name)) as t:
                names = t.getnames()
        base = "tensorrpc-%s/" % tensorrpc.__version__
        for want in ("pyproject.toml", "PKG-INFO", "_build/tensorrpc_build.py", "tensorrpc/_core.py",
                     "gosrc/go.mod", "gosrc/go.sum", "gosrc/shim/capi/tensorrpc.h", "gosrc/shim/capi/dlpack.c",
                     "gosrc/rpc/client.go"):
            self.assertIn(base + want, names)
        self.assertFalse([n for n in names if n.endswith("_test.go")])

    def test_missing_go_module(self):
        # A copy of shim/python alone cannot build: the error says so.
        old = backend.PROJECT
        with tempfile.TemporaryDirectory() as d:
            backend.PROJECT = d
            try:
                with self.assertRaises(backend.BuildError) as cm:
                    backend.go_root()
            finally:
                backend.PROJECT = old
        self.assertIn("checkout", str(cm.exception))


WITHOUT_NUMPY = r"""
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError
sys.modules["torch"] = None
import tensorrpc
with tensorrpc.Server(output="tensor") as srv, tensorrpc.Client(srv.address, output="tensor") as c:
    srv.handle("upper", lambda meta, ts: (meta.upper(), [bytes(t).upper() for t in ts]))
    c.send("k", b"hello")
    with srv.take("k") as t:
        assert (t.dtype, t.shape, bytes(t)) == ("uint8", (5,), b"hello"), t
    srv.publish("p", bytearray(b"x" * 100000))
    t = c.fetch("p")
    mv = t.memoryview()
    t.release()
    assert mv.nbytes == 100000 and bytes(mv[:3]) == b"xxx"
    import array
    meta, (r,) = c.call("upper", b"m", [memoryview(b"abc")], timeout=10)
    assert meta == b"M" and bytes(r) == b"ABC", (meta, r)
    c.send("f", array.array("f", [1.5, 2.5]))
    with srv.take("f") as t:
        assert (t.dtype, t.shape) == ("float32", (2,)), t
    try:
        c.fetch("p", output="numpy")
    except ImportError as e:
        assert "NumPy is not installed" in str(e) and "output='tensor'" in str(e), e
    else:
        raise AssertionError("no ImportError")
print("OK without numpy")
"""


class WithoutNumpyTest(unittest.TestCase):

    def test_without_numpy(self):
        p = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=120)
        out = p.stdout.decode(errors="replace")
        self.assertEqual(p.returncode, 0, out)
        self.assertIn("OK without numpy", out)


if __name__ == "__main__":
    unittest.main()
