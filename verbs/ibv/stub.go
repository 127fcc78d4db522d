//go:build !(linux && cgo && rdma)

package ibv

import "github.com/tensorrpc/tensorrpc/verbs"

// errNotBuilt is what every call of the stub provider returns.
var errNotBuilt = noDevice("no RDMA devices: this binary was built without libibverbs support; build on Linux with cgo enabled (CGO_ENABLED=1) and -tags rdma")

// New returns the ibv provider. This binary was built without the rdma
// build tag (or without cgo, or not for Linux), so the provider has no
// devices: Devices and Open fail with an error that wraps verbs.ErrNoDevice
// and says how to build with libibverbs.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return stubProvider{}
}

type stubProvider struct{}

func (stubProvider) Name() string { return "ibv" }

func (stubProvider) Devices() ([]verbs.Device, error) { return nil, errNotBuilt }

func (stubProvider) Open(name string) (verbs.ProtectionDomain, error) { return nil, errNotBuilt }
