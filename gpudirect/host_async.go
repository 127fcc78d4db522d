package gpudirect

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// The host-fake device's asynchronous side: streams whose copies run on a
// worker goroutine of their own (late, with HostCopyDelay or
// HostCopyBandwidth), events, and a registrar of host memory that fails as
// the CUDA driver's cuMemHostRegister does. A test that reads staged
// memory before its copy's event completed sees stale bytes, as it would
// on a GPU.

// Errors of the host-fake registrar, named after the driver's.
var (
	errFakeRegistered    = errors.New("gpudirect: host-fake: host memory already registered (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)")
	errFakeNotRegistered = errors.New("gpudirect: host-fake: host memory not registered (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)")
	errFakeInvalid       = errors.New("gpudirect: host-fake: invalid value (CUDA_ERROR_INVALID_VALUE)")
)

// NewStream returns a stream with a worker goroutine of its own, which
// Close (the stream's or the allocator's) ends.
func (b *hostBuffer) NewStream() (Stream, error) {
	if b.freed.Load() {
		return nil, ErrFreed
	}
	a := b.alloc
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, ErrClosed
	}
	st := &hostStream{alloc: a, ops: make(chan hostOp, 64), exited: make(chan struct{})}
	a.streams[st] = struct{}{}
	go st.work()
	return st, nil
}

// HostRegistrar returns the allocator's registrar: one per allocator, as
// a driver has one per context.
func (b *hostBuffer) HostRegistrar() HostRegistrar { return &b.alloc.registrar }

// hostOp is one entry of a stream: a copy of n bytes, or an event.
type hostOp struct {
	copy  func() error
	n     int
	event *hostEvent
}

type hostStream struct {
	alloc  *HostAllocator
	mu     sync.Mutex // closed and sends on ops
	closed bool
	ops    chan hostOp
	exited chan struct{}

	errMu sync.Mutex
	err   error // the first failed copy's; later copies are skipped
}

func (st *hostStream) work() {
	defer close(st.exited)
	for op := range st.ops {
		st.errMu.Lock()
		err := st.err
		st.errMu.Unlock()
		if op.event != nil {
			op.event.err = err
			close(op.event.done)
			continue
		}
		if err != nil {
			continue
		}
		a := st.alloc
		if wait := a.delay + a.copyTime(op.n); wait > 0 {
			sleepUntil(time.Now().Add(wait)) // a time.Sleep under 1 ms takes 1 ms
		}
		if err := op.copy(); err != nil {
			st.errMu.Lock()
			st.err = err
			st.errMu.Unlock()
		}
	}
}

// copyTime is how long n bytes take at the allocator's bandwidth.
func (a *HostAllocator) copyTime(n int) time.Duration {
	if a.bandwidth <= 0 {
		return 0
	}
	return time.Duration(float64(n) / a.bandwidth * float64(time.Second))
}

func (st *hostStream) enqueue(op hostOp) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return fmt.Errorf("gpudirect: host-fake: stream closed")
	}
	st.ops <- op
	return nil
}

func asHost(b DeviceBuffer) (*hostBuffer, error) {
	h, ok := b.(*hostBuffer)
	if !ok {
		return nil, fmt.Errorf("gpudirect: host-fake stream: %s is not host-fake memory", b.Device())
	}
	if h.freed.Load() {
		return nil, ErrFreed
	}
	return h, nil
}

func (st *hostStream) CopyToHost(dst []byte, src DeviceBuffer, offset int) error {
	h, err := asHost(src)
	if err != nil {
		return err
	}
	if err := checkRange(h.Device(), len(h.mem), offset, len(dst)); err != nil {
		return err
	}
	return st.enqueue(hostOp{n: len(dst), copy: func() error {
		if h.freed.Load() {
			return ErrFreed
		}
		copy(dst, h.mem[offset:])
		st.alloc.count(&st.alloc.copiesToHost, &st.alloc.bytesToHost, len(dst))
		return nil
	}})
}

