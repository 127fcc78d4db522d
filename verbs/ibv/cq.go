//go:build linux && cgo && rdma

package ibv

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// errCQClosed is the error of a closed completion queue, as the soft
// providers word it.
var errCQClosed = fmt.Errorf("ibv: completion queue: %w", verbs.ErrClosed)

// completionQueue is an ibv_cq with its own completion channel.
//
// Capacity: NewQueuePair reserves MaxSend (and MaxRecv) entries of its
// queues' capacity, so the NIC never overflows the queue; the reservation
// returns when the queue pair is destroyed (see queuePair.Close).
//
// Provider-internal completions (window binds and invalidates, see
// wrid.go) are consumed in the poll path: Poll never returns them. Grant
// and Revoke wait for theirs by draining the queue themselves; the caller's
// completions they take on the way are kept, in order, in stash, and Poll
// hands those out first.
//
// Wait sleeps in the Go poller, not in a blocked thread: the channel's fd is
// non-blocking and a duplicate of it is an *os.File. Only one Wait at a time
// arms the queue and sleeps on the channel (it holds the waiter token);
// others wait for the token and poll before they arm. So no Wait sleeps
// while completions it could take sit in the queue: the sleeper armed the
// queue before its last poll, and every other Wait polls first.
type completionQueue struct {
	d      *domain
	file   *os.File // duplicate of channel.fd, registered with the Go poller
	raw    syscall.RawConn
	waiter chan struct{} // capacity 1: held by the Wait sleeping on file
	done   chan struct{} // closed by Close

	capacity int

	mu       sync.Mutex // guards the fields below and serializes C calls
	closed   bool
	cq       *C.struct_ibv_cq // nil once destroyed
	channel  *C.struct_ibv_comp_channel
	wcs      [C.TRPC_BATCH]C.trpc_wc
	reserved int                // entries reserved by queue pairs
	stash    []verbs.Completion // the caller's completions taken by drain
}

func (d *domain) NewCompletionQueue(capacity int) (verbs.CompletionQueue, error) {
	if capacity <= 0 || capacity > d.maxCQE {
		return nil, fmt.Errorf("ibv: completion queue capacity %d outside 1..%d of %s", capacity, d.maxCQE, d.name)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, softrc.ClosedError("ibv", "new completion queue")
	}
	channel, err := C.ibv_create_comp_channel(d.ctx)
	if channel == nil {
		return nil, fmt.Errorf("ibv: create completion channel: %v", err)
	}
	file, err := pollableDup(int(channel.fd))
	if err != nil {
		C.ibv_destroy_comp_channel(channel)
		return nil, err
	}
	raw, err := file.SyscallConn()
	if err != nil {
		file.Close()
		C.ibv_destroy_comp_channel(channel)
		return nil, err
	}
	cq, err := C.ibv_create_cq(d.ctx, C.int(capacity), nil, channel, 0)
	if cq == nil {
		file.Close()
		C.ibv_destroy_comp_channel(channel)
		return nil, fmt.Errorf("ibv: create completion queue of %d: %v", capacity, err)
	}
	q := &completionQueue{
		d:        d,
		capacity: capacity,
		file:     file,
		raw:      raw,
		waiter:   make(chan struct{}, 1),
		done:     make(chan struct{}),
		cq:       cq,
		channel:  channel,
	}
	d.cqs[q] = struct{}{}
	return q, nil
}

// pollableDup makes fd non-blocking and returns a duplicate of it that the
// Go poller watches. O_NONBLOCK belongs to the open file, so it holds for
// fd too: ibv_get_cq_event then never blocks a thread.
func pollableDup(fd int) (*os.File, error) {
	if err := syscall.SetNonblock(fd, true); err != nil {
		return nil, fmt.Errorf("ibv: completion channel: set non-blocking: %v", err)
	}
	dup, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_DUPFD_CLOEXEC, 0)
	if errno != 0 {
		return nil, fmt.Errorf("ibv: completion channel: dup: %v", errno)
	}
	file := os.NewFile(dup, "ibv-completion-channel")
	if err := file.SetReadDeadline(time.Time{}); err != nil {
		file.Close()
		return nil, fmt.Errorf("ibv: completion channel fd is not pollable: %v", err)
	}
	return file, nil
}

