package main

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// memfdMemory is memory backed by a memfd sealed against shrinking and
// growing, which the shm provider can share with its peer.
func memfdMemory(size int) (verbs.Memory, func(), error) {
	fd, err := unix.MemfdCreate("verbsperf", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return verbs.Memory{}, nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return verbs.Memory{}, nil, fmt.Errorf("ftruncate memfd to %d bytes: %w", size, err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return verbs.Memory{}, nil, fmt.Errorf("mmap memfd of %d bytes: %w", size, err)
	}
	free := func() {
		unix.Munmap(mem)
		unix.Close(fd)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		free()
		return verbs.Memory{}, nil, fmt.Errorf("sealing memfd: %w", err)
	}
	return verbs.Memory{Bytes: mem, HasFD: true, FD: fd}, free, nil
}
