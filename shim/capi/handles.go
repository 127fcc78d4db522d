//go:build cgo

package main

import (
	"slices"
	"sync"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// table maps integer handles to Go values, so that C holds integers, never
// Go pointers. Handles start at 1 and are never reused, so a stale handle
// finds nothing instead of someone else's object.
type table[T any] struct {
	mu   sync.Mutex
	next uint64
	m    map[uint64]T
}

func (t *table[T]) add(v T) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = make(map[uint64]T)
	}
	t.next++
	t.m[t.next] = v
	return t.next
}

func (t *table[T]) get(h uint64) (T, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[h]
	return v, ok
}

func (t *table[T]) remove(h uint64) (T, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[h]
	delete(t.m, h)
	return v, ok
}

var (
	servers table[*serverEntry]
	clients table[*clientEntry]
	replies table[*replyEntry]
)

// ownedTensor is a tensor the shim handed out as one or more
// DLManagedTensors. Each DLManagedTensor owns one reference; the last one
// released releases the tensor's memory.
type ownedTensor struct {
	t      *rpc.Tensor   // a tensor in host memory; nil for a device tensor
	dev    *deviceTensor // a tensor in device memory (trpc_client_fetch_device); nil for a host tensor
	refs   int           // guarded by tensors.mu
	addr   uintptr       // address of the first byte; 0 for an empty or device tensor
	server *serverEntry  // whose pool t lives in, when a server's; else nil
}

// deviceTensor is a tensor in device memory the library allocated.
type deviceTensor struct {
	dtype zerocopy.DType
	shape []int64
	mem   *deviceAlloc
}

// deviceKey names device memory by device and address.
type deviceKey struct {
	ordinal int
	ptr     uint64
}

// tensors is the table of owned tensors, also indexed by address so that a
// tensor handed back to the shim (sent, published, returned from a handler)
// is recognised as pool memory and not copied again.
var tensors = struct {
	mu       sync.Mutex
	next     uint64
	byHandle map[uint64]*ownedTensor
	byAddr   map[uintptr]uint64
	byDevice map[deviceKey]uint64
}{byHandle: map[uint64]*ownedTensor{}, byAddr: map[uintptr]uint64{}, byDevice: map[deviceKey]uint64{}}

// adopt takes over t (its reference becomes the table's) and returns its
// handle with one reference, for the first DLManagedTensor.
func adopt(t *rpc.Tensor, srv *serverEntry) uint64 {
	o := &ownedTensor{t: t, refs: 1, server: srv}
	if b := t.Bytes(); len(b) > 0 {
		o.addr = addrOf(b)
	}
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	tensors.next++
	h := tensors.next
	tensors.byHandle[h] = o
	if o.addr != 0 {
		tensors.byAddr[o.addr] = h
	}
	return h
}

// ref adds a reference to handle h and returns its tensor.
func ref(h uint64) (*ownedTensor, bool) {
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	o, ok := tensors.byHandle[h]
	if ok {
		o.refs++
	}
	return o, ok
}

// unref drops a reference to handle h and releases the tensor with the
// last one.
func unref(h uint64) {
	tensors.mu.Lock()
	o, ok := tensors.byHandle[h]
	if !ok {
		tensors.mu.Unlock()
		return
	}
	o.refs--
	if o.refs > 0 {
		tensors.mu.Unlock()
		return
	}
	delete(tensors.byHandle, h)
	if o.addr != 0 && tensors.byAddr[o.addr] == h {
		delete(tensors.byAddr, o.addr)
	}
	if o.dev != nil {
		k := deviceKey{o.dev.mem.ordinal, o.dev.mem.ptr}
		if tensors.byDevice[k] == h {
			delete(tensors.byDevice, k)
		}
		tensors.mu.Unlock()
		o.dev.mem.free()
		return
	}
	tensors.mu.Unlock()
	o.t.Release()
}

// adoptDevice takes over a device tensor and returns its handle with one
// reference, for the first DLManagedTensor.
func adoptDevice(d *deviceTensor) uint64 {
	o := &ownedTensor{dev: d, refs: 1}
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	tensors.next++
	h := tensors.next
	tensors.byHandle[h] = o
	if d.mem.n > 0 {
		tensors.byDevice[deviceKey{d.mem.ordinal, d.mem.ptr}] = h
	}
	return h
}

// lookupDevice finds the device tensor the library handed out whose
// memory starts at ptr on the device ordinal and holds at least n bytes,
// and adds a reference to it.
func lookupDevice(ordinal int, ptr uint64, n int) (uint64, *ownedTensor, bool) {
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	h, ok := tensors.byDevice[deviceKey{ordinal, ptr}]
	if !ok {
		return 0, nil, false
	}
	o := tensors.byHandle[h]
	if o.dev.mem.n < n {
		return 0, nil, false
	}
	o.refs++
	return h, o, true
}

// lookup finds the owned tensor that occupies exactly the bytes of want,
// with want's dtype and shape, and adds a reference to it.
func lookup(want zerocopy.Tensor) (uint64, *ownedTensor, bool) {
	if len(want.Bytes()) == 0 {
		return 0, nil, false
	}
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	h, ok := tensors.byAddr[addrOf(want.Bytes())]
	if !ok {
		return 0, nil, false
	}
	o := tensors.byHandle[h]
	if o.t == nil || len(o.t.Bytes()) != len(want.Bytes()) || o.t.DType() != want.DType() || !slices.Equal(o.t.Shape(), want.Shape()) {
		return 0, nil, false
	}
	o.refs++
	return h, o, true
}

func liveTensors() int {
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	return len(tensors.byHandle)
}
