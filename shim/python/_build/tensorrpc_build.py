"""The PEP 517 build backend of the tensorrpc Python package, in the
standard library only, so that `pip install ./shim/python` works offline:
pyproject.toml's build-system.requires is empty, and pip's isolated build
environment needs nothing from an index.

build_wheel runs `go build -buildmode=c-shared` on ./shim/capi of the Go
module (the repository checkout around shim/python, or the copy of it in
an sdist) and writes a wheel tagged py3-none-<platform>: the package is
pure Python plus libtensorrpc.so, loaded with ctypes, so it fits every
Python 3 but only this platform. build_editable (PEP 660) builds the
library into the source tree and installs a .pth pointing at it.

Environment: GO (the go command; default: `go` on PATH, then
/usr/local/go/bin/go), CC and the usual Go variables (CGO_ENABLED is
forced to 1: the library is cgo).
"""

import base64
import csv
import hashlib
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from typing import Any, Dict, List, Mapping, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)  # shim/python, or the sdist's root
PACKAGE = "tensorrpc"
MODULE = "github.com/tensorrpc/tensorrpc"
SDIST_GO = "gosrc"  # where an sdist keeps the Go module's sources
LIBRARY = "libtensorrpc.so"

__all__ = [
    "build_wheel", "build_sdist", "build_editable", "get_requires_for_build_wheel",
    "get_requires_for_build_sdist", "get_requires_for_build_editable", "prepare_metadata_for_build_wheel",
    "prepare_metadata_for_build_editable",
]


class BuildError(Exception):
    pass


# --- project metadata ---------------------------------------------------

def _toml_value(text: str) -> Any:
    """A value of the TOML subset pyproject.toml uses: strings, booleans,
    integers and arrays of them."""
    text = text.strip()
    if text.startswith("["):
        inner = text[1:-1].strip()
        items = re.findall(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'|true|false|-?\d+', inner)
        return [_toml_value(i) for i in items]
    if text.startswith('"'):
        return text[1:-1].encode("ascii", "backslashreplace").decode("unicode_escape")
    if text.startswith("'"):
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    raise BuildError("pyproject.toml: unsupported value %r (the fallback parser knows a TOML subset)" % text)


def _parse_toml_subset(text: str) -> Dict[str, Any]:
    """A parser of the TOML subset pyproject.toml uses, for Pythons without
    tomllib (< 3.11): [tables], key = value, arrays over several lines,
    comments."""
    root: Dict[str, Any] = {}
    table = root
    pending = ""
    key = ""
    for raw in text.splitlines():
        line = raw.split(" #")[0].strip() if not raw.strip().startswith("#") else ""
        if pending:
            pending += " " + line
            if pending.count("[") == pending.count("]"):
                table[key] = _toml_value(pending)
                pending = ""
            continue
        if not line:
            continue
        m = re.fullmatch(r"(\[\[?)([^\[\]]+)\]\]?", line)
        if m:
            parts = [p.strip().strip('"') for p in re.findall(r'"[^"]*"|[^.]+', m.group(2))]
            table = root
            for part in parts[:-1]:
                table = table.setdefault(part, {})
                if isinstance(table, list):
                    table = table[-1]
            if m.group(1) == "[[":  # an array of tables
                tables: List[Dict[str, Any]] = table.setdefault(parts[-1], [])
                tables.append({})
                table = tables[-1]
            else:
                table = table.setdefault(parts[-1], {})
            continue
        m = re.fullmatch(r'("[^"]*"|[A-Za-z0-9_-]+)\s*=\s*(.*)', line)
        if not m:
            raise BuildError("pyproject.toml: cannot parse %r" % raw)
        key, value = m.group(1).strip('"'), m.group(2)
        if value.startswith("[") and value.count("[") != value.count("]"):
            pending = value
            continue
        table[key] = _toml_value(value)
    return root


def load_pyproject(path: Optional[str] = None) -> Dict[str, Any]:
    path = path or os.path.join(PROJECT, "pyproject.toml")
    with open(path, "rb") as f:
        data = f.read()
    try:
        tomllib = importlib.import_module("tomllib")  # Python >= 3.11
    except ImportError:
        return _parse_toml_subset(data.decode("utf-8"))
    result: Dict[str, Any] = tomllib.loads(data.decode("utf-8"))
    return result