func (st *hostStream) CopyFromHost(dst DeviceBuffer, offset int, src []byte) error {
	h, err := asHost(dst)
	if err != nil {
		return err
	}
	if err := checkRange(h.Device(), len(h.mem), offset, len(src)); err != nil {
		return err
	}
	return st.enqueue(hostOp{n: len(src), copy: func() error {
		if h.freed.Load() {
			return ErrFreed
		}
		copy(h.mem[offset:], src)
		st.alloc.count(&st.alloc.copiesFromHost, &st.alloc.bytesFromHost, len(src))
		return nil
	}})
}

func (st *hostStream) CopyDevice(dst DeviceBuffer, dstOffset int, src DeviceBuffer, srcOffset, n int) error {
	d, err := asHost(dst)
	if err != nil {
		return err
	}
	s, err := asHost(src)
	if err != nil {
		return err
	}
	if err := checkRange(d.Device(), len(d.mem), dstOffset, n); err != nil {
		return err
	}
	if err := checkRange(s.Device(), len(s.mem), srcOffset, n); err != nil {
		return err
	}
	return st.enqueue(hostOp{n: n, copy: func() error {
		if d.freed.Load() || s.freed.Load() {
			return ErrFreed
		}
		copy(d.mem[dstOffset:dstOffset+n], s.mem[srcOffset:])
		st.alloc.streamCopies.Add(1)
		return nil
	}})
}

func (a *HostAllocator) count(copies, bytes *atomic.Int64, n int) {
	copies.Add(1)
	bytes.Add(int64(n))
	a.streamCopies.Add(1)
}

func (st *hostStream) Record() (Event, error) {
	ev := &hostEvent{done: make(chan struct{})}
	if err := st.enqueue(hostOp{event: ev}); err != nil {
		return nil, err
	}
	return ev, nil
}

func (st *hostStream) Sync() error {
	ev, err := st.Record()
	if err != nil {
		return err
	}
	return ev.Wait(context.Background())
}

// Close waits for the stream's copies, ends its worker and returns the
// first copy's error, if any. A second Close returns nil.
func (st *hostStream) Close() error {
	st.mu.Lock()
	if st.closed {
		st.mu.Unlock()
		return nil
	}
	st.closed = true
	close(st.ops)
	st.mu.Unlock()
	<-st.exited
	a := st.alloc
	a.mu.Lock()
	delete(a.streams, st)
	a.mu.Unlock()
	st.errMu.Lock()
	defer st.errMu.Unlock()
	return st.err
}

// hostEvent completes when the stream's worker reaches it; err is the
// stream's error then (set before done is closed).
type hostEvent struct {
	done chan struct{}
	err  error
}

func (ev *hostEvent) Wait(ctx context.Context) error {
	select {
	case <-ev.done:
		return ev.err
	default:
	}
	select {
	case <-ev.done:
		return ev.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (ev *hostEvent) Done() (bool, error) {
	select {
	case <-ev.done:
		return true, ev.err
	default:
		return false, nil
	}
}

func (ev *hostEvent) Close() error { return nil }

// hostRegistrar records registered host ranges by start address, and
// refuses what the driver refuses: an empty range, one overlapping a
// registered range, the unregistration of a start that is not registered.
type hostRegistrar struct {
	alloc  *HostAllocator
	mu     sync.Mutex
	ranges map[uintptr]int

	registrations, unregistrations atomic.Int64
}

func (r *hostRegistrar) Name() string { return "host-fake" }

func (r *hostRegistrar) RegisterHost(b []byte) error {
	if len(b) == 0 {
		return errFakeInvalid
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	end := start + uintptr(len(b))
	r.mu.Lock()
	defer r.mu.Unlock()
	for s, n := range r.ranges {
		if start < s+uintptr(n) && s < end {
			return errFakeRegistered
		}
	}
	if r.ranges == nil {
		r.ranges = make(map[uintptr]int)
	}
	r.ranges[start] = len(b)
	r.registrations.Add(1)
	return nil
}

func (r *hostRegistrar) UnregisterHost(b []byte) error {
	if len(b) == 0 {
		return errFakeInvalid
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.ranges[start]; !ok {
		return errFakeNotRegistered
	}
	delete(r.ranges, start)
	r.unregistrations.Add(1)
	return nil
}
