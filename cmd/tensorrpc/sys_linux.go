package main

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// unlimited is how memlockLimit reports RLIMIT_MEMLOCK's infinity.
const unlimited = ^uint64(0)

// memlockLimit returns RLIMIT_MEMLOCK's soft and hard values in bytes.
func memlockLimit() (soft, hard uint64, err error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl); err != nil {
		return 0, 0, err
	}
	conv := func(v uint64) uint64 {
		if v == unix.RLIM_INFINITY {
			return unlimited
		}
		return v
	}
	return conv(rl.Cur), conv(rl.Max), nil
}

// memfdSeals is what tensorrpc seals its shared memfds with, so that a
// peer cannot truncate them under a reader.
const memfdSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW

// tryMemfd creates a memfd, sizes it, seals it and checks that the seals
// hold. The first error says which step failed; sealErr is set when the
// memfd works but sealing does not.
func tryMemfd() (memfdErr, sealErr error) {
	fd, err := unix.MemfdCreate("tensorrpc-doctor", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return fmt.Errorf("memfd_create: %w", err), nil
	}
	defer unix.Close(fd)
	const size = 1 << 20
	if err := unix.Ftruncate(fd, size); err != nil {
		return fmt.Errorf("ftruncate of a memfd: %w", err), nil
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, memfdSeals); err != nil {
		return nil, fmt.Errorf("fcntl(F_ADD_SEALS): %w", err)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("fcntl(F_GET_SEALS): %w", err)
	}
	if seals&memfdSeals != memfdSeals {
		return nil, fmt.Errorf("seals are %#x after adding %#x", seals, memfdSeals)
	}
	if err := unix.Ftruncate(fd, size/2); !errors.Is(err, unix.EPERM) {
		return nil, fmt.Errorf("shrinking a sealed memfd returned %v, want EPERM", err)
	}
	return nil, nil
}