def version() -> str:
    """The package's version, from tensorrpc/_version.py (the single
    source: pyproject.toml declares it dynamic)."""
    with open(os.path.join(PROJECT, PACKAGE, "_version.py"), encoding="utf-8") as f:
        m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.M)
    if not m:
        raise BuildError("%s/_version.py has no __version__" % PACKAGE)
    return m.group(1)


def metadata() -> str:
    """The METADATA (core metadata 2.1) of the distribution."""
    project = load_pyproject()["project"]
    lines = [
        "Metadata-Version: 2.1",
        "Name: %s" % project["name"],
        "Version: %s" % version(),
    ]
    if "description" in project:
        lines.append("Summary: %s" % project["description"])
    if "requires-python" in project:
        lines.append("Requires-Python: %s" % project["requires-python"])
    license_ = project.get("license")
    if isinstance(license_, dict) and "text" in license_:
        lines.append("License: %s" % license_["text"])
    for c in project.get("classifiers", []):
        lines.append("Classifier: %s" % c)
    for name, url in project.get("urls", {}).items():
        lines.append("Project-URL: %s, %s" % (name, url))
    for dep in project.get("dependencies", []):
        lines.append("Requires-Dist: %s" % dep)
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append("Provides-Extra: %s" % extra)
        for dep in deps:
            marker = 'extra == "%s"' % extra
            if ";" in dep:
                req, cond = dep.split(";", 1)
                dep = "%s; (%s) and %s" % (req.strip(), cond.strip(), marker)
            else:
                dep = "%s; %s" % (dep, marker)
            lines.append("Requires-Dist: %s" % dep)
    body = ""
    readme = project.get("readme")
    if isinstance(readme, str) and os.path.exists(os.path.join(PROJECT, readme)):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(PROJECT, readme), encoding="utf-8") as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


def _dist_name() -> str:
    return re.sub(r"[-_.]+", "_", load_pyproject()["project"]["name"]).lower()


def platform_tag() -> str:
    """linux_x86_64, linux_aarch64, ...: the platform of this interpreter
    (sysconfig.get_platform()), which the library is built for."""
    return re.sub(r"[^A-Za-z0-9_]", "_", sysconfig.get_platform())


def wheel_tag() -> str:
    # Not a CPython extension (ctypes loads the library): any Python 3, no
    # ABI, this platform only.
    return "py3-none-" + platform_tag()


# --- the Go build --------------------------------------------------------

def go_root() -> str:
    """The root of the Go module: the repository checkout around
    shim/python, or an sdist's copy."""
    for root in (os.path.dirname(os.path.dirname(PROJECT)), os.path.join(PROJECT, SDIST_GO)):
        gomod = os.path.join(root, "go.mod")
        if os.path.isfile(gomod) and os.path.isdir(os.path.join(root, "shim", "capi")):
            with open(gomod, encoding="utf-8") as f:
                if re.search(r"^module\s+%s\s*$" % re.escape(MODULE), f.read(), re.M):
                    return root
    raise BuildError(
        "tensorrpc: cannot find the Go module %s (go.mod and shim/capi) above %s or in %s/%s. "
        "Build from a checkout of the repository (pip install ./shim/python) or from the sdist, "
        "not from a copy of shim/python alone." % (MODULE, PROJECT, PROJECT, SDIST_GO))


def go_command() -> str:
    go = os.environ.get("GO") or shutil.which("go")
    if not go and os.access("/usr/local/go/bin/go", os.X_OK):
        go = "/usr/local/go/bin/go"
    if not go:
        raise BuildError(
            "tensorrpc: building libtensorrpc.so needs Go (1.26 or later, see go.mod) and a C compiler: "
            "`go` is not on PATH and /usr/local/go/bin/go does not exist. Install Go "
            "(https://go.dev/dl/) or set GO=/path/to/go.")
    return go


