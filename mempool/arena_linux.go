package mempool

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// hugePageSize is the x86-64 and arm64 (4 KiB granule) huge page size, the
// one MAP_HUGETLB uses by default and transparent huge pages use.
const hugePageSize = 2 << 20

// mapUnit is the size every arena of backing b rounds up to.
func mapUnit(b Backing) int {
	if b == BackingHugepages {
		return hugePageSize
	}
	return unix.Getpagesize()
}

const memfdSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// mapArena creates, maps, protects from fork, seals and pins an arena.
func mapArena(b Backing, size int, o *options) (a *Arena, err error) {
	unit := mapUnit(b)
	size = roundUp(size, unit)
	align := max(o.alignment, unix.Getpagesize())
	a = &Arena{id: arenaIDs.Add(1), backing: b, fd: -1}
	defer func() {
		if err != nil {
			if a.mem != nil {
				_ = unmapMemory(a.mem)
			}
			_ = closeFD(a.fd)
			a = nil
		}
	}()

	const prot = unix.PROT_READ | unix.PROT_WRITE
	switch b {
	case BackingAnonymous:
		a.mem, err = mapAligned(-1, size, align, prot, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	case BackingMemfd:
		if a.fd, err = unix.MemfdCreate(o.name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING); err != nil {
			return nil, fmt.Errorf("mempool: memfd_create %q: %w", o.name, err)
		}
		if err = unix.Ftruncate(a.fd, int64(size)); err != nil {
			return nil, fmt.Errorf("mempool: size memfd to %d bytes: %w", size, err)
		}
		if a.mem, err = mapAligned(a.fd, size, align, prot, unix.MAP_SHARED); err == nil {
			if _, err = unix.FcntlInt(uintptr(a.fd), unix.F_ADD_SEALS, memfdSeals); err != nil {
				err = fmt.Errorf("mempool: seal memfd: %w", err)
			}
		}
	case BackingHugepages:
		// The kernel aligns MAP_HUGETLB mappings to the huge page size itself.
		if align <= hugePageSize {
			a.mem, err = mapAligned(-1, size, align, prot, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_HUGETLB)
		}
		if a.mem != nil {
			a.hugeTLB = true
		} else {
			// No reserved huge pages (or none left): ordinary memory,
			// 2 MiB-aligned so that transparent huge pages can back all of it.
			a.mem, err = mapAligned(-1, size, max(align, hugePageSize), prot, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			if err == nil {
				if herr := unix.Madvise(a.mem, unix.MADV_HUGEPAGE); herr != nil {
					a.hugeErr = fmt.Errorf("mempool: MAP_HUGETLB and madvise(MADV_HUGEPAGE) both refused: %w", herr)
				}
			}
		}
	default:
		return nil, fmt.Errorf("mempool: unknown backing %d", int(b))
	}
	if err != nil {
		return nil, err
	}
	a.addr = uintptr(unsafe.Pointer(unsafe.SliceData(a.mem)))
	if err = unix.Madvise(a.mem, unix.MADV_DONTFORK); err != nil {
		return nil, fmt.Errorf("mempool: madvise(MADV_DONTFORK): %w", err)
	}
	a.pin(o.pin)
	return a, nil
}

// OpenMemfd maps a memfd that a peer process shared (for example over a
// unix socket), so its memory can be used in place. The memfd must be
// sealed against shrinking, or the peer could truncate it and make every
// access here fault (SIGBUS); OpenMemfd returns ErrNotSealed otherwise.
// The arena takes ownership of fd and closes it on Close. WithPinning
// applies; other options are ignored.
func OpenMemfd(fd int, opts ...Option) (*Arena, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("mempool: get seals of fd %d: %w", fd, err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, ErrNotSealed
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("mempool: stat fd %d: %w", fd, err)
	}
	if st.Size <= 0 || int64(int(st.Size)) != st.Size {
		return nil, fmt.Errorf("mempool: memfd of %d bytes cannot be mapped", st.Size)
	}
	mem, err := mapAligned(fd, int(st.Size), unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	a := &Arena{id: arenaIDs.Add(1), backing: BackingMemfd, fd: fd, mem: mem}
	a.addr = uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	if err := unix.Madvise(mem, unix.MADV_DONTFORK); err != nil {
		_ = unmapMemory(mem)
		return nil, fmt.Errorf("mempool: madvise(MADV_DONTFORK): %w", err)
	}
	a.pin(o.pin)
	return a, nil
}

// pin tries to lock the arena's pages and records the outcome.
func (a *Arena) pin(try bool) {
	if !try {
		a.pinErr = ErrPinningDisabled
		return
	}
	if err := unix.Mlock(a.mem); err != nil {
		a.pinErr = newPinError(len(a.mem), err)
		return
	}
	a.pinned = true
}

func newPinError(size int, err error) *PinError {
	e := &PinError{Size: size, Err: err, Limit: NoLimit}
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl) == nil && rl.Cur != unix.RLIM_INFINITY {
		e.Limit = rl.Cur
	}
	return e
}

// mapAligned maps size bytes at an address that is a multiple of align.
// mmap only promises page alignment, so for a larger alignment it reserves
// size+align bytes of address space, maps the memory over the aligned part
// of it (MAP_FIXED) and gives the slack back.
func mapAligned(fd, size, align, prot, flags int) ([]byte, error) {
	page := unix.Getpagesize()
	if align <= page || flags&unix.MAP_HUGETLB != 0 {
		p, err := unix.MmapPtr(fd, 0, nil, uintptr(size), prot, flags)
		if err != nil {
			return nil, fmt.Errorf("mempool: mmap %d bytes: %w", size, err)
		}
		// The mapping stays valid until unmapMemory; the GC never scans or
		// moves it because it is not Go heap memory.
		return unsafe.Slice((*byte)(p), size), nil
	}
	span := uintptr(size + align)
	base, err := unix.MmapPtr(-1, 0, nil, span, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("mempool: reserve %d bytes of address space: %w", span, err)
	}
	start := uintptr(roundUp(int(uintptr(base)), align))
	head := start - uintptr(base)
	// unsafe.Add keeps the arithmetic on pointers to mapped, non-Go memory.
	at := unsafe.Add(base, head)
	p, err := unix.MmapPtr(fd, 0, at, uintptr(size), prot, flags|unix.MAP_FIXED)
	if err != nil {
		_ = unix.MunmapPtr(base, span)
		return nil, fmt.Errorf("mempool: mmap %d bytes aligned to %d: %w", size, align, err)
	}
	if head > 0 {
		_ = unix.MunmapPtr(base, head)
	}
	if tail := span - head - uintptr(size); tail > 0 {
		_ = unix.MunmapPtr(unsafe.Add(p, size), tail)
	}
	return unsafe.Slice((*byte)(p), size), nil
}

func unmapMemory(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	if err := unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(mem)), uintptr(len(mem))); err != nil {
		return fmt.Errorf("mempool: munmap: %w", err)
	}
	return nil
}

func closeFD(fd int) error {
	if fd < 0 {
		return nil
	}
	if err := unix.Close(fd); err != nil {
		return fmt.Errorf("mempool: close memfd: %w", err)
	}
	return nil
}
