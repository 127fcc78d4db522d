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
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Grants come in two kinds (Attributes.Grants):
//
// GrantWindow, on devices with type 2 memory windows: Grant takes a window
// (from the domain's pool of invalidated windows, or ibv_alloc_mw), posts an
// IBV_WR_BIND_MW on this queue pair that binds it to the range with the one
// right and a new rkey (ibv_inc_rkey of the window's last one), and waits
// for the bind's completion. The window is bound to this queue pair: the
// NIC refuses its key on any other. Revoke posts IBV_WR_LOCAL_INV of the
// key on the same queue pair and waits for it; the invalidated window goes
// back to the pool. When the queue pair can no longer post (closed, in
// ERR), Revoke deallocates the window instead (ibv_dealloc_mw unbinds it).
//
// GrantRegistration, on devices without: Grant registers just the range
// (ibv_reg_mr, or ibv_reg_dmabuf_mr) with the one right, and Revoke
// deregisters it. The key is valid on any queue pair of the domain. There
// is no cache of these registrations: two grants of the same range would
// share a key, and revoking one would leave the key open.
//
// Waiting for a bind or an invalidate: these requests take a send queue
// slot, with a wr_id in the internal range (wrid.go). Whoever polls the
// send completion queue first finishes them in the poll path: the caller's
// Poll or Wait (which never returns them), or the waiting Grant or Revoke,
// which drains the queue itself with a short backoff so that it needs no
// poller elsewhere; the caller's completions it takes meanwhile are kept
// for the caller's next Poll, in order. A bind or invalidate that fails
// moves the queue pair to ERR, as any failed request does.
type grant struct {
	q      *queuePair
	region *memoryRegion
	remote verbs.Remote
	length int
	access verbs.Access

	mu      sync.Mutex
	revoked bool
	mw      *C.struct_ibv_mw // GrantWindow
	mr      *C.struct_ibv_mr // GrantRegistration
}

// window is a type 2 memory window and the rkey of its last bind.
type window struct {
	mw   *C.struct_ibv_mw
	rkey uint32
}

// internalTimeout bounds how long Grant and Revoke wait for their request's
// completion, which a working NIC delivers in microseconds.
const internalTimeout = 10 * time.Second

func (g *grant) Remote() verbs.Remote { return g.remote }
func (g *grant) Len() int             { return g.length }
func (g *grant) Access() verbs.Access { return g.access }

// Grant opens length bytes at offset of region to the peer of q, with one
// right. See the comment of type grant.
func (q *queuePair) Grant(region verbs.MemoryRegion, offset, length int, access verbs.Access) (verbs.Grant, error) {
	q.mu.Lock()
	err := q.postErrorLocked(false)
	q.mu.Unlock()
	if err != nil {
		return nil, err
	}
	r, ok := region.(*memoryRegion)
	if !ok || r == nil || r.d != q.d {
		return nil, fmt.Errorf("ibv: grant: %w: region belongs to another protection domain", verbs.ErrInvalidMemory)
	}
	if err := checkGrant(r.view(), offset, length, access); err != nil {
		return nil, fmt.Errorf("ibv: grant: %w", err)
	}

	g := &grant{q: q, region: r, length: length, access: access}
	if q.d.windows() {
		err = q.bindWindow(g, r, offset, length, access)
	} else {
		err = q.d.registerGrant(g, r, offset, length, access)
	}
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	if r.mr == nil {
		// Deregistered meanwhile: the grant must not outlive its region.
		r.mu.Unlock()
		g.Revoke()
		return nil, fmt.Errorf("ibv: grant: %w: region is deregistered", verbs.ErrInvalidMemory)
	}
	if r.grants == nil {
		r.grants = map[*grant]struct{}{}
	}
	r.grants[g] = struct{}{}
	r.mu.Unlock()
	return g, nil
}

// grantFlags are the ibv_access_flags of a per-grant registration with
// the grant's one right.
func grantFlags(access verbs.Access) C.int {
	if access == verbs.AccessRemoteWrite {
		// ibv_reg_mr requires local write with remote write.
		return C.IBV_ACCESS_REMOTE_WRITE | C.IBV_ACCESS_LOCAL_WRITE
	}
	return C.IBV_ACCESS_REMOTE_READ
}

