package gpudirect

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// HostAllocator allocates host memory that poses as device memory: its
// buffers have Device "host-fake:0", copy to and from the host like a GPU
// would, and have no Direct memory, so every transfer of them is staged.
// It stands in for a GPU in tests and on hosts without one, and counts the
// copies so that tests can check how many a path made. It is safe for
// concurrent use.
type HostAllocator struct {
	mu     sync.Mutex
	live   int
	closed bool

	allocs                       atomic.Int64
	copiesToHost, copiesFromHost atomic.Int64
	bytesToHost, bytesFromHost   atomic.Int64
}

// HostStats counts a HostAllocator's buffers and copies.
type HostStats struct {
	// Live is the number of buffers not yet freed; Allocs counts every
	// Alloc since NewHostAllocator.
	Live   int
	Allocs int64
	// CopiesToHost and BytesToHost count CopyToHost calls and their bytes;
	// CopiesFromHost and BytesFromHost count CopyFromHost.
	CopiesToHost, CopiesFromHost int64
	BytesToHost, BytesFromHost   int64
}

// NewHostAllocator returns an allocator of host memory posing as device
// memory.
func NewHostAllocator() *HostAllocator { return &HostAllocator{} }

// Name returns "host-fake".
func (a *HostAllocator) Name() string { return "host-fake" }

// Alloc returns a zeroed buffer of n bytes.
func (a *HostAllocator) Alloc(n int) (DeviceBuffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("gpudirect: host-fake: negative size %d", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, ErrClosed
	}
	a.live++
	a.allocs.Add(1)
	return &hostBuffer{alloc: a, mem: make([]byte, n)}, nil
}

// Close fails with ErrOutstanding while buffers are live; after a successful
// Close, Alloc returns ErrClosed.
func (a *HostAllocator) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.live > 0 {
		return fmt.Errorf("%w: %d host-fake buffers", ErrOutstanding, a.live)
	}
	a.closed = true
	return nil
}

// Stats returns the allocator's counters.
func (a *HostAllocator) Stats() HostStats {
	a.mu.Lock()
	live := a.live
	a.mu.Unlock()
	return HostStats{
		Live: live, Allocs: a.allocs.Load(),
		CopiesToHost: a.copiesToHost.Load(), CopiesFromHost: a.copiesFromHost.Load(),
		BytesToHost: a.bytesToHost.Load(), BytesFromHost: a.bytesFromHost.Load(),
	}
}

type hostBuffer struct {
	alloc *HostAllocator
	mem   []byte
	freed atomic.Bool
}

func (b *hostBuffer) Device() string { return "host-fake:0" }
func (b *hostBuffer) Len() int       { return len(b.mem) }

func (b *hostBuffer) CopyToHost(dst []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), len(b.mem), offset, len(dst)); err != nil {
		return err
	}
	copy(dst, b.mem[offset:])
	b.alloc.copiesToHost.Add(1)
	b.alloc.bytesToHost.Add(int64(len(dst)))
	return nil
}

func (b *hostBuffer) CopyFromHost(src []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), len(b.mem), offset, len(src)); err != nil {
		return err
	}
	copy(b.mem[offset:], src)
	b.alloc.copiesFromHost.Add(1)
	b.alloc.bytesFromHost.Add(int64(len(src)))
	return nil
}

// Direct returns ok=false: the point of the fake is that its tensors take
// the staged path, as a GPU's do when GPUDirect is unusable.
func (b *hostBuffer) Direct() (verbs.Memory, bool) { return verbs.Memory{}, false }

func (b *hostBuffer) Free() error {
	if !b.freed.CompareAndSwap(false, true) {
		return ErrFreed
	}
	b.alloc.mu.Lock()
	b.alloc.live--
	b.alloc.mu.Unlock()
	return nil
}
