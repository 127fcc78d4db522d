//go:build linux && cgo && rdma

package main

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/ibv"
)

// With -tags rdma the ibv provider is in the binary. It has no ceiling
// measured here: a TCP socket over the same NIC does not bound RDMA, and
// the NIC's line rate is the number to compare with.
func init() {
	providers["ibv"] = providerSpec{
		new:       func(string) verbs.Provider { return ibv.New() },
		newMemory: mmapMemory,
		ceiling:   noCeiling,
	}
}

// mmapMemory is anonymous memory the Go collector does not manage, as
// mempool's arenas are.
func mmapMemory(size int) (verbs.Memory, func(), error) {
	b, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return verbs.Memory{}, nil, fmt.Errorf("mmap %d bytes: %w", size, err)
	}
	return verbs.Memory{Bytes: b}, func() { unix.Munmap(b) }, nil
}
