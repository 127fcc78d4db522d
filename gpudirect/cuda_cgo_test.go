//go:build linux && cgo

package gpudirect

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// buildFakeCUDA compiles testdata/fakecuda/fakecuda.c into a libcuda.so.1
// in a temporary directory, or skips the test without a C compiler.
func buildFakeCUDA(t *testing.T) string {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) to build the fake libcuda: %v", cc, err)
	}
	src, err := filepath.Abs("testdata/fakecuda/fakecuda.c")
	if err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(t.TempDir(), "libcuda.so.1")
	out, err := exec.Command(cc, "-shared", "-fPIC", "-pthread", "-Wall", "-Werror", "-o", lib, src).CombinedOutput()
	if err != nil {
		t.Fatalf("building the fake libcuda: %v\n%s", err, out)
	}
	return lib
}

// TestFakeCUDA drives the cgo binding against a fake driver over host
// memory: it proves the binding's plumbing (symbols, handles, contexts,
// SYNC_MEMOPS, DMA-BUF export), not anything about a real GPU.
func TestFakeCUDA(t *testing.T) {
	lib := buildFakeCUDA(t)
	c, err := LoadCUDA(WithCUDALibrary(lib))
	if err != nil {
		t.Fatal(err)
	}
	devs := c.Devices()
	want := CUDADevice{Ordinal: 0, Name: "Fake GPU", PCIAddress: "0000:03:00.0", TotalMemory: 16 << 30, GPUDirectRDMA: true, DMABuf: true, UUID: [16]byte([]byte("fakecuda-gpu-000"))}
	if len(devs) != 1 || devs[0] != want {
		t.Fatalf("devices %+v, want %+v", devs, want)
	}
	if c.DriverVersion() != "12.4" || !strings.Contains(c.String(), "cuda:0 Fake GPU at 0000:03:00.0") {
		t.Errorf("driver %s: %s", c.DriverVersion(), c)
	}
	if _, err := c.NewAllocator(1, 0, nil); err == nil {
		t.Error("allocator on a missing device")
	}

	// The fake GPU sits at 0000:03:00.0, GPU0 of the switch fixture, where
	// nvidia_peermem is loaded.
	topo := discoverFixture(t, "switch")
	a, err := c.NewAllocator(0, 1<<20, topo)
	if err != nil {
		t.Fatal(err)
	}
	var _ Allocator = a
	if a.Name() != "cuda:0" || !strings.Contains(a.Detail(), "nvidia_peermem") {
		t.Errorf("allocator %s: %s", a.Name(), a.Detail())
	}
	arena, mech, ok := a.Arena()
	if !ok || mech != MechanismPeermem || len(arena.Bytes) != 2<<20 {
		t.Errorf("arena: %d bytes, %s, %v (want 2 MiB, the rounded size)", len(arena.Bytes), mech, ok)
	}
	b, err := a.Alloc(5000)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("gpu!"), 1000)
	if err := b.CopyFromHost(payload, 1000); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(payload))
	if err := b.CopyToHost(got, 1000); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("read back differs: %v", err)
	}
	if err := b.CopyToHost(got, 1001); err == nil {
		t.Error("copy past the end succeeded")
	}
	if b.Device() != "cuda:0" || b.Len() != 5000 {
		t.Errorf("buffer %s, %d bytes", b.Device(), b.Len())
	}
	d := Plan(b, "ibv", topo)
	if d.Path != Direct || d.Mechanism != MechanismPeermem || d.NIC != "mlx5_0" || d.Route.Class != ClassPIX {
		t.Errorf("Plan(cuda:0, ibv) = %+v", d)
	}
	if d := Plan(b, "tcp", topo); d.Path != Staged {
		t.Errorf("Plan(cuda:0, tcp) = %+v", d)
	}
	if err := a.Close(); !errors.Is(err, ErrOutstanding) {
		t.Errorf("Close with a buffer: %v", err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}

	// Without nvidia_peermem the arena is reached through its DMA-BUF,
	// which the topology must also support.
	a, err = c.NewAllocator(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	arena, mech, ok = a.Arena()
	if !ok || mech != MechanismDMABuf || !arena.HasFD || arena.FDOffset != 0 || len(arena.Bytes) != defaultCUDAArenaSize {
		t.Fatalf("DMA-BUF arena: %+v bytes %d, %s, %v", arena.HasFD, len(arena.Bytes), mech, ok)
	}
	if err := unix.Fstat(arena.FD, new(unix.Stat_t)); err != nil {
		t.Errorf("DMA-BUF fd %d: %v", arena.FD, err)
	}
	b1, _ := a.Alloc(300)
	b2, err := a.Alloc(300)
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := b2.Direct(); !ok || !m.HasFD || m.FD != arena.FD || m.FDOffset != 512 || len(m.Bytes) != 300 {
		t.Errorf("second buffer's Direct: HasFD %v FDOffset %d, %d bytes", m.HasFD, m.FDOffset, len(m.Bytes))
	}
	acs := discoverFixture(t, "acs") // no peermem, GPU 0000:03:00.0 next to mlx5_0
	if d := Plan(b2, "ibv", acs); d.Path != Staged || !strings.Contains(d.Reason, "DMA-BUF") {
		t.Errorf("DMA-BUF without ibv support: %+v", d)
	}
	withDMABuf := discoverFixture(t, "acs", WithDMABuf(func() (bool, string) { return true, "test" }))
	if d := Plan(b2, "ibv", withDMABuf); d.Path != Direct || d.Mechanism != MechanismDMABuf {
		t.Errorf("DMA-BUF with ibv support: %+v", d)
	}
	for _, x := range []DeviceBuffer{b1, b2} {
		if err := x.Free(); err != nil {
			t.Fatal(err)
		}
	}
	fd := arena.FD
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fstat(fd, new(unix.Stat_t)); err == nil {
		t.Errorf("DMA-BUF fd %d still open after Close", fd)
	}
	if err := a.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close: %v", err)
	}
}

func TestFakeCUDANoDevice(t *testing.T) {
	lib := buildFakeCUDA(t)
	t.Setenv("FAKECUDA_NO_DEVICE", "1")
	_, err := LoadCUDA(WithCUDALibrary(lib))
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "CUDA_ERROR_NO_DEVICE") || !strings.Contains(err.Error(), "using host staging") {
		t.Errorf("cuInit failing: %v", err)
	}
}

func TestCUDALibraryMissing(t *testing.T) {
	_, err := LoadCUDA(WithCUDALibrary("/nonexistent/libcuda.so.1"))
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "/nonexistent/libcuda.so.1 not found; using host staging") {
		t.Errorf("missing library: %v", err)
	}
	// A file that is not a shared library.
	bogus := filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(bogus, []byte("not ELF"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = LoadCUDA(WithCUDALibrary(bogus))
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "cannot be used") {
		t.Errorf("bogus library: %v", err)
	}
}
