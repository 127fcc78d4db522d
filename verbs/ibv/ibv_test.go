//go:build linux && cgo && rdma

package ibv

import (
	"errors"
	"syscall"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
)

// requireDevice skips the test, with the reason the provider gives, when
// this host has no usable RDMA device.
func requireDevice(t testing.TB, p verbs.Provider) {
	t.Helper()
	devs, err := p.Devices()
	if err != nil {
		if !errors.Is(err, verbs.ErrNoDevice) {
			t.Fatalf("Devices: %v (want an error wrapping verbs.ErrNoDevice when there is no device)", err)
		}
		t.Skipf("skipping: no RDMA device to test on: %v", err)
	}
	if len(devs) == 0 {
		t.Fatal("Devices returned neither a device nor an error")
	}
}

func testEnv() verbstest.Env {
	p := New()
	return verbstest.Env{
		Name: "ibv",
		Open: func(t testing.TB) (a, b verbs.ProtectionDomain) {
			requireDevice(t, p)
			return verbstest.OpenTwo(p, "", "")(t)
		},
		NewMemory: func(t testing.TB, size int) verbs.Memory {
			// Anonymous mmap: memory the Go collector does not manage,
			// as mempool's arenas are.
			b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
			if err != nil {
				t.Fatalf("mmap %d bytes: %v", size, err)
			}
			t.Cleanup(func() { syscall.Munmap(b) })
			return verbs.Memory{Bytes: b}
		},
	}
}

func TestConformance(t *testing.T) {
	requireDevice(t, New())
	verbstest.Run(t, testEnv())
}

func TestDevices(t *testing.T) {
	p := New()
	if p.Name() != "ibv" {
		t.Errorf("Name() = %q, want ibv", p.Name())
	}
	requireDevice(t, p)
	devs, _ := p.Devices()
	for _, d := range devs {
		if d.Provider != "ibv" || d.Name == "" || d.Description == "" {
			t.Errorf("device %+v: want provider ibv, a name and a description", d)
		}
		t.Logf("%s: %s", d.Name, d.Description)
	}
}

func TestOpenUnknownDevice(t *testing.T) {
	p := New()
	requireDevice(t, p)
	if _, err := p.Open("no-such-device"); !errors.Is(err, verbs.ErrNoDevice) {
		t.Fatalf("Open(no-such-device): %v, want an error wrapping verbs.ErrNoDevice", err)
	}
}

// TestNoDeviceMessage checks, on hosts without RDMA, that Open fails the
// same way Devices does.
func TestNoDeviceMessage(t *testing.T) {
	p := New()
	_, derr := p.Devices()
	if derr == nil {
		t.Skip("this host has an RDMA device")
	}
	pd, err := p.Open("")
	if pd != nil || err == nil || err.Error() != derr.Error() || !errors.Is(err, verbs.ErrNoDevice) {
		t.Fatalf("Open without devices: %v, %v; want nil and %v", pd, err, derr)
	}
}

// TestNotRemoteMapper: a NIC's peer memory cannot be mapped, so ibv queue
// pairs must not claim verbs.RemoteMapper.
func TestNotRemoteMapper(t *testing.T) {
	if _, ok := any((*queuePair)(nil)).(verbs.RemoteMapper); ok {
		t.Fatal("ibv queue pairs implement verbs.RemoteMapper")
	}
}
