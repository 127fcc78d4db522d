package tcp

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Name is the provider's name.
const Name = "tcp"

// provider implements verbs.Provider.
type provider struct {
	opts options
}

// New returns the tcp provider. It is safe for concurrent use; every domain
// it opens has its own listener.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return &provider{opts: o}
}

func (p *provider) Name() string { return Name }

// Devices returns the single device "tcp".
func (p *provider) Devices() ([]verbs.Device, error) {
	desc := "software RC queue pairs over TCP, listening on " + p.opts.listenAddress
	if p.opts.advertiseAddress != "" {
		desc += ", advertised as " + p.opts.advertiseAddress
	}
	return []verbs.Device{{Provider: Name, Name: Name, Description: desc}}, nil
}

// Open opens the device "tcp" (or "") and returns a protection domain. The
// domain's listener is created with its first queue pair.
func (p *provider) Open(name string) (verbs.ProtectionDomain, error) {
	if name != "" && name != Name {
		return nil, fmt.Errorf("tcp: open device %q: the only device is %q: %w", name, Name, verbs.ErrNoDevice)
	}
	return newDomain(p.opts), nil
}
