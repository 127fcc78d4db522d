package shm

import (
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// provider is the shm verbs.Provider.
type provider struct {
	opts options

	idOnce sync.Once
	id     [16]byte
	idErr  error
}

// New returns the shm provider: queue pairs between processes of the same
// host, over memfd regions shared through unix sockets.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return &provider{opts: o}
}

func (p *provider) Name() string { return "shm" }

func (p *provider) hostID() ([16]byte, error) {
	p.idOnce.Do(func() { p.id, p.idErr = hostIdentity() })
	return p.id, p.idErr
}

// Devices returns the one device "shm", described with the host identity.
func (p *provider) Devices() ([]verbs.Device, error) {
	id, err := p.hostID()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", verbs.ErrNoDevice, err)
	}
	return []verbs.Device{{
		Provider:    "shm",
		Name:        "shm",
		Description: fmt.Sprintf("same-host shared memory (sealed memfd regions over unix sockets), host identity %x", id),
	}}, nil
}

// Open opens the device "shm" (or "") and returns a protection domain that
// listens on its own unix socket.
func (p *provider) Open(name string) (verbs.ProtectionDomain, error) {
	if name != "" && name != "shm" {
		return nil, fmt.Errorf("shm: device %q: %w", name, verbs.ErrNoDevice)
	}
	id, err := p.hostID()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", verbs.ErrNoDevice, err)
	}
	return openDomain(p.opts, id)
}
