//go:build !linux

package mempool

import (
	"errors"
	"fmt"
)

func mapUnit(Backing) int { return 4096 }

func mapArena(b Backing, size int, o *options) (*Arena, error) {
	return nil, fmt.Errorf("mempool: %s arenas: %w on this platform", b, errors.ErrUnsupported)
}

// OpenMemfd maps a memfd shared by a peer; memfds exist only on Linux.
func OpenMemfd(fd int, opts ...Option) (*Arena, error) {
	return nil, fmt.Errorf("mempool: memfd: %w on this platform", errors.ErrUnsupported)
}

func unmapMemory(mem []byte) error { return nil }

func closeFD(fd int) error { return nil }
