//go:build linux && cgo && rdma

package ibv

/*
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// memoryRegion is memory registered with ibv_reg_mr.
type memoryRegion struct {
	d      *domain
	bytes  []byte
	mem    verbs.Memory // for per-grant registrations of DMA-BUF memory
	addr   uint64
	access verbs.Access
	flags  C.int // the ibv_access_flags it was registered with
	lkey   uint32
	rkey   uint32

	mu     sync.Mutex
	mr     *C.struct_ibv_mr // nil once deregistered
	grants map[*grant]struct{}
}

// RegisterMemory registers m.Bytes with ibv_reg_mr, which pins its pages.
//
// The memory must not be managed by the Go garbage collector's allocator in
// a way that could reuse it while the NIC may touch it: pass mmap'd arena
// memory (what mempool hands out). The region keeps a reference to
// m.Bytes, and the Go collector does not move heap objects, so a Go heap
// slice stays valid too; but its pages are shared with unrelated Go
// objects, which MADV_DONTFORK (fork safety) would then also cover. Only the
// address crosses into C, as an integer: libibverbs never holds a Go
// pointer.
func (d *domain) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	if len(m.Bytes) == 0 {
		return nil, fmt.Errorf("ibv: register memory: %w: empty", verbs.ErrInvalidMemory)
	}
	if rest := access &^ (verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead); rest != 0 {
		return nil, fmt.Errorf("ibv: register memory: %w: unknown access %s", verbs.ErrInvalidMemory, rest)
	}
	if uint64(len(m.Bytes)) > d.maxMRSize {
		return nil, fmt.Errorf("ibv: register memory: %w: %d bytes, %s registers at most %d",
			verbs.ErrInvalidMemory, len(m.Bytes), d.name, d.maxMRSize)
	}
	var flags C.int
	if access&verbs.AccessLocalWrite != 0 {
		flags |= C.IBV_ACCESS_LOCAL_WRITE
	}
	if access&verbs.AccessRemoteWrite != 0 {
		// The NIC requires local write with remote write. Local writes the
		// region does not grant are refused in Go before posting.
		flags |= C.IBV_ACCESS_REMOTE_WRITE | C.IBV_ACCESS_LOCAL_WRITE
	}
	if access&verbs.AccessRemoteRead != 0 {
		flags |= C.IBV_ACCESS_REMOTE_READ
	}
	if d.windows() {
		// Grants bind memory windows to the region (see grant.go).
		flags |= C.IBV_ACCESS_MW_BIND
	}
	// The address is an integer from here on; the region keeps m.Bytes
	// reachable until it is deregistered.
	addr := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(m.Bytes))))

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, softrc.ClosedError("ibv", "register memory")
	}
	if m.DMABuf && !m.HasFD {
		return nil, fmt.Errorf("ibv: register memory: %w: DMA-BUF memory without its fd", verbs.ErrInvalidMemory)
	}
	mr, err := d.register(m, 0, len(m.Bytes), addr, flags)
	if mr == nil {
		return nil, fmt.Errorf("ibv: register %d bytes at %#x with %s: %v%s", len(m.Bytes), addr, access, err, memlockHint(err))
	}
	r := &memoryRegion{
		d:      d,
		bytes:  m.Bytes,
		mem:    m,
		addr:   addr,
		access: access,
		flags:  flags,
		lkey:   uint32(mr.lkey),
		rkey:   uint32(mr.rkey),
		mr:     mr,
	}
	d.mrs[r] = struct{}{}
	return r, nil
}

// register registers length bytes at offset of m, whose first byte is at
// addr, with ibv_reg_mr or, for DMA-BUF memory, ibv_reg_dmabuf_mr. The
// caller holds d.mu.
func (d *domain) register(m verbs.Memory, offset, length int, addr uint64, flags C.int) (*C.struct_ibv_mr, error) {
	start := addr + uint64(offset)
	if m.DMABuf {
		// Device memory exported as a DMA-BUF: the NIC maps it through
		// the fd; the device address is the region's iova.
		mr, err := C.trpc_reg_dmabuf_mr(d.pd, C.uint64_t(m.FDOffset+int64(offset)), C.uint64_t(length), C.uint64_t(start), C.int(m.FD), flags)
		return mr, err
	}
	mr, err := C.trpc_reg_mr(d.pd, C.uint64_t(start), C.uint64_t(length), flags)
	return mr, err
}

func memlockHint(err error) string {
	if errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.EPERM) {
		return " (pinned memory counts against RLIMIT_MEMLOCK: raise ulimit -l)"
	}
	return ""
}

func (r *memoryRegion) Addr() uint64         { return r.addr }
func (r *memoryRegion) Len() int             { return len(r.bytes) }
func (r *memoryRegion) Bytes() []byte        { return r.bytes }
func (r *memoryRegion) LocalKey() uint32     { return r.lkey }
func (r *memoryRegion) RemoteKey() uint32    { return r.rkey }
func (r *memoryRegion) Access() verbs.Access { return r.access }

func (r *memoryRegion) registered() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.mr != nil
}

// view is what the pure-Go checks need to know of the region.
func (r *memoryRegion) view() regionView {
	return regionView{
		length:     len(r.bytes),
		access:     r.access,
		registered: r.registered(),
		localWrite: r.flags&C.IBV_ACCESS_LOCAL_WRITE != 0,
	}
}

// Deregister revokes the region's grants (a window bound to a region keeps
// ibv_dereg_mr from succeeding), then calls ibv_dereg_mr. A second call
// returns nil.
func (r *memoryRegion) Deregister() error {
	r.mu.Lock()
	if r.mr == nil {
		r.mu.Unlock()
		return nil
	}
	grants := keys(r.grants)
	r.mu.Unlock()
	var errs []error
	for _, g := range grants {
		if err := g.Revoke(); err != nil {
			errs = append(errs, err)
		}
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if r.mr == nil {
		return errors.Join(errs...)
	}
	if rc := C.ibv_dereg_mr(r.mr); rc != 0 {
		errs = append(errs, fmt.Errorf("ibv: deregister region at %#x: %v", r.addr, errnoError(rc)))
		return errors.Join(errs...)
	}
	r.mr = nil
	untrack(r.d, r.d.mrs, r)
	return errors.Join(errs...)
}
