//go:build linux

package shim

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/testenv"
)

// python is the interpreter of Debian's python3-numpy and python3-torch.
const python = "/usr/bin/python3"

// need skips the test, naming what is missing and how to install it, or
// fails it under CI=true (internal/testenv).
var need = testenv.Need

var (
	buildDir  string
	buildOnce sync.Once
	buildErr  error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tensorrpc-shim-")
	if err != nil {
		panic(err)
	}
	buildDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// build builds libtensorrpc.so (and its header) and gopeer into buildDir,
// once for all tests.
func build(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("gcc"); err != nil {
		need(t, "gcc is not installed (cgo needs it to build libtensorrpc.so): apt-get install gcc")
	}
	buildOnce.Do(func() {
		for _, args := range [][]string{
			{"build", "-buildmode=c-shared", "-o", filepath.Join(buildDir, "libtensorrpc.so"), "./capi"},
			{"build", "-o", filepath.Join(buildDir, "gopeer"), "./internal/gopeer"},
		} {
			cmd := exec.Command("go", args...)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = &buildError{args: args, out: out, err: err}
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
}

// buildCUDAEmulator compiles the CUDA driver emulator of package gpudirect
// (gpudirect/testdata/fakecuda) into buildDir and returns its path, for
// TENSORRPC_CUDA_LIBRARY: test_cuda.py moves CUDA tensors over its memory.
func buildCUDAEmulator(t *testing.T) string {
	t.Helper()
	lib := filepath.Join(buildDir, "fakecuda", "libcuda.so.1")
	if _, err := os.Stat(lib); err == nil {
		return lib
	}
	if err := os.MkdirAll(filepath.Dir(lib), 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := filepath.Abs(filepath.Join("..", "gpudirect", "testdata", "fakecuda", "fakecuda.c"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := run(t, time.Minute, nil, "gcc", "-shared", "-fPIC", "-O2", "-o", lib, src, "-lpthread"); err != nil {
		t.Fatalf("building the CUDA driver emulator: %v\n%s", err, out)
	}
	return lib
}

type buildError struct {
	args []string
	out  []byte
	err  error
}

func (e *buildError) Error() string {
	return "go " + strings.Join(e.args, " ") + ": " + e.err.Error() + "\n" + string(e.out)
}

// run runs name with args in its own process group, which it kills when
// the command ends or times out, so that no child outlives the test.
func run(t *testing.T, timeout time.Duration, env []string, name string, args ...string) (string, error) {
	t.Helper()
	return runDir(t, "", timeout, env, name, args...)
}

// runDir is run in directory dir ("": the test's).
func runDir(t *testing.T, dir string, timeout time.Duration, env []string, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	if cmd.Process != nil {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // stragglers; ESRCH when none
	}
	return out.String(), err
}

// TestCABI compiles testdata/capi_smoke.c against the library and runs it.
func TestCABI(t *testing.T) {
	defer leakcheck.Check(t)
	build(t)
	exe := filepath.Join(buildDir, "capi_smoke")
	out, err := run(t, time.Minute, nil, "gcc", "-Wall", "-Werror", "-o", exe, "testdata/capi_smoke.c",
		"-I", buildDir, "-I", "capi", "-L", buildDir, "-ltensorrpc", "-Wl,-rpath,"+buildDir, "-lpthread")
	if err != nil {
		t.Fatalf("compiling capi_smoke.c: %v\n%s", err, out)
	}
	out, err = run(t, time.Minute, nil, exe)
	if err != nil || !strings.Contains(out, "capi_smoke OK") {
		t.Fatalf("capi_smoke: %v\n%s", err, out)
	}
	// bench_latency.py's c row compiles examples/bench_capi.c with only
	// tensorrpc.h (no libtensorrpc.h): it must keep building so.
	if out, err := run(t, time.Minute, nil, "gcc", "-Wall", "-Werror", "-O2", "-o", filepath.Join(buildDir, "bench_capi"),
		"-I", "capi", "examples/bench_capi.c", filepath.Join(buildDir, "libtensorrpc.so")); err != nil {
		t.Fatalf("compiling examples/bench_capi.c: %v\n%s", err, out)
	}
}

// TestPython runs the Python package's tests (python/tests) against a
// freshly built library, with the Go peer for the cross-language tests.
func TestPython(t *testing.T) {
	defer leakcheck.Check(t)
	if _, err := os.Stat(python); err != nil {
		need(t, "%s is not installed: apt-get install python3 python3-numpy python3-torch", python)
	}
	for _, m := range []struct{ module, pkg string }{{"numpy", "python3-numpy"}, {"torch", "python3-torch"}} {
		if out, err := run(t, time.Minute, nil, python, "-c", "import "+m.module); err != nil {
			need(t, "%s cannot import %s (apt-get install %s): %v\n%s", python, m.module, m.pkg, err, out)
		}
	}
	build(t)
	pkg, err := filepath.Abs("python")
	if err != nil {
		t.Fatal(err)
	}
	env := []string{
		"PYTHONPATH=" + pkg,
		"TENSORRPC_LIB=" + filepath.Join(buildDir, "libtensorrpc.so"),
		"TENSORRPC_GOPEER=" + filepath.Join(buildDir, "gopeer"),
		"TENSORRPC_CUDA_LIBRARY=" + buildCUDAEmulator(t),
		"PYTHONDONTWRITEBYTECODE=1",
	}
	out, err := run(t, 5*time.Minute, env, python, "-m", "unittest", "discover", "-s", filepath.Join(pkg, "tests"), "-v")
	t.Log("\n" + out)
	checkUnittest(t, out, err)
}

// checkUnittest fails t unless the output of `python -m unittest -v` says
// that tests ran and all passed, none skipped (a skip means a missing
// piece). It names the tests that failed.
func checkUnittest(t *testing.T, out string, err error) {
	t.Helper()
	failed := regexp.MustCompile(`(?m)^(?:FAIL|ERROR): .*$`).FindAllString(out, -1)
	if err != nil || len(failed) > 0 {
		t.Fatalf("python tests failed (%v):\n%s", err, strings.Join(failed, "\n"))
	}
	ran := regexp.MustCompile(`(?m)^Ran (\d+) tests? in`).FindStringSubmatch(out)
	if ran == nil || ran[1] == "0" {
		t.Fatalf("python tests: none ran (summary %q)", m0(ran))
	}
	if m := regexp.MustCompile(`(?m)^OK(.*)$`).FindStringSubmatch(out); m == nil || strings.Contains(m[1], "skipped") {
		t.Fatalf("python tests did not all run (summary %q)", strings.TrimSpace(m0(m)))
	}
}

func m0(m []string) string {
	if m == nil {
		return "missing"
	}
	return m[0]
}

// TestMypy type-checks the package and its build backend with mypy
// (Debian's mypy package), as configured in python/pyproject.toml.
func TestMypy(t *testing.T) {
	mypy, err := exec.LookPath("mypy")
	if err != nil {
		need(t, "mypy is not installed: apt-get install mypy")
	}
	cache := filepath.Join(buildDir, "mypy-cache")
	cmd := exec.Command(mypy, "--cache-dir", cache, "--config-file", "pyproject.toml")
	cmd.Dir = "python"
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("mypy: %v\n%s", err, out)
	}
	t.Logf("mypy: %s", bytes.TrimSpace(out))
}

// TestPythonInstall is the acceptance test of the packaging: `pip install
// ./shim/python` offline (--no-index) into a fresh `python3 -m venv` (no
// system site packages, so no NumPy), then a loopback round trip of a bytes
// tensor with the installed package; and install.sh for Debian's Python
// (pip --user --break-system-packages into a temporary user base) with a
// NumPy round trip. install.sh must fail cleanly for an interpreter
// without pip.
func TestPythonInstall(t *testing.T) {
	build(t) // gcc, and a warm Go build cache for the builds pip runs
	py3, err := exec.LookPath("python3")
	if err != nil {
		need(t, "python3 is not on PATH: apt-get install python3")
	}
	if out, err := run(t, time.Minute, nil, py3, "-c", "import venv, ensurepip"); err != nil {
		need(t, "%s cannot make virtualenvs with pip (apt-get install python3-venv): %v\n%s", py3, err, out)
	}
	shimDir, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	pkg := filepath.Join(shimDir, "python")
	tmp := t.TempDir()
	// A clean environment: nothing of the checkout on the path, no library
	// override, Go reachable for the backend, no index.
	env := []string{"PYTHONPATH=", "TENSORRPC_LIB=", "PIP_NO_INDEX=1", "PIP_DISABLE_PIP_VERSION_CHECK=1",
		"PYTHONDONTWRITEBYTECODE=1"} // go test puts its Go on PATH, for the backend's go build

	venv := filepath.Join(tmp, "venv")
	if out, err := run(t, 2*time.Minute, env, py3, "-m", "venv", venv); err != nil {
		t.Fatalf("python3 -m venv: %v\n%s", err, out)
	}
	vpy := filepath.Join(venv, "bin", "python")
	if out, err := run(t, 5*time.Minute, env, vpy, "-m", "pip", "install", "--no-index", "--no-cache-dir", pkg); err != nil {
		t.Fatalf("pip install ./shim/python into a fresh venv: %v\n%s", err, out)
	}
	out, err := runIn(t, tmp, env, vpy, "-c", bytesRoundTrip)
	if err != nil || !strings.Contains(out, "round trip OK") {
		t.Fatalf("the installed package (venv): %v\n%s", err, out)
	}
	t.Logf("venv: %s", strings.TrimSpace(out))

	// install.sh and an interpreter without pip: a clear message, nothing installed.
	nopip := filepath.Join(tmp, "nopip")
	if out, err := run(t, time.Minute, env, py3, "-m", "venv", "--without-pip", nopip); err != nil {
		t.Fatalf("python3 -m venv --without-pip: %v\n%s", err, out)
	}
	out, err = run(t, time.Minute, env, "bash", filepath.Join(shimDir, "install.sh"), filepath.Join(nopip, "bin", "python"))
	if err == nil || !strings.Contains(out, "has no pip") || !strings.Contains(out, "apt-get install python3-pip") {
		t.Fatalf("install.sh with a python without pip: %v\n%s", err, out)
	}

	// Debian's Python, with NumPy: install.sh --user into a temporary user base.
	if _, err := os.Stat(python); err != nil {
		need(t, "%s is not installed: apt-get install python3 python3-numpy", python)
	}
	if out, err := run(t, time.Minute, env, python, "-c", "import numpy, pip"); err != nil {
		need(t, "%s cannot import numpy and pip (apt-get install python3-numpy python3-pip): %v\n%s", python, err, out)
	}
	userEnv := append(env, "PYTHONUSERBASE="+filepath.Join(tmp, "userbase"))
	if out, err := run(t, 5*time.Minute, userEnv, "bash", filepath.Join(shimDir, "install.sh"), python,
		"--user", "--break-system-packages", "--no-index"); err != nil {
		t.Fatalf("install.sh %s --user --break-system-packages: %v\n%s", python, err, out)
	}
	out, err = runIn(t, tmp, userEnv, python, "-c", arrayRoundTrip)
	if err != nil || !strings.Contains(out, "round trip OK") || !strings.Contains(out, filepath.Join(tmp, "userbase")) {
		t.Fatalf("the installed package (%s, user base): %v\n%s", python, err, out)
	}
	t.Logf("system python: %s", strings.TrimSpace(out))
}

// runIn runs a check of the installed package in dir, away from the
// checkout, whose shim/python must not shadow it.
func runIn(t *testing.T, dir string, env []string, name string, args ...string) (string, error) {
	t.Helper()
	return runDir(t, dir, 2*time.Minute, env, name, args...)
}

// bytesRoundTrip runs in a venv without NumPy.
const bytesRoundTrip = `
import importlib.util, sys
import tensorrpc
assert importlib.util.find_spec("numpy") is None, "this venv should not have numpy"
assert "site-packages" in tensorrpc.__file__, tensorrpc.__file__
with tensorrpc.Server(output="tensor") as srv, tensorrpc.Client(srv.address, output="tensor") as c:
    srv.handle("rev", lambda meta, ts: (meta[::-1], [bytes(t)[::-1] for t in ts]))
    payload = bytes(range(256)) * 1000
    c.send("k", payload)
    with srv.take("k") as t:
        assert bytes(t) == payload
    meta, (r,) = c.call("rev", b"abc", [payload], timeout=10)
    assert meta == b"cba" and bytes(r) == payload[::-1]
print("tensorrpc", tensorrpc.__version__, "from", tensorrpc.__file__, "round trip OK over", c.transport)
`

// arrayRoundTrip runs with Debian's Python and NumPy.
const arrayRoundTrip = `
import numpy as np
import tensorrpc
with tensorrpc.Server() as srv, tensorrpc.Client(srv.address) as c:
    a = np.arange(100000, dtype=np.float32).reshape(100, 1000)
    srv.publish("a", a)
    b = c.fetch("a")
    assert isinstance(b, np.ndarray) and (b == a).all()
    c.send("b", b * 2)
    assert (srv.take("b") == a * 2).all()
print("tensorrpc", tensorrpc.__version__, "from", tensorrpc.__file__, "round trip OK over", c.transport)
`
