// Package cudatest gives tests a CUDA driver: gpudirect's emulator of the
// driver API (gpudirect/testdata/fakecuda), built with the C compiler, or,
// when the environment says TENSORRPC_TEST_CUDA=real, the machine's own
// driver (libcuda.so.1), so that the same test binaries run on a GPU
// machine (scripts/device-check.sh).
package cudatest

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/tensorrpc/tensorrpc/gpudirect"
)

// EnvReal names the variable that makes Load use the real driver.
const EnvReal = "TENSORRPC_TEST_CUDA"

// Real reports whether tests run against the machine's own driver.
func Real() bool { return os.Getenv(EnvReal) == "real" }

var built struct {
	sync.Mutex
	dir  string
	path string
}

// Library builds the emulator once per test binary and returns the path
// of its libcuda.so.1 (skipping t, with the reason, where no C compiler
// is installed). The file stays until the process ends.
func Library(t testing.TB) string {
	t.Helper()
	built.Lock()
	defer built.Unlock()
	if built.path != "" {
		return built.path
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) to build the CUDA driver emulator: %v", cc, err)
	}
	_, file, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "..", "testdata", "fakecuda", "fakecuda.c")
	dir, err := os.MkdirTemp("", "fakecuda-")
	if err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, "libcuda.so.1")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-pthread", "-Wall", "-Werror", "-o", lib, src).CombinedOutput(); err != nil {
		t.Fatalf("building the CUDA driver emulator: %v\n%s", err, out)
	}
	built.dir, built.path = dir, lib
	return lib
}

// Load returns the emulated driver, or the real one under
// TENSORRPC_TEST_CUDA=real (failing t when it cannot be loaded there).
func Load(t testing.TB) *gpudirect.CUDA {
	t.Helper()
	if Real() {
		c, err := gpudirect.LoadCUDA()
		if err != nil {
			t.Fatalf("%s=real, but the CUDA driver does not load: %v", EnvReal, err)
		}
		return c
	}
	c, err := gpudirect.LoadCUDA(gpudirect.WithCUDALibrary(Library(t)))
	if err != nil {
		t.Fatalf("loading the CUDA driver emulator: %v", err)
	}
	return c
}
