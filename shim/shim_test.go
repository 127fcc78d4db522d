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
)

// python is the interpreter of Debian's python3-numpy and python3-torch.
const python = "/usr/bin/python3"

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
		t.Skip("skipping: gcc is not installed (cgo needs it to build libtensorrpc.so)")
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
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
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
		"-I", buildDir, "-I", "capi", "-L", buildDir, "-ltensorrpc", "-Wl,-rpath,"+buildDir)
	if err != nil {
		t.Fatalf("compiling capi_smoke.c: %v\n%s", err, out)
	}
	out, err = run(t, time.Minute, nil, exe)
	if err != nil || !strings.Contains(out, "capi_smoke OK") {
		t.Fatalf("capi_smoke: %v\n%s", err, out)
	}
}

// TestPython runs the Python package's tests (python/tests) against a
// freshly built library, with the Go peer for the cross-language tests.
func TestPython(t *testing.T) {
	defer leakcheck.Check(t)
	if _, err := os.Stat(python); err != nil {
		t.Skipf("skipping: %s is not installed (apt-get install python3 python3-numpy python3-torch)", python)
	}
	for _, m := range []struct{ module, pkg string }{{"numpy", "python3-numpy"}, {"torch", "python3-torch"}} {
		if out, err := run(t, time.Minute, nil, python, "-c", "import "+m.module); err != nil {
			t.Skipf("skipping: %s cannot import %s (apt-get install %s): %v\n%s", python, m.module, m.pkg, err, out)
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
		"PYTHONDONTWRITEBYTECODE=1",
	}
	out, err := run(t, 5*time.Minute, env, python, "-m", "unittest", "discover", "-s", filepath.Join(pkg, "tests"), "-v")
	t.Log("\n" + out)
	if err != nil {
		t.Fatalf("python tests failed: %v", err)
	}
	// Every test must have run: a skip here means a missing piece.
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
