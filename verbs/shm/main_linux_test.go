package shm

import (
	"os"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	if childproc.Role() != "" {
		os.Exit(childMain())
	}
	leakcheck.Main(m)
}

// memfdMemory makes size bytes of memfd memory, mapped shared, with the
// given seals added, and frees it through t.Cleanup.
func memfdMemory(t testing.TB, size int, seals int) verbs.Memory {
	t.Helper()
	fd, err := unix.MemfdCreate("shm-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatalf("memfd_create: %v", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		t.Fatalf("ftruncate: %v", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		t.Fatalf("mmap: %v", err)
	}
	t.Cleanup(func() {
		unix.Munmap(mem)
		unix.Close(fd)
	})
	if seals != 0 {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
			t.Fatalf("F_ADD_SEALS: %v", err)
		}
	}
	return verbs.Memory{Bytes: mem, HasFD: true, FD: fd}
}

// sealedMemory is memory the provider accepts: a memfd sealed against
// shrinking and growing.
func sealedMemory(t testing.TB, size int) verbs.Memory {
	return memfdMemory(t, size, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
}
