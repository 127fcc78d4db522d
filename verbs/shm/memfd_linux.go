package shm

import (
	"fmt"
	"math"
	"os"

	"golang.org/x/sys/unix"
)

// checkSealedFD reports whether fd is a memfd sealed against shrinking and
// at least end bytes long. A region whose file could shrink would let its
// owner turn our accesses into SIGBUS.
func checkSealedFD(fd int, end uint64) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("fd %d is not a sealable memfd (F_GET_SEALS: %v)", fd, err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("memfd %d is not sealed against shrinking (F_SEAL_SHRINK missing; seals %#x)", fd, seals)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("fstat fd %d: %v", fd, err)
	}
	if st.Size < 0 || uint64(st.Size) < end {
		return fmt.Errorf("memfd %d is %d bytes, the region needs %d", fd, st.Size, end)
	}
	// A hugetlbfs memfd maps and unmaps only in whole huge pages: the
	// windows of it this package maps at any offset and length would fail,
	// or stay mapped when unmapping them fails. It is not supported.
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return fmt.Errorf("fstatfs fd %d: %v", fd, err)
	}
	if uint32(fs.Type) == unix.HUGETLBFS_MAGIC {
		return fmt.Errorf("memfd %d is on hugetlbfs (MFD_HUGETLB), which shm does not map", fd)
	}
	return nil
}

// newSealedMemfd makes a memfd of size bytes, maps it read-write and seals
// its size.
func newSealedMemfd(name string, size int) (fd int, mem []byte, err error) {
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, fmt.Errorf("shm: memfd_create: %w", err)
	}
	fail := func(what string, err error) (int, []byte, error) {
		if mem != nil {
			unix.Munmap(mem)
		}
		unix.Close(fd)
		return -1, nil, fmt.Errorf("shm: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("ftruncate memfd", err)
	}
	mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		mem = nil
		return fail("mmap memfd", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("seal memfd", err)
	}
	return fd, mem, nil
}

// mapFD maps length bytes of fd from offset, which need not be
// page-aligned. It returns the whole mapping (for munmap) and the region
// inside it.
func mapFD(fd int, offset uint64, length uint64, writable bool) (mapping, data []byte, err error) {
	page := uint64(os.Getpagesize())
	start := offset &^ (page - 1)
	span := offset - start + length
	if length == 0 || span < length || span > uint64(math.MaxInt) || start > uint64(math.MaxInt64) {
		return nil, nil, fmt.Errorf("cannot map %d bytes at offset %d", length, offset)
	}
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	mapping, err = unix.Mmap(fd, int64(start), int(span), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("mmap %d bytes at offset %d: %v", span, start, err)
	}
	d := offset - start
	return mapping, mapping[d : d+length : d+length], nil
}