// windowFlags are the mw_access_flags of a window bound with the grant's
// one right: remote rights only (the region it is bound to holds local
// write, which checkGrant requires for remote write).
func windowFlags(access verbs.Access) C.int {
	if access == verbs.AccessRemoteWrite {
		return C.IBV_ACCESS_REMOTE_WRITE
	}
	return C.IBV_ACCESS_REMOTE_READ
}

// registerGrant registers just the granted range (GrantRegistration).
func (d *domain) registerGrant(g *grant, r *memoryRegion, offset, length int, access verbs.Access) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return verbs.ErrClosed
	}
	mr, err := d.register(r.mem, offset, length, r.addr, grantFlags(access))
	if mr == nil {
		return fmt.Errorf("ibv: grant: register %d bytes at %#x with %s: %v%s", length, r.addr+uint64(offset), access, err, memlockHint(err))
	}
	g.mr = mr
	g.remote = verbs.Remote{Addr: r.addr + uint64(offset), Key: uint32(mr.rkey)}
	return nil
}

// takeWindow returns an invalidated window from the pool or a new one.
func (d *domain) takeWindow() (window, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return window{}, verbs.ErrClosed
	}
	if n := len(d.windowPool); n > 0 {
		w := d.windowPool[n-1]
		d.windowPool = d.windowPool[:n-1]
		return w, nil
	}
	mw, err := C.trpc_alloc_mw(d.pd)
	if mw == nil {
		return window{}, fmt.Errorf("ibv: grant: allocate a type 2 memory window: %v", err)
	}
	return window{mw: mw, rkey: uint32(mw.rkey)}, nil
}

// putWindow returns an invalidated window to the pool, or deallocates it
// when the domain is closed.
func (d *domain) putWindow(w window) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || d.pd == nil {
		C.trpc_dealloc_mw(w.mw)
		return
	}
	d.windowPool = append(d.windowPool, w)
}

// bindWindow binds a window to the range on q and waits for the bind.
func (q *queuePair) bindWindow(g *grant, r *memoryRegion, offset, length int, access verbs.Access) error {
	w, err := q.d.takeWindow()
	if err != nil {
		return err
	}
	rkey := incRKey(w.rkey)
	addr := r.addr + uint64(offset)
	op := newInternalOp()

	q.mu.Lock()
	var refuse error
	// The bind is a send request: it needs a connected queue pair.
	refuse = q.postErrorLocked(true)
	r.mu.Lock()
	mr := r.mr
	r.mu.Unlock()
	if refuse == nil && mr == nil {
		refuse = fmt.Errorf("ibv: grant: %w: region is deregistered", verbs.ErrInvalidMemory)
	}
	var idx uint32
	if refuse == nil {
		var ok bool
		if idx, ok = q.send.take(slot{wait: op}); !ok {
			refuse = fmt.Errorf("ibv: grant: binding a memory window takes a send queue slot: %w", verbs.ErrQueueFull)
		}
	}
	if refuse == nil {
		rc := C.trpc_post_bind_mw(q.qp, C.uint64_t(encodeWRID(wrInternal, idx)), w.mw, C.uint32_t(rkey),
			mr, C.uint64_t(addr), C.uint64_t(length), windowFlags(access))
		if rc != 0 {
			q.send.unwindLast(1)
			refuse = fmt.Errorf("ibv: grant: post memory window bind: %w", postError(rc))
		}
	}
	q.mu.Unlock()
	if refuse != nil {
		q.d.putWindow(w) // never bound by this call: still invalid
		return refuse
	}

	// The bind is posted. A window whose bind failed, or may still
	// complete, is deallocated rather than pooled.
	mw := w.mw
	if finished, err := q.await(op, func() { C.trpc_dealloc_mw(mw) }); err != nil {
		if finished {
			C.trpc_dealloc_mw(mw)
		}
		return fmt.Errorf("ibv: grant: bind memory window: %w", err)
	}
	g.mw = w.mw
	g.remote = verbs.Remote{Addr: addr, Key: rkey}
	return nil
}

