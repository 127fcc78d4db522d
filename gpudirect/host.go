package gpudirect

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// HostAllocator allocates host memory that poses as device memory: its
// buffers have Device "host-fake:0", copy to and from the host like a GPU
// would, and have no Direct memory, so every transfer of them is staged.
// It stands in for a GPU in tests and on hosts without one, and counts the
// copies so that tests can check how many a path made. It is safe for
// concurrent use.
type HostAllocator struct {
	mu      sync.Mutex
	live    int
	closed  bool
	streams map[*hostStream]struct{}

	// delay and bandwidth slow the copies of streams (HostCopyDelay,
	// HostCopyBandwidth).
	delay     time.Duration
	bandwidth float64
	registrar hostRegistrar

	allocs                       atomic.Int64
	copiesToHost, copiesFromHost atomic.Int64
	bytesToHost, bytesFromHost   atomic.Int64
	streamCopies                 atomic.Int64
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
	// StreamCopies counts the copies run on streams (any direction; they
	// are in the counters above too, CopyDevice excepted), Streams the
	// streams open now.
	StreamCopies int64
	Streams      int
	// Registered is the number of host ranges registered with the
	// allocator's HostRegistrar now; Registrations and Unregistrations
	// count the successful calls.
	Registered                     int
	Registrations, Unregistrations int64
}

// HostOption configures a HostAllocator.
type HostOption func(*HostAllocator)

// HostCopyDelay makes each copy on a stream wait d before it moves its
// bytes, so that a test which reads host memory before waiting for the
// copy's event sees the old bytes.
func HostCopyDelay(d time.Duration) HostOption {
	return func(a *HostAllocator) { a.delay = d }
}

// HostCopyBandwidth makes copies on streams take n/bytesPerSecond (after
// any HostCopyDelay), as a device's DMA engine would, so that benchmarks
// can show copies overlapping transfers. 0 (the default) copies at memory
// speed.
func HostCopyBandwidth(bytesPerSecond float64) HostOption {
	return func(a *HostAllocator) { a.bandwidth = bytesPerSecond }
}

// NewHostAllocator returns an allocator of host memory posing as device
// memory. Its buffers are AsyncBuffers: their streams copy on a worker
// goroutine of their own, and their HostRegistrar records registrations
// as a driver would (HostStats counts them).
func NewHostAllocator(opts ...HostOption) *HostAllocator {
	a := &HostAllocator{streams: make(map[*hostStream]struct{})}
	a.registrar.alloc = a
	for _, o := range opts {
		o(a)
	}
	return a
}

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
// Close, Alloc returns ErrClosed. Streams still open are closed (their
// copies run first, and their workers end) and make Close fail with
// ErrOutstanding too.
func (a *HostAllocator) Close() error {
	a.mu.Lock()
	open := make([]*hostStream, 0, len(a.streams))
	for st := range a.streams {
		open = append(open, st)
	}
	a.mu.Unlock()
	for _, st := range open {
		st.Close()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.live > 0 || len(open) > 0 {
		return fmt.Errorf("%w: %d host-fake buffers, %d streams", ErrOutstanding, a.live, len(open))
	}
	a.closed = true
	return nil
}

// Stats returns the allocator's counters.
func (a *HostAllocator) Stats() HostStats {
	a.mu.Lock()
	live, streams := a.live, len(a.streams)
	a.mu.Unlock()
	a.registrar.mu.Lock()
	registered := len(a.registrar.ranges)
	a.registrar.mu.Unlock()
	return HostStats{
		Live: live, Allocs: a.allocs.Load(),
		CopiesToHost: a.copiesToHost.Load(), CopiesFromHost: a.copiesFromHost.Load(),
		BytesToHost: a.bytesToHost.Load(), BytesFromHost: a.bytesFromHost.Load(),
		StreamCopies: a.streamCopies.Load(), Streams: streams,
		Registered: registered, Registrations: a.registrar.registrations.Load(), Unregistrations: a.registrar.unregistrations.Load(),
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