def build_library(out_dir: str) -> List[str]:
    """Builds libtensorrpc.so (and the cgo header libtensorrpc.h) into
    out_dir, copies tensorrpc.h next to them, and returns their paths."""
    root = go_root()
    go = go_command()
    cc = os.environ.get("CC", "gcc").split()[0]
    if not shutil.which(cc):
        raise BuildError("tensorrpc: building libtensorrpc.so needs a C compiler for cgo: %r not found "
                         "(apt-get install gcc, or set CC)" % cc)
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, LIBRARY)
    env = dict(os.environ, CGO_ENABLED="1")
    cmd = [go, "build", "-buildmode=c-shared", "-o", lib, "./shim/capi"]
    print("tensorrpc: %s (in %s)" % (" ".join(cmd), root), file=sys.stderr, flush=True)
    try:
        r = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        raise BuildError("tensorrpc: running %s failed: %s" % (go, e)) from None
    if r.returncode != 0:
        raise BuildError("tensorrpc: go build failed (exit %d):\n%s" % (r.returncode, r.stdout.decode(errors="replace")))
    header = os.path.join(out_dir, "tensorrpc.h")
    shutil.copyfile(os.path.join(root, "shim", "capi", "tensorrpc.h"), header)
    return [lib, os.path.join(out_dir, "libtensorrpc.h"), header]


# --- wheels --------------------------------------------------------------

def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


class _Wheel:
    """A wheel being written: files go in with their RECORD lines."""

    def __init__(self, path: str) -> None:
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records: List[Tuple[str, str, str]] = []
        # SOURCE_DATE_EPOCH makes the wheel reproducible.
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))
        self.date_time = time.gmtime(max(epoch, 315532800))[:6]

    def add(self, arcname: str, data: bytes, executable: bool = False) -> None:
        info = zipfile.ZipInfo(arcname, self.date_time)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = (0o755 if executable else 0o644) << 16
        self.zip.writestr(info, data)
        self.records.append((arcname, _record_hash(data), str(len(data))))

    def add_file(self, arcname: str, path: str) -> None:
        with open(path, "rb") as f:
            self.add(arcname, f.read(), executable=os.access(path, os.X_OK))

    def close(self, dist_info: str) -> None:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        for r in self.records:
            w.writerow(r)
        w.writerow((dist_info + "/RECORD", "", ""))
        self.add_raw(dist_info + "/RECORD", out.getvalue().encode())
        self.zip.close()

    def add_raw(self, arcname: str, data: bytes) -> None:
        info = zipfile.ZipInfo(arcname, self.date_time)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = 0o644 << 16
        self.zip.writestr(info, data)


def _wheel_metadata_files(tag: str) -> Dict[str, bytes]:
    wheel = "Wheel-Version: 1.0\nGenerator: tensorrpc_build\nRoot-Is-Purelib: false\nTag: %s\n" % tag
    return {"METADATA": metadata().encode("utf-8"), "WHEEL": wheel.encode()}