// await waits for an internal request's completion, draining the send
// completion queue itself (see the comment of type grant). It returns nil
// when the request succeeded. finished reports that the request completed
// (in error when err is not nil): the caller then releases what it used.
// When await gives up first (the completion queue closed, or no completion
// in internalTimeout), finished is false and late runs when the completion
// comes after all, or when the queue pair is destroyed.
func (q *queuePair) await(op *internalOp, late func()) (finished bool, err error) {
	deadline := time.Now().Add(internalTimeout)
	backoff := time.Microsecond
	for {
		select {
		case <-op.done:
			status, err := op.result()
			if status == verbs.StatusSuccess {
				return true, nil
			}
			if err == nil {
				err = errors.New(status.String())
			}
			return true, fmt.Errorf("%s: %w (%w)", status, verbs.ErrQPError, err)
		default:
		}
		var giveUp error
		if !q.sendCQ.drain() {
			giveUp = fmt.Errorf("completion queue closed before the request completed: %w", verbs.ErrClosed)
		} else if time.Now().After(deadline) {
			giveUp = fmt.Errorf("no completion in %v", internalTimeout)
		}
		if giveUp != nil {
			if op.abandon(late) {
				return false, giveUp
			}
			continue // it finished meanwhile
		}
		select {
		case <-op.done:
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Millisecond)
	}
}

// Revoke ends the grant; a second call returns nil.
func (g *grant) Revoke() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.revoked {
		return nil
	}
	var err error
	switch {
	case g.mw != nil:
		err = g.q.invalidate(window{mw: g.mw, rkey: g.remote.Key})
		g.mw = nil
	case g.mr != nil:
		if rc := C.ibv_dereg_mr(g.mr); rc != 0 {
			return fmt.Errorf("ibv: revoke grant at %#x: deregister: %v", g.remote.Addr, errnoError(rc))
		}
		g.mr = nil
	}
	g.revoked = true
	r := g.region
	r.mu.Lock()
	delete(r.grants, g)
	r.mu.Unlock()
	return err
}

// invalidate ends a window's binding: IBV_WR_LOCAL_INV on q when q can
// still post, then the window goes back to the pool; otherwise, or when
// the invalidate fails, ibv_dealloc_mw. When it returns, the window's key
// is dead either way; an error says the queue pair went to ERR on the way.
func (q *queuePair) invalidate(w window) error {
	dealloc := func() error {
		if rc := C.trpc_dealloc_mw(w.mw); rc != 0 {
			return fmt.Errorf("ibv: revoke grant: deallocate memory window: %v", errnoError(rc))
		}
		return nil
	}
	op := newInternalOp()
	q.mu.Lock()
	usable := !q.closed && q.qp != nil && !q.failed && q.state == verbs.QPReadyToSend
	var idx uint32
	if usable {
		idx, usable = q.send.take(slot{wait: op})
	}
	if usable {
		if rc := C.trpc_post_local_inv(q.qp, C.uint64_t(encodeWRID(wrInternal, idx)), C.uint32_t(w.rkey)); rc != 0 {
			q.send.unwindLast(1)
			usable = false
		}
	}
	q.mu.Unlock()
	if !usable {
		return dealloc()
	}
	if finished, err := q.await(op, func() { dealloc() }); err != nil {
		err = fmt.Errorf("ibv: revoke grant: invalidate memory window: %w", err)
		if finished {
			err = errors.Join(err, dealloc())
		}
		return err
	}
	q.d.putWindow(w)
	return nil
}

// The provider implements these interfaces, and not verbs.RemoteMapper: a
// peer's memory behind a NIC cannot be mapped into this process.
var (
	_ verbs.ProtectionDomain = (*domain)(nil)
	_ verbs.QueuePair        = (*queuePair)(nil)
	_ verbs.Grant            = (*grant)(nil)
	_ verbs.MemoryRegion     = (*memoryRegion)(nil)
	_ verbs.CompletionQueue  = (*completionQueue)(nil)
)
