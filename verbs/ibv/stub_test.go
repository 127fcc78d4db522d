//go:build !(linux && cgo && rdma)

package ibv

import (
	"errors"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

func TestStubHasNoDevices(t *testing.T) {
	p := New(WithDevice("mlx5_0"), WithPort(1))
	if p.Name() != "ibv" {
		t.Errorf("Name() = %q, want ibv", p.Name())
	}
	devs, err := p.Devices()
	if err == nil || len(devs) != 0 {
		t.Fatalf("Devices() = %v, %v; want no devices and an error", devs, err)
	}
	if !errors.Is(err, verbs.ErrNoDevice) {
		t.Errorf("Devices() error %q does not wrap verbs.ErrNoDevice", err)
	}
	if !strings.Contains(err.Error(), "-tags rdma") {
		t.Errorf("Devices() error %q does not say to build with -tags rdma", err)
	}
	pd, err := p.Open("")
	if pd != nil || !errors.Is(err, verbs.ErrNoDevice) || !strings.Contains(err.Error(), "-tags rdma") {
		t.Errorf("Open(\"\") = %v, %v; want nil and the -tags rdma error", pd, err)
	}
}