def _package_files() -> List[Tuple[str, str]]:
    """(arcname, path) of the package's Python files and py.typed; not
    the library, nor caches."""
    out = []
    pkg = os.path.join(PROJECT, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py") or name == "py.typed":
                path = os.path.join(dirpath, name)
                out.append((os.path.relpath(path, PROJECT).replace(os.sep, "/"), path))
    return out


def _write_metadata_dir(directory: str) -> str:
    dist_info = "%s-%s.dist-info" % (_dist_name(), version())
    os.makedirs(os.path.join(directory, dist_info), exist_ok=True)
    for name, data in _wheel_metadata_files(wheel_tag()).items():
        with open(os.path.join(directory, dist_info, name), "wb") as f:
            f.write(data)
    return dist_info


def get_requires_for_build_wheel(config_settings: Optional[Mapping[str, Any]] = None) -> List[str]:
    return []


def get_requires_for_build_sdist(config_settings: Optional[Mapping[str, Any]] = None) -> List[str]:
    return []


def get_requires_for_build_editable(config_settings: Optional[Mapping[str, Any]] = None) -> List[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory: str,
                                     config_settings: Optional[Mapping[str, Any]] = None) -> str:
    return _write_metadata_dir(metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory: str,
                                        config_settings: Optional[Mapping[str, Any]] = None) -> str:
    return _write_metadata_dir(metadata_directory)


def _wheel_name() -> str:
    return "%s-%s-%s.whl" % (_dist_name(), version(), wheel_tag())


def build_wheel(wheel_directory: str, config_settings: Optional[Mapping[str, Any]] = None,
                metadata_directory: Optional[str] = None) -> str:
    dist_info = "%s-%s.dist-info" % (_dist_name(), version())
    name = _wheel_name()
    os.makedirs(wheel_directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tensorrpc-build-") as tmp:
        built = build_library(tmp)
        path = os.path.join(wheel_directory, name)
        w = _Wheel(path + ".part")
        try:
            for arcname, src in _package_files():
                w.add_file(arcname, src)
            for src in built:
                w.add_file(PACKAGE + "/" + os.path.basename(src), src)
            for meta, data in _wheel_metadata_files(wheel_tag()).items():
                w.add(dist_info + "/" + meta, data)
            w.close(dist_info)
        except BaseException:
            w.zip.close()
            os.unlink(path + ".part")
            raise
        os.replace(path + ".part", path)
    return name


def build_editable(wheel_directory: str, config_settings: Optional[Mapping[str, Any]] = None,
                   metadata_directory: Optional[str] = None) -> str:
    """PEP 660: builds libtensorrpc.so into the source tree (next to the
    package's modules; git ignores it) and installs a .pth putting
    shim/python on sys.path. Rebuild the library after changing Go code
    (pip install -e again, or go build as in build_library)."""
    dist_info = "%s-%s.dist-info" % (_dist_name(), version())
    name = _wheel_name()
    build_library(os.path.join(PROJECT, PACKAGE))
    os.makedirs(wheel_directory, exist_ok=True)
    path = os.path.join(wheel_directory, name)
    w = _Wheel(path)
    w.add("__editable___tensorrpc.pth", (PROJECT + "\n").encode())
    for meta, data in _wheel_metadata_files(wheel_tag()).items():
        w.add(dist_info + "/" + meta, data)
    w.close(dist_info)
    return name


# --- sdists --------------------------------------------------------------

def _go_sources(root: str) -> List[str]:
    """The files of the Go module that building ./shim/capi needs: go.mod,
    go.sum and the non-test sources of its packages in this module."""
    go = go_command()
    r = subprocess.run([go, "list", "-deps", "-f", "{{if .Module}}{{if .Module.Main}}{{.Dir}}{{end}}{{end}}",
                        "./shim/capi"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=dict(os.environ, CGO_ENABLED="1"))
    if r.returncode != 0:
        raise BuildError("tensorrpc: go list failed:\n" + r.stderr.decode(errors="replace"))
    files = ["go.mod", "go.sum"]
    for d in sorted(set(r.stdout.decode().split())):
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path) and not name.endswith("_test.go") and \
                    os.path.splitext(name)[1] in (".go", ".c", ".h", ".s"):
                files.append(os.path.relpath(path, root))
    return files


def build_sdist(sdist_directory: str, config_settings: Optional[Mapping[str, Any]] = None) -> str:
    """An sdist with the package, this backend and, under gosrc/, the Go
    module's sources that libtensorrpc.so is built from. Building a wheel
    from it needs Go, a C compiler, and the module's dependencies (from the
    Go module proxy, or a module cache that has them: GOFLAGS=-mod=mod,
    GOPROXY=off)."""
    root = go_root()
    base = "%s-%s" % (_dist_name(), version())
    name = base + ".tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    path = os.path.join(sdist_directory, name)
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))

    def add(tar: tarfile.TarFile, arcname: str, data: bytes) -> None:
        info = tarfile.TarInfo(base + "/" + arcname)
        info.size, info.mtime, info.mode = len(data), epoch, 0o644
        tar.addfile(info, io.BytesIO(data))

    def read(p: str) -> bytes:
        with open(p, "rb") as f:
            return f.read()

    with tarfile.open(path + ".part", "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in ("pyproject.toml", "README-python-section.md", "_build/tensorrpc_build.py"):
            if os.path.exists(os.path.join(PROJECT, rel)):
                add(tar, rel, read(os.path.join(PROJECT, rel)))
        for arcname, src in _package_files():
            add(tar, arcname, read(src))
        if root != os.path.join(PROJECT, SDIST_GO):
            for rel in _go_sources(root):
                add(tar, SDIST_GO + "/" + rel, read(os.path.join(root, rel)))
        else:
            for dirpath, _, filenames in os.walk(root):
                for fn in sorted(filenames):
                    p = os.path.join(dirpath, fn)
                    add(tar, SDIST_GO + "/" + os.path.relpath(p, root), read(p))
        add(tar, "PKG-INFO", metadata().encode("utf-8"))
    os.replace(path + ".part", path)
    return name
