//go:build !linux

package shm

import (
	"errors"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

var errNotLinux = errors.New("shm: memfd and SCM_RIGHTS sharing needs Linux")

type provider struct{}

// New returns the shm provider. On this platform it has no device.
func New(opts ...Option) verbs.Provider { return provider{} }

func (provider) Name() string { return "shm" }

func (provider) Devices() ([]verbs.Device, error) {
	return nil, fmt.Errorf("%w: %w", verbs.ErrNoDevice, errNotLinux)
}

func (provider) Open(string) (verbs.ProtectionDomain, error) {
	return nil, fmt.Errorf("%w: %w", verbs.ErrNoDevice, errNotLinux)
}

// HostIdentity is not available on this platform.
func HostIdentity() (string, error) { return "", errNotLinux }