// Poll takes up to len(out) completions without blocking.
func (cq *completionQueue) Poll(out []verbs.Completion) int {
	n, drained := cq.poll(out)
	// Queue pairs closed while work was outstanding are destroyed once
	// their last completion is out (see queuePair.Close).
	for _, qp := range drained {
		qp.destroy()
	}
	return n
}

func (cq *completionQueue) poll(out []verbs.Completion) (int, []*queuePair) {
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if cq.closed || cq.cq == nil {
		return 0, nil
	}
	total := copy(out, cq.stash)
	cq.stash = cq.stash[total:]
	if len(cq.stash) == 0 {
		cq.stash = nil
	}
	var drained []*queuePair
	for total < len(out) {
		want := min(len(out)-total, C.TRPC_BATCH)
		got := cq.pollLocked(want, func(c verbs.Completion) {
			out[total] = c
			total++
		}, &drained)
		if got < want {
			break
		}
	}
	return total, drained
}

// pollLocked takes up to want completions from the NIC, hands each one
// meant for the caller to report, and returns how many it took. The
// caller holds cq.mu.
func (cq *completionQueue) pollLocked(want int, report func(verbs.Completion), drained *[]*queuePair) int {
	got := int(C.trpc_poll_cq(cq.cq, &cq.wcs[0], C.int(want)))
	for i := range max(got, 0) {
		wc := &cq.wcs[i]
		v, ok := cq.d.byQPN.Load(uint32(wc.qp_num))
		if !ok {
			continue // a queue pair destroyed meanwhile; nobody waits for it
		}
		qp := v.(*queuePair)
		c, forCaller, last := qp.complete(wc)
		if forCaller {
			report(c)
		}
		if last {
			*drained = append(*drained, qp)
		}
	}
	return got
}

// drain takes every completion the NIC holds: internal ones finish their
// Grant or Revoke, the caller's are stashed for the next Poll. It reports
// false once the queue is closed.
func (cq *completionQueue) drain() bool {
	cq.mu.Lock()
	if cq.closed || cq.cq == nil {
		cq.mu.Unlock()
		return false
	}
	var drained []*queuePair
	stash := func(c verbs.Completion) { cq.stash = append(cq.stash, c) }
	for cq.pollLocked(C.TRPC_BATCH, stash, &drained) == C.TRPC_BATCH {
		// A full batch: the NIC may hold more.
	}
	cq.mu.Unlock()
	for _, qp := range drained {
		qp.destroy()
	}
	return true
}

// reserveLocked reserves n entries; the caller holds cq.mu.
func (cq *completionQueue) reserveLocked(n int) error {
	if n > cq.capacity-cq.reserved {
		return fmt.Errorf("ibv: completion queue of %d has room for %d more outstanding requests, not %d: %w",
			cq.capacity, cq.capacity-cq.reserved, n, verbs.ErrQueueFull)
	}
	cq.reserved += n
	return nil
}

func (cq *completionQueue) unreserve(n int) {
	cq.mu.Lock()
	cq.reserved = max(cq.reserved-n, 0)
	cq.mu.Unlock()
}

// Wait blocks until it can take at least one completion or ctx ends.
func (cq *completionQueue) Wait(ctx context.Context, out []verbs.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	for {
		if n := cq.Poll(out); n > 0 {
			return n, nil
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		select {
		case <-cq.done:
			return 0, errCQClosed
		default:
		}
		select {
		case cq.waiter <- struct{}{}:
		case <-cq.done:
			return 0, errCQClosed
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		n, err := cq.sleep(ctx, out)
		<-cq.waiter
		if n > 0 || err != nil {
			return n, err
		}
	}
}

// sleep arms the queue, polls once more and then sleeps until the channel
// delivers an event. The caller holds the waiter token.
func (cq *completionQueue) sleep(ctx context.Context, out []verbs.Completion) (int, error) {
	if err := cq.arm(); err != nil {
		return 0, err
	}
	// A completion that arrived before the queue was armed raises no event.
	if n := cq.Poll(out); n > 0 {
		return n, nil
	}

	deadline, _ := ctx.Deadline() // zero: none
	cq.file.SetReadDeadline(deadline)
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		cq.file.SetReadDeadline(time.Unix(1, 0)) // wakes the sleeper
		close(fired)
	})
	defer func() {
		if !stop() {
			<-fired // so the next sleeper's deadline is not overwritten
		}
	}()

	var eventErr error
	err := cq.raw.Read(func(uintptr) bool {
		got, err := cq.takeEvent()
		if err != nil {
			eventErr = err
			return true
		}
		return got // false: sleep until the fd is readable
	})
	switch {
	case eventErr != nil:
		return 0, eventErr
	case err == nil:
		return 0, nil // an event: the caller polls
	case cq.isClosed():
		return 0, errCQClosed
	case ctx.Err() != nil:
		return 0, ctx.Err()
	case errors.Is(err, os.ErrDeadlineExceeded):
		return 0, context.DeadlineExceeded
	}
	return 0, fmt.Errorf("ibv: wait for completion event: %w", err)
}

