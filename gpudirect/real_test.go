package gpudirect

import (
	"errors"
	"strings"
	"testing"
)

// TestRealHost discovers this host's /sys. Our CI machines have no GPU, no
// RDMA NIC and no p2pmem, so everything must report host staging with a
// reason; on a host that has them, the assertions that would fail are
// skipped with a message, and what was found is logged.
func TestRealHost(t *testing.T) {
	topo, err := Discover()
	if err != nil {
		t.Skipf("no sysfs here: %v", err)
	}
	for _, c := range topo.Capabilities() {
		t.Logf("%s", c)
		if c.Detail == "" {
			t.Errorf("capability %s without detail", c.Name)
		}
		if !c.Available && !strings.Contains(c.String(), "unavailable, using host staging: ") {
			t.Errorf("capability %q does not say it uses host staging", c)
		}
	}
	for _, n := range topo.Notes {
		t.Logf("note: %s", n)
	}
	if len(topo.GPUs) > 0 {
		t.Logf("this host has GPUs (%s...): skipping the no-GPU assertions", topo.GPUs[0])
	} else {
		caps := topo.Capabilities()
		if caps[0].Name != "gpu" || caps[0].Available || !strings.Contains(caps[0].Detail, "no GPU") {
			t.Errorf("no GPU, but %s", caps[0])
		}
	}
	pairs := topo.Pairs()
	if len(topo.RDMA) == 0 && len(pairs) != 0 {
		t.Errorf("pairs without any RDMA device: %+v", pairs)
	}
	for _, d := range pairs {
		t.Logf("%s: %s", d.Path, d.Reason)
	}
	// A host-fake buffer is staged whatever the host has.
	a := NewHostAllocator()
	b, _ := a.Alloc(1)
	if d := Plan(b, "ibv", topo); d.Path != Staged || !strings.HasSuffix(d.Reason, "using host staging") {
		t.Errorf("Plan(host-fake) = %+v", d)
	}
	b.Free()
}

// TestRealCUDALoader loads this host's CUDA driver. Without one, the error
// must say so and send tensors through host staging; with one, the test
// logs the devices and skips.
func TestRealCUDALoader(t *testing.T) {
	c, err := LoadCUDA()
	if err == nil {
		t.Skipf("this host has a CUDA driver (%s): skipping the no-driver assertions", c)
	}
	t.Logf("LoadCUDA: %v", err)
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "using host staging") {
		t.Errorf("LoadCUDA error %q does not wrap ErrUnavailable or mention host staging", err)
	}
	want := "libcuda.so.1 not found: no NVIDIA driver on this host; using host staging"
	if !builtWithCUDALoader {
		want = "built without cgo"
	}
	if !strings.Contains(err.Error(), want) && !strings.Contains(err.Error(), "libcuda.so.1 is loaded but") {
		t.Errorf("LoadCUDA error %q lacks %q", err, want)
	}
}
