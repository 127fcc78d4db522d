package gpudirect

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// mapP2PFile maps size bytes (rounded up to the page size) of a p2pmem
// allocate file, shared and writable. The kernel allocates the memory from
// the provider's pool at mmap and frees it at munmap; the file descriptor
// is not needed after mmap.
//
// Tests map a regular file instead. Touching a mapping past the end of a
// regular file raises SIGBUS, so a regular file shorter than the mapping is
// refused; sysfs files have no meaningful size and are not checked.
func mapP2PFile(path string, size int) ([]byte, error) {
	page := unix.Getpagesize()
	size = (size + page - 1) &^ (page - 1)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("fstatfs %s: %w", path, err)
	}
	if st.Type != unix.SYSFS_MAGIC {
		fi, err := f.Stat()
		if err != nil {
			return nil, err
		}
		if fi.Size() < int64(size) {
			return nil, fmt.Errorf("%s is not in sysfs and holds %d bytes, fewer than the %d to map", path, fi.Size(), size)
		}
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s (%d bytes): %w", path, size, err)
	}
	// As for mempool's arenas: a forked child must not share memory a NIC
	// may be writing. Failure only loses that protection.
	_ = unix.Madvise(mem, unix.MADV_DONTFORK)
	return mem, nil
}

func unmapP2P(mem []byte) error { return unix.Munmap(mem) }
