package rpc_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// fakeIPC is an in-process stand-in for CUDA IPC: allocations of host
// memory named by random 64-byte handles, which "another process" (the
// other side of the test, in the same process) opens by handle. Copies
// on its streams run at once. It counts what is allocated and opened, so
// tests can check that everything is given back.
type fakeIPC struct {
	uuid [16]byte
	// gate, when set, holds device copies back until it is closed: the
	// copy runs then, Event.Wait returns early only when its context
	// ends, and Stream.Sync waits for it.
	gate chan struct{}

	mu     sync.Mutex
	allocs map[[64]byte]*fakeAlloc
	live   int // buffers allocated and not freed
	opened int // handles opened and not closed
	opens  int // handles ever opened
}

type fakeAlloc struct {
	handle [64]byte
	mem    []byte
	freed  bool
}

func newFakeIPC(uuid byte) *fakeIPC {
	return &fakeIPC{uuid: [16]byte{uuid, 0xc0, 0xda}, allocs: map[[64]byte]*fakeAlloc{}}
}

func (f *fakeIPC) DeviceUUIDs() ([][16]byte, error) { return [][16]byte{f.uuid}, nil }

// Alloc makes one allocation of n bytes and returns a buffer of all of it.
func (f *fakeIPC) Alloc(n int) (gpudirect.DeviceBuffer, error) {
	a := &fakeAlloc{mem: make([]byte, n)}
	rand.Read(a.handle[:])
	f.mu.Lock()
	f.allocs[a.handle] = a
	f.live++
	f.mu.Unlock()
	return &fakeBuf{f: f, a: a, n: n, owner: true}, nil
}

func (f *fakeIPC) Name() string { return "fake-cuda" }
func (f *fakeIPC) Close() error { return nil }

// slice is a buffer of n bytes at off inside b's allocation, freed with b.
func (b *fakeBuf) slice(off, n int) *fakeBuf {
	return &fakeBuf{f: b.f, a: b.a, off: b.off + off, n: n}
}

func (f *fakeIPC) OpenIPC(h gpudirect.IPCHandle) (gpudirect.DeviceBuffer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a := f.allocs[h.Handle]
	switch {
	case a == nil || a.freed:
		return nil, errors.New("fake CUDA: CUDA_ERROR_INVALID_VALUE: no such IPC handle")
	case h.UUID != f.uuid:
		return nil, errors.New("fake CUDA: CUDA_ERROR_INVALID_DEVICE")
	case h.Offset < 0 || h.Len < 0 || h.Offset+h.Len > int64(len(a.mem)):
		return nil, fmt.Errorf("fake CUDA: CUDA_ERROR_INVALID_VALUE: %d bytes at %d outside the allocation's %d", h.Len, h.Offset, len(a.mem))
	}
	f.opened++
	f.opens++
	return &fakeBuf{f: f, a: a, off: int(h.Offset), n: int(h.Len), opened: true}, nil
}

func (f *fakeIPC) counts() (live, opened, opens int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.live, f.opened, f.opens
}

type fakeBuf struct {
	f      *fakeIPC
	a      *fakeAlloc
	off, n int
	owner  bool // frees the allocation
	opened bool // an opened handle: Free closes it
	mu     sync.Mutex
	freed  bool
}

func (b *fakeBuf) Device() string { return "fake-cuda:0" }
func (b *fakeBuf) Len() int       { return b.n }
func (b *fakeBuf) bytes() []byte  { return b.a.mem[b.off : b.off+b.n] }
func (b *fakeBuf) CopyToHost(dst []byte, offset int) error {
	copy(dst, b.bytes()[offset:])
	return nil
}
func (b *fakeBuf) CopyFromHost(src []byte, offset int) error {
	copy(b.bytes()[offset:], src)
	return nil
}
func (b *fakeBuf) Direct() (verbs.Memory, bool) { return verbs.Memory{}, false }
func (b *fakeBuf) Free() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return gpudirect.ErrFreed
	}
	b.freed = true
	b.f.mu.Lock()
	defer b.f.mu.Unlock()
	switch {
	case b.owner:
		b.a.freed = true
		delete(b.f.allocs, b.a.handle)
		b.f.live--
	case b.opened:
		b.f.opened--
	}
	return nil
}
func (b *fakeBuf) NewStream() (gpudirect.Stream, error)   { return &fakeStream{gate: b.f.gate}, nil }
func (b *fakeBuf) HostRegistrar() gpudirect.HostRegistrar { return nil }
func (b *fakeBuf) IPCHandle() (gpudirect.IPCHandle, error) {
	return gpudirect.IPCHandle{Handle: b.a.handle, Offset: int64(b.off), Len: int64(b.n), UUID: b.f.uuid}, nil
}

// fakeStream copies at once, or when its gate opens.
type fakeStream struct {
	gate    chan struct{}
	pending sync.WaitGroup
}

func (*fakeStream) CopyToHost(dst []byte, src gpudirect.DeviceBuffer, offset int) error {
	return src.CopyToHost(dst, offset)
}
func (*fakeStream) CopyFromHost(dst gpudirect.DeviceBuffer, offset int, src []byte) error {
	return dst.CopyFromHost(src, offset)
}
func (st *fakeStream) CopyDevice(dst gpudirect.DeviceBuffer, dstOffset int, src gpudirect.DeviceBuffer, srcOffset, n int) error {
	d, s := dst.(*fakeBuf), src.(*fakeBuf)
	if d.freed || s.freed {
		return gpudirect.ErrFreed
	}
	if dstOffset < 0 || srcOffset < 0 || n < 0 || dstOffset+n > d.n || srcOffset+n > s.n {
		return errors.New("fake CUDA: CUDA_ERROR_INVALID_VALUE: copy out of range")
	}
	copyNow := func() { copy(d.bytes()[dstOffset:dstOffset+n], s.bytes()[srcOffset:srcOffset+n]) }
	if st.gate == nil {
		copyNow()
		return nil
	}
	st.pending.Add(1)
	go func() {
		defer st.pending.Done()
		<-st.gate
		copyNow()
	}()
	return nil
}
func (st *fakeStream) Record() (gpudirect.Event, error) { return fakeEvent{st}, nil }
func (st *fakeStream) Sync() error {
	st.pending.Wait()
	return nil
}
func (st *fakeStream) Close() error { return st.Sync() }

type fakeEvent struct{ st *fakeStream }

func (e fakeEvent) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { e.st.pending.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
func (fakeEvent) Done() (bool, error) { return true, nil }
func (fakeEvent) Close() error        { return nil }
