package softrc

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Provider is the verbs.Provider of a soft provider, which has one device
// named as the provider. It is safe for concurrent use when Describe and
// OpenDomain are.
type Provider struct {
	// ProviderName is the provider's name and its device's.
	ProviderName string
	// Describe returns the device's description, or why the device is not
	// available (Devices and Open then fail with that error, wrapping
	// verbs.ErrNoDevice).
	Describe func() (string, error)
	// OpenDomain opens a protection domain on the device.
	OpenDomain func() (verbs.ProtectionDomain, error)
}

// Name returns the provider's name.
func (p *Provider) Name() string { return p.ProviderName }

// Devices returns the one device, with its description.
func (p *Provider) Devices() ([]verbs.Device, error) {
	desc, err := p.Describe()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, verbs.ErrNoDevice)
	}
	return []verbs.Device{{Provider: p.ProviderName, Name: p.ProviderName, Description: desc}}, nil
}

// Open opens the device (name is its name or "") and returns a protection
// domain.
func (p *Provider) Open(name string) (verbs.ProtectionDomain, error) {
	if name != "" && name != p.ProviderName {
		return nil, fmt.Errorf("%s: open device %q: the only device is %q: %w", p.ProviderName, name, p.ProviderName, verbs.ErrNoDevice)
	}
	if _, err := p.Describe(); err != nil {
		return nil, fmt.Errorf("%w: %w", err, verbs.ErrNoDevice)
	}
	return p.OpenDomain()
}
