package mempool

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// Backing says what an arena's memory is.
type Backing int

const (
	// BackingAnonymous is private anonymous memory (mmap MAP_ANONYMOUS).
	BackingAnonymous Backing = iota
	// BackingMemfd is a memfd mapped shared, so that a peer process on the
	// same host can map the same pages from the file descriptor. Once sized,
	// the memfd is sealed against shrinking and growing, so a peer cannot
	// truncate it under a reader (which would raise SIGBUS).
	BackingMemfd
	// BackingHugepages is anonymous memory in 2 MiB pages: MAP_HUGETLB when
	// the host has reserved huge pages, else transparent huge pages asked for
	// with madvise(MADV_HUGEPAGE). Arena sizes round up to 2 MiB.
	BackingHugepages
)

// String returns "anonymous", "memfd" or "hugepages".
func (b Backing) String() string {
	switch b {
	case BackingAnonymous:
		return "anonymous"
	case BackingMemfd:
		return "memfd"
	case BackingHugepages:
		return "hugepages"
	}
	return fmt.Sprintf("Backing(%d)", int(b))
}

// Arena is one contiguous mapping of memory, excluded from fork and, when
// the memlock limit allows, pinned. A pool carves buffers out of its arenas;
// a standalone arena (NewArena, OpenMemfd) is handy for rings and tests.
// Its accessors are safe for concurrent use.
type Arena struct {
	id      uint32
	backing Backing
	mem     []byte
	addr    uintptr
	fd      int // the memfd, or -1
	hugeTLB bool
	pinned  bool
	pinErr  error
	hugeErr error
	closed  atomic.Bool

	// The fields below belong to the owning pool and are guarded by its mu;
	// pool is nil for a standalone arena.
	pool  *Pool
	first *chunk // lowest chunk of the address-ordered chunk list
	used  int64  // bytes of the arena held by live buffers

	hooks []*hookEntry // hooks that accepted the arena; guarded by pool.hookMu
}

// arenaIDs numbers arenas process-wide, so that an ID names one region for
// every pool and transport in the process.
var arenaIDs atomic.Uint32

// NewArena maps a standalone arena of at least size bytes (rounded up to the
// page size, or to 2 MiB for hugepages). WithName, WithPinning and
// WithAlignment (of the arena's base address) apply; other options are
// ignored. Close unmaps it.
func NewArena(b Backing, size int, opts ...Option) (*Arena, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	o.backing = b
	if err := o.validate(); err != nil {
		return nil, err
	}
	if size <= 0 {
		return nil, fmt.Errorf("mempool: arena size %d is not positive", size)
	}
	return mapArena(b, size, &o)
}

// ID identifies the arena uniquely within the process; transports use it
// as the region id.
func (a *Arena) ID() uint32 { return a.id }

// Bytes returns the whole arena. The memory is valid until the arena is
// closed (for a pool's arena: until the pool releases it).
func (a *Arena) Bytes() []byte { return a.mem }

// Len is the arena's size in bytes.
func (a *Arena) Len() int { return len(a.mem) }

// Addr is the address of the arena's first byte.
func (a *Arena) Addr() uintptr { return a.addr }

// Backing says what the arena's memory is.
func (a *Arena) Backing() Backing { return a.backing }

// FD returns the arena's memfd when its backing is BackingMemfd. The arena
// owns the descriptor; a caller that needs it beyond the arena's life must
// dup it.
func (a *Arena) FD() (fd int, ok bool) { return a.fd, a.fd >= 0 }

// Pinned reports whether the arena's pages are locked in memory.
func (a *Arena) Pinned() bool { return a.pinned }

// PinError is nil when the arena is pinned; otherwise it says why not: a
// *PinError naming RLIMIT_MEMLOCK when mlock failed, or ErrPinningDisabled
// when WithPinning(false) was given.
func (a *Arena) PinError() error { return a.pinErr }

// HugeTLB reports whether a hugepages arena got reserved huge pages
// (MAP_HUGETLB). When false, the arena asked for transparent huge pages
// instead, and HugePageError says whether even that was refused.
func (a *Arena) HugeTLB() bool { return a.hugeTLB }

// HugePageError is nil unless the arena's backing is BackingHugepages and
// the kernel refused both MAP_HUGETLB and madvise(MADV_HUGEPAGE); the arena
// then uses ordinary pages.
func (a *Arena) HugePageError() error { return a.hugeErr }

// String describes the arena for logs.
func (a *Arena) String() string {
	pin := "pinned"
	if !a.pinned {
		pin = "not pinned"
	}
	return fmt.Sprintf("arena %d (%s, %d bytes at %#x, %s)", a.id, a.backing, len(a.mem), a.addr, pin)
}

// Close unmaps a standalone arena and closes its memfd. Closing a pool's
// arena returns ErrArenaOwned: the pool unmaps it. A second Close returns
// ErrClosed.
func (a *Arena) Close() error {
	if a.pool != nil {
		return ErrArenaOwned
	}
	return a.unmap()
}

func (a *Arena) unmap() error {
	if !a.closed.CompareAndSwap(false, true) {
		return ErrClosed
	}
	return errors.Join(unmapMemory(a.mem), closeFD(a.fd))
}

// PinError says why an arena could not be pinned.
type PinError struct {
	Size int   // bytes that mlock was asked to lock
	Err  error // what mlock returned
	// Limit is RLIMIT_MEMLOCK's soft value in bytes; NoLimit when unlimited.
	Limit uint64
}

// NoLimit is the PinError.Limit of an unlimited RLIMIT_MEMLOCK.
const NoLimit = ^uint64(0)

func (e *PinError) Error() string {
	limit := "unlimited"
	if e.Limit != NoLimit {
		limit = fmt.Sprintf("%d bytes", e.Limit)
	}
	return fmt.Sprintf("mlock %d bytes: %v (RLIMIT_MEMLOCK is %s; raise it with ulimit -l or LimitMEMLOCK=)", e.Size, e.Err, limit)
}

// Unwrap returns mlock's error.
func (e *PinError) Unwrap() error { return e.Err }