func (cq *completionQueue) arm() error {
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if cq.closed || cq.cq == nil {
		return errCQClosed
	}
	if rc := C.trpc_req_notify_cq(cq.cq); rc != 0 {
		return fmt.Errorf("ibv: request completion notification: %v", errnoError(rc))
	}
	return nil
}

// takeEvent reads and acknowledges one completion event, if there is one.
func (cq *completionQueue) takeEvent() (bool, error) {
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if cq.closed || cq.channel == nil {
		return false, errCQClosed
	}
	rc := C.trpc_get_cq_event(cq.channel)
	if rc < 0 {
		return false, fmt.Errorf("ibv: get completion event: %v", errnoError(rc))
	}
	return rc == 1, nil
}

func (cq *completionQueue) isClosed() bool {
	cq.mu.Lock()
	defer cq.mu.Unlock()
	return cq.closed
}

// Close wakes blocked Waits and destroys the queue. While a queue pair
// still uses it, libibverbs refuses to destroy it; then the queue pair's
// destruction (or the domain's Close) finishes the job.
func (cq *completionQueue) Close() error {
	cq.mu.Lock()
	if cq.closed {
		cq.mu.Unlock()
		return nil
	}
	cq.closed = true
	close(cq.done)
	cq.mu.Unlock()
	// Not under mu: closing waits for a sleeping Wait to leave the poller,
	// and its callback takes mu.
	cq.file.Close()
	return cq.release()
}

// release destroys the queue and its channel if no queue pair uses the
// queue any more. It is idempotent.
func (cq *completionQueue) release() error {
	cq.mu.Lock()
	if cq.cq != nil {
		rc := C.ibv_destroy_cq(cq.cq)
		if rc == C.EBUSY {
			cq.mu.Unlock()
			return nil
		}
		if rc != 0 {
			cq.mu.Unlock()
			return fmt.Errorf("ibv: destroy completion queue: %v", errnoError(rc))
		}
		cq.cq = nil
	}
	var err error
	if cq.channel != nil {
		if rc := C.ibv_destroy_comp_channel(cq.channel); rc != 0 {
			err = fmt.Errorf("ibv: destroy completion channel: %v", errnoError(rc))
		}
		cq.channel = nil
	}
	cq.mu.Unlock()
	untrack(cq.d, cq.d.cqs, cq)
	return err
}

// wcStatus maps an ibv_wc_status to a verbs.Status.
func wcStatus(status C.uint32_t) verbs.Status {
	switch status {
	case C.IBV_WC_SUCCESS:
		return verbs.StatusSuccess
	case C.IBV_WC_LOC_LEN_ERR:
		return verbs.StatusLocalLength
	case C.IBV_WC_LOC_PROT_ERR:
		return verbs.StatusLocalProtection
	case C.IBV_WC_REM_ACCESS_ERR:
		return verbs.StatusRemoteAccess
	case C.IBV_WC_REM_INV_REQ_ERR:
		return verbs.StatusRemoteInvalidRequest
	case C.IBV_WC_REM_OP_ERR:
		return verbs.StatusRemoteOperation
	case C.IBV_WC_RNR_RETRY_EXC_ERR:
		return verbs.StatusReceiverNotReady
	case C.IBV_WC_RETRY_EXC_ERR:
		return verbs.StatusTransport
	case C.IBV_WC_WR_FLUSH_ERR:
		return verbs.StatusFlushed
	}
	return verbs.StatusRemoteOperation
}

// wcError describes a failed completion as libibverbs reported it.
func wcError(wc *C.trpc_wc) error {
	return fmt.Errorf("ibv: %s (ibv_wc_status %d, vendor error %#x)",
		C.GoString(C.ibv_wc_status_str(C.enum_ibv_wc_status(wc.status))), uint32(wc.status), uint32(wc.vendor_err))
}
