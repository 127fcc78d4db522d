package shm

import (
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// New returns the shm provider: queue pairs between processes of the same
// host, over memfd regions shared through unix sockets. Its one device,
// "shm", is described with the host identity; Open's domain listens on its
// own unix socket.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	hostID := sync.OnceValues(hostIdentity)
	return &softrc.Provider{
		ProviderName: "shm",
		Describe: func() (string, error) {
			id, err := hostID()
			return fmt.Sprintf("same-host shared memory (sealed memfd regions over unix sockets), host identity %x", id), err
		},
		OpenDomain: func() (verbs.ProtectionDomain, error) {
			id, _ := hostID() // Open checked it through Describe
			return openDomain(o, id)
		},
	}
}
