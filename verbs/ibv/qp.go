//go:build linux && cgo && rdma

package ibv

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"syscall"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// queuePair is an RC ibv_qp.
type queuePair struct {
	d          *domain
	sendCQ     *completionQueue
	recvCQ     *completionQueue
	qpn        uint32
	psn        uint32
	info       []byte
	maxInline  int
	maxSendSGE int // scatter/gather elements of one send request
	maxRecvSGE int // of one receive request
	maxSend    int // reserved in sendCQ
	maxRecv    int // reserved in recvCQ

	mu         sync.Mutex       // guards the fields below and serializes posting
	qp         *C.struct_ibv_qp // nil once destroyed
	state      verbs.QPState    // the last state this side moved the QP to
	closed     bool
	failed     bool  // a work request completed in error: the QP is in ERR
	cause      error // why it is in ERR
	unreserved bool  // the completion queue reservation was returned
	send       sendSlots
	recv       slots
	sendWRs    []C.trpc_send // reused by each post; no Go pointers inside
	recvWRs    []C.trpc_recv
	sges       []C.struct_ibv_sge
}

// NewQueuePair makes a queue pair. cfg.LocalAddress and cfg.Role are
// ignored: an ibv queue pair exchanges no socket connection of its own.
// It reserves MaxSend entries of the send completion queue and MaxRecv of
// the receive completion queue, and fails with an error wrapping
// verbs.ErrQueueFull when they have no room left.
func (d *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, softrc.ClosedError("ibv", "new queue pair")
	}
	sendCQ, ok1 := cfg.SendCQ.(*completionQueue)
	recvCQ, ok2 := cfg.RecvCQ.(*completionQueue)
	if !ok1 || !ok2 || sendCQ == nil || recvCQ == nil || sendCQ.d != d || recvCQ.d != d {
		return nil, fmt.Errorf("ibv: new queue pair: completion queues must come from this ibv domain")
	}
	maxSend, maxRecv, err := softrc.QueueSizes(cfg, d.attrs.MaxQueueDepth)
	if err != nil {
		return nil, fmt.Errorf("ibv: new queue pair on %s: %w", d.name, err)
	}
	inline := cfg.MaxInline
	if inline <= 0 {
		inline = d.opts.maxInline
	}
	sge := d.attrs.MaxSegments
	psn, secret, err := randomPSNAndSecret()
	if err != nil {
		return nil, err
	}

	// Hold the queues so that neither is destroyed under ibv_create_qp,
	// and reserve room for every completion the queue pair can cause.
	// Only this method holds two queue locks, under d.mu.
	sendCQ.mu.Lock()
	if recvCQ != sendCQ {
		recvCQ.mu.Lock()
	}
	unlock := func() {
		if recvCQ != sendCQ {
			recvCQ.mu.Unlock()
		}
		sendCQ.mu.Unlock()
	}
	if sendCQ.cq == nil || recvCQ.cq == nil || sendCQ.closed || recvCQ.closed {
		unlock()
		return nil, fmt.Errorf("ibv: new queue pair: completion queue: %w", verbs.ErrClosed)
	}
	if err := sendCQ.reserveLocked(maxSend); err != nil {
		unlock()
		return nil, fmt.Errorf("ibv: new queue pair: send queue of %d: %w", maxSend, err)
	}
	if err := recvCQ.reserveLocked(maxRecv); err != nil {
		sendCQ.reserved -= maxSend
		unlock()
		return nil, fmt.Errorf("ibv: new queue pair: receive queue of %d: %w", maxRecv, err)
	}
	var caps C.trpc_qp_caps
	qp, cause := C.trpc_create_qp(d.pd, sendCQ.cq, recvCQ.cq, C.uint32_t(maxSend), C.uint32_t(maxRecv), C.uint32_t(sge), C.uint32_t(inline), &caps)
	if qp == nil && inline > 0 {
		// Some devices support no inline data at all.
		inline = 0
		qp, cause = C.trpc_create_qp(d.pd, sendCQ.cq, recvCQ.cq, C.uint32_t(maxSend), C.uint32_t(maxRecv), C.uint32_t(sge), 0, &caps)
	}
	if qp == nil {
		sendCQ.reserved -= maxSend
		recvCQ.reserved -= maxRecv
	}
	unlock()
	if qp == nil {
		return nil, fmt.Errorf("ibv: create RC queue pair (send %d, recv %d, %d scatter/gather elements, inline %d): %v", maxSend, maxRecv, sge, inline, cause)
	}
	q := &queuePair{
		d:          d,
		sendCQ:     sendCQ,
		recvCQ:     recvCQ,
		qpn:        uint32(qp.qp_num),
		psn:        psn,
		maxInline:  min(inline, int(caps.max_inline_data)), // devices may round up
		maxSendSGE: min(sge, int(caps.max_send_sge)),
		maxRecvSGE: min(sge, int(caps.max_recv_sge)),
		maxSend:    maxSend,
		maxRecv:    maxRecv,
		qp:         qp,
		state:      verbs.QPReset,
		send:       newSendSlots(maxSend),
		recv:       newSlots(maxRecv),
	}
	info := connInfo{
		linkLayer:  d.linkLayer,
		mtu:        d.mtu,
		responders: d.responders,
		lid:        d.lid,
		qpn:        q.qpn,
		psn:        psn,
		gid:        d.gid,
		secret:     secret,
	}
	q.info = info.marshal()
	d.qps[q] = struct{}{}
	d.byQPN.Store(q.qpn, q)
	return q, nil
}

func randomPSNAndSecret() (uint32, [16]byte, error) {
	var b [20]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, [16]byte{}, fmt.Errorf("ibv: random PSN: %v", err)
	}
	return binary.BigEndian.Uint32(b[:4]) & maxPSN, [16]byte(b[4:]), nil
}

func (q *queuePair) LocalInfo() []byte { return append([]byte(nil), q.info...) }

// Connect moves the queue pair through INIT and RTR to RTS. The modify
// calls do not block on the peer, so ctx is checked between them.
func (q *queuePair) Connect(ctx context.Context, remote []byte) error {
	peer, err := parseInfo(remote)
	if err != nil {
		return err
	}
	d := q.d
	if peer.linkLayer != d.linkLayer {
		return q.errorf("connect: %w: peer link layer %d, local %d", verbs.ErrInvalidInfo, peer.linkLayer, d.linkLayer)
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.postErrorLocked(false); err != nil {
		return err
	}
	if q.state != verbs.QPReset && q.state != verbs.QPInit {
		return q.errorf("connect in state %v, want RESET", q.state)
	}
	if err := q.toInitLocked(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	// Serve as many Reads at once as the device allows a queue pair
	// (max_qp_rd_atom); the peer learned that number from LocalInfo.
	rtr := C.trpc_rtr{
		dest_qpn:           C.uint32_t(peer.qpn),
		rq_psn:             C.uint32_t(peer.psn),
		path_mtu:           C.uint32_t(min(d.mtu, peer.mtu)),
		max_dest_rd_atomic: C.uint8_t(d.responders),
		min_rnr_timer:      C.uint8_t(d.opts.minRNRTimer),
		port:               C.uint8_t(d.opts.port),
	}
	if d.linkLayer == linkEthernet {
		// RoCE routes by GID: a global route header is required.
		rtr.is_global = 1
		rtr.sgid_index = C.uint8_t(d.gidIndex)
		rtr.traffic_class = C.uint8_t(d.opts.trafficClass)
		rtr.hop_limit = C.uint8_t(d.opts.hopLimit)
		for i, b := range peer.gid {
			rtr.dgid[i] = C.uint8_t(b)
		}
	} else {
		rtr.dlid = C.uint32_t(peer.lid)
	}
	if rc := C.trpc_qp_to_rtr(q.qp, &rtr); rc != 0 {
		return fmt.Errorf("ibv: connect: modify QP %#x to RTR (peer QP %#x): %v", q.qpn, peer.qpn, errnoError(rc))
	}
	q.state = verbs.QPReadyToReceive
	if err := ctx.Err(); err != nil {
		return err
	}
	// Issue as many Reads at once as the device allows (max_qp_init_rd_atom)
	// and the peer serves.
	initiators := min(d.initiators, peer.responders)
	if rc := C.trpc_qp_to_rts(q.qp, C.uint32_t(q.psn), C.uint8_t(d.opts.timeout), C.uint8_t(d.opts.retryCount),
		C.uint8_t(d.opts.rnrRetry), C.uint8_t(initiators)); rc != 0 {
		return fmt.Errorf("ibv: connect: modify QP %#x to RTS: %v", q.qpn, errnoError(rc))
	}
	q.state = verbs.QPReadyToSend
	return nil
}

// errorf is an error of the queue pair (see softrc.QPErrorf), which ibv
// numbers by its QP number.
func (q *queuePair) errorf(format string, args ...any) error {
	return softrc.QPErrorf("ibv", uint64(q.qpn), format, args...)
}

// postErrorLocked says why nothing can be posted now (see
// softrc.PostError), naming the queue pair and the cause of ERR.
func (q *queuePair) postErrorLocked(send bool) error {
	state := q.state
	if q.failed {
		state = verbs.QPError
	}
	if err := softrc.PostError(q.closed || q.qp == nil, state, q.cause, send); err != nil {
		return q.errorf("%w", err)
	}
	return nil
}

// fail records that the queue pair is in ERR, and the first cause.
func (q *queuePair) fail(cause error) {
	if !q.failed {
		q.failed, q.cause = true, cause
	}
}

// toInitLocked moves a fresh queue pair to INIT, where it accepts receives.
func (q *queuePair) toInitLocked() error {
	if q.state != verbs.QPReset {
		return nil
	}
	if rc := C.trpc_qp_to_init(q.qp, C.uint8_t(q.d.opts.port)); rc != 0 {
		return fmt.Errorf("ibv: modify QP %#x to INIT: %v", q.qpn, errnoError(rc))
	}
	q.state = verbs.QPInit
	return nil
}

// PostSend posts the requests as one chained list with a single
// ibv_post_send, all or none: every request is checked in Go first (opcode,
// each local segment against its region, segment count and total length
// against the queue pair's limits, room in the send queue), and nothing is
// posted when one fails.
//
// The NIC may still refuse a request that passed these checks (bad_wr).
// When it refuses the first, nothing was posted and PostSend returns the
// error. When it refuses a later one, the requests before it are on the
// send queue and cannot be taken back: PostSend then moves the queue pair
// to ERR, so those complete (most with StatusFlushed) like any outstanding
// request of a failed queue pair, and returns an error wrapping
// verbs.ErrQPError that says how many were posted.
func (q *queuePair) PostSend(wrs ...verbs.SendRequest) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.postErrorLocked(true); err != nil {
		return err
	}
	if len(wrs) == 0 {
		return nil
	}
	maxMessage := q.d.attrs.MaxMessageBytes
	q.sendWRs, q.sges = q.sendWRs[:0], q.sges[:0]
	for i := range wrs {
		w := &wrs[i]
		fail := func(err error) error { return q.errorf("%w", softrc.RequestError("PostSend", i, w.ID, err)) }
		if _, err := softrc.CheckOpcode(w.Op); err != nil {
			return fail(err)
		}
		segs := segments(w.Local, w.Segments)
		total, err := checkLimits(segs, q.maxSendSGE, maxMessage)
		if err != nil {
			return fail(err)
		}
		off := len(q.sges)
		for _, s := range segs {
			if err := q.appendSGE(s, w.Op == verbs.OpRead); err != nil {
				return fail(err)
			}
		}
		b := C.trpc_send{
			remote_addr: C.uint64_t(w.Remote.Addr),
			sge_off:     C.uint32_t(off),
			num_sge:     C.uint32_t(len(q.sges) - off),
			rkey:        C.uint32_t(w.Remote.Key),
			imm:         C.uint32_t(w.Imm),
		}
		switch w.Op {
		case verbs.OpSend:
			b.opcode = C.IBV_WR_SEND
			if w.HasImm {
				b.opcode = C.IBV_WR_SEND_WITH_IMM
			}
		case verbs.OpWrite:
			b.opcode = C.IBV_WR_RDMA_WRITE
		case verbs.OpWriteImm:
			b.opcode = C.IBV_WR_RDMA_WRITE_WITH_IMM
		case verbs.OpRead:
			b.opcode = C.IBV_WR_RDMA_READ
		}
		if !w.Unsignaled {
			b.flags |= C.IBV_SEND_SIGNALED
		}
		if w.Fence {
			b.flags |= C.IBV_SEND_FENCE
		}
		// The NIC copies small payloads out of the work request itself,
		// saving a DMA read; a Read's local buffers are destinations and
		// cannot be inline.
		if w.Op != verbs.OpRead && total > 0 && total <= int64(q.maxInline) {
			b.flags |= C.IBV_SEND_INLINE
		}
		q.sendWRs = append(q.sendWRs, b)
	}
	if room := q.send.room(); len(wrs) > room {
		return q.errorf("PostSend of %w", softrc.QueueFull(len(wrs), q.send.outstanding(), q.send.outstanding()+room))
	}
	for i := range wrs {
		w := &wrs[i]
		idx, _ := q.send.take(slot{id: w.ID, op: w.Op, length: slotLength(q.sendWRs[i], q.sges), unsignaled: w.Unsignaled})
		q.sendWRs[i].wr_id = C.uint64_t(encodeWRID(wrSend, idx))
	}
	var posted C.int
	rc := C.trpc_post_send(q.qp, &q.sendWRs[0], C.int(len(q.sendWRs)), sgePtr(q.sges), &posted)
	if rc == 0 {
		return nil
	}
	return q.postFailedLocked("send", len(wrs), int(posted), rc, func(k int) { q.send.unwindLast(k) })
}

// postFailedLocked handles a post the NIC refused at request posted of n.
func (q *queuePair) postFailedLocked(kind string, n, posted int, rc C.int, unwind func(int)) error {
	posted = min(max(posted, 0), n)
	unwind(n - posted)
	if posted == 0 {
		return fmt.Errorf("ibv: post %s request 0: %w", kind, postError(rc))
	}
	q.fail(fmt.Errorf("the device refused %s request %d (%v)", kind, posted, postError(rc)))
	if rc2 := C.trpc_qp_to_err(q.qp); rc2 != 0 {
		return fmt.Errorf("ibv: post %s: the device refused request %d (%v) after accepting the %d before it, and moving QP %#x to ERR failed (%v): %w",
			kind, posted, postError(rc), posted, q.qpn, errnoError(rc2), verbs.ErrQPError)
	}
	return fmt.Errorf("ibv: post %s: the device refused request %d (%v) after accepting the %d before it; the queue pair is now in ERR and those complete with StatusFlushed or better: %w",
		kind, posted, postError(rc), posted, verbs.ErrQPError)
}

// slotLength is the total length of a built send request.
func slotLength(b C.trpc_send, sges []C.struct_ibv_sge) int {
	n := 0
	for _, s := range sges[b.sge_off : b.sge_off+b.num_sge] {
		n += int(s.length)
	}
	return n
}

func sgePtr(sges []C.struct_ibv_sge) *C.struct_ibv_sge {
	if len(sges) == 0 {
		return nil
	}
	return &sges[0]
}

// PostRecv posts receive buffers, all or none as PostSend; before Connect
// it first moves the queue pair to INIT, so receives may be posted before
// the peer's Send can arrive.
func (q *queuePair) PostRecv(wrs ...verbs.RecvRequest) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.postErrorLocked(false); err != nil {
		return err
	}
	if len(wrs) == 0 {
		return nil
	}
	maxMessage := q.d.attrs.MaxMessageBytes
	q.recvWRs, q.sges = q.recvWRs[:0], q.sges[:0]
	lengths := make([]int, 0, len(wrs))
	for i := range wrs {
		w := &wrs[i]
		fail := func(err error) error { return q.errorf("%w", softrc.RequestError("PostRecv", i, w.ID, err)) }
		segs := segments(w.Local, w.Segments)
		total, err := checkLimits(segs, q.maxRecvSGE, maxMessage)
		if err != nil {
			return fail(err)
		}
		off := len(q.sges)
		for _, s := range segs {
			if err := q.appendSGE(s, true); err != nil {
				return fail(err)
			}
		}
		q.recvWRs = append(q.recvWRs, C.trpc_recv{sge_off: C.uint32_t(off), num_sge: C.uint32_t(len(q.sges) - off)})
		lengths = append(lengths, int(total))
	}
	if room := q.recv.room(); len(wrs) > room {
		return q.errorf("PostRecv of %w", softrc.QueueFull(len(wrs), q.recv.outstanding(), q.recv.outstanding()+room))
	}
	if err := q.toInitLocked(); err != nil {
		return err
	}
	taken := make([]uint32, len(wrs))
	for i := range wrs {
		idx, _ := q.recv.take(slot{id: wrs[i].ID, op: verbs.OpRecv, length: lengths[i]})
		taken[i] = idx
		q.recvWRs[i].wr_id = C.uint64_t(encodeWRID(wrRecv, idx))
	}
	var posted C.int
	rc := C.trpc_post_recv(q.qp, &q.recvWRs[0], C.int(len(q.recvWRs)), sgePtr(q.sges), &posted)
	if rc == 0 {
		return nil
	}
	return q.postFailedLocked("receive", len(wrs), int(posted), rc, func(k int) {
		for _, idx := range taken[len(taken)-k:] {
			q.recv.put(idx)
		}
	})
}

// appendSGE checks one local segment in Go, so that a bad one fails the
// post instead of reaching the NIC, and appends its scatter/gather element
// (none for an empty segment).
func (q *queuePair) appendSGE(l verbs.Local, written bool) error {
	if l.Region == nil {
		if l.Length == 0 {
			return nil
		}
		return fmt.Errorf("%w: %d local bytes without a region", verbs.ErrInvalidMemory, l.Length)
	}
	r, ok := l.Region.(*memoryRegion)
	if !ok || r == nil || r.d != q.d {
		return fmt.Errorf("%w: local region belongs to another protection domain", verbs.ErrInvalidMemory)
	}
	if err := checkLocal(r.view(), l.Offset, l.Length, written); err != nil {
		return err
	}
	if l.Length == 0 {
		return nil
	}
	q.sges = append(q.sges, C.struct_ibv_sge{
		addr:   C.uint64_t(r.addr + uint64(l.Offset)),
		length: C.uint32_t(l.Length),
		lkey:   C.uint32_t(r.lkey),
	})
	return nil
}

func postError(rc C.int) error {
	if errnoError(rc) == syscall.ENOMEM {
		return fmt.Errorf("%w: the device refused more work requests", verbs.ErrQueueFull)
	}
	return errnoError(rc)
}

// complete handles a completion of this queue pair and frees its slot (and,
// on the send queue, those of the unsignaled requests before it). A
// provider-internal request's completion finishes its internalOp and is
// not for the caller (forCaller false). last reports that the queue pair is
// closed and this was its last outstanding request, so it can be
// destroyed now.
func (q *queuePair) complete(wc *C.trpc_wc) (c verbs.Completion, forCaller, last bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	id := uint64(wc.wr_id)
	status := wcStatus(wc.status)
	var (
		sl slot
		ok bool
	)
	if kind, idx, valid := decodeWRID(id); valid {
		if kind == wrRecv {
			sl, ok = q.recv.put(idx)
		} else {
			sl, _, _, ok = q.send.complete(idx)
		}
	}
	if status != verbs.StatusSuccess {
		// An RC queue pair goes to ERR on any failed completion.
		q.fail(fmt.Errorf("request %#x completed with %v: %v", id, status, wcError(wc)))
	}
	last = q.closed && q.qp != nil && q.send.outstanding() == 0 && q.recv.outstanding() == 0
	if ok && sl.wait != nil {
		var err error
		if status != verbs.StatusSuccess {
			err = wcError(wc)
		}
		sl.wait.finish(status, err)
		return verbs.Completion{}, false, last
	}
	c = verbs.Completion{ID: sl.id, Op: sl.op, Status: status, Len: sl.length}
	if !ok {
		c.ID, c.Status = id, verbs.StatusRemoteOperation
		c.Err = fmt.Errorf("ibv: completion with unknown wr_id %#x", id)
	}
	if c.Status == verbs.StatusSuccess {
		switch wc.opcode {
		case C.IBV_WC_RECV:
			c.Op, c.Len = verbs.OpRecv, int(wc.byte_len)
		case C.IBV_WC_RECV_RDMA_WITH_IMM:
			c.Op, c.Len = verbs.OpRecvImm, int(wc.byte_len)
		}
		if wc.has_imm != 0 {
			c.Imm, c.HasImm = uint32(wc.imm), true
		}
	} else {
		c.Len = 0
		if c.Err == nil {
			c.Err = wcError(wc)
		}
	}
	return c, true, last
}

// State asks the device; after Close, or once a request failed, the queue
// pair is in QPError.
func (q *queuePair) State() verbs.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed || q.qp == nil || q.failed {
		return verbs.QPError
	}
	switch s := C.trpc_qp_state(q.qp); s {
	case C.IBV_QPS_RESET:
		return verbs.QPReset
	case C.IBV_QPS_INIT:
		return verbs.QPInit
	case C.IBV_QPS_RTR:
		return verbs.QPReadyToReceive
	case C.IBV_QPS_RTS, C.IBV_QPS_SQD:
		return verbs.QPReadyToSend
	case C.IBV_QPS_SQE, C.IBV_QPS_ERR:
		return verbs.QPError
	}
	return q.state
}

// Close moves the queue pair to ERR, which makes the device flush every
// outstanding request with StatusFlushed. Those completions still have to
// be polled: the queue pair is destroyed when the last of them has been
// (libibverbs drops a destroyed queue pair's completions from its queues),
// at once when nothing is outstanding or a completion queue is closed, and
// at the latest by the domain's Close. Destroying it returns its
// completion queue reservation.
//
// An unsignaled request that succeeded has no completion of its own; it
// leaves the send queue when a later request completes. So that a closed
// queue pair whose last requests were unsignaled still drains, Close posts
// one more signaled request (an empty Send, which a queue pair in ERR
// flushes at once) behind them; its completion is internal. When the send
// queue has no room for it, such a queue pair is destroyed by the domain's
// Close.
func (q *queuePair) Close() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return nil
	}
	q.closed = true
	var err error
	if q.qp != nil {
		if rc := C.trpc_qp_to_err(q.qp); rc != 0 {
			err = fmt.Errorf("ibv: modify QP %#x to ERR: %v", q.qpn, errnoError(rc))
		}
		q.fail(fmt.Errorf("queue pair %d closed", q.qpn))
		if q.send.outstanding() > 0 {
			q.postDrainMarkerLocked()
		}
	}
	now := q.send.outstanding() == 0 && q.recv.outstanding() == 0
	q.mu.Unlock()
	if now || q.sendCQ.isClosed() || q.recvCQ.isClosed() {
		err = errors.Join(err, q.destroy())
	}
	return err
}

// destroy calls ibv_destroy_qp, then finishes the release of completion
// queues closed while this queue pair used them. It is idempotent.
func (q *queuePair) destroy() error {
	q.mu.Lock()
	if q.qp == nil {
		q.mu.Unlock()
		return nil
	}
	q.closed = true
	if rc := C.ibv_destroy_qp(q.qp); rc != 0 {
		q.mu.Unlock()
		return fmt.Errorf("ibv: destroy QP %#x: %v", q.qpn, errnoError(rc))
	}
	q.qp = nil
	// No completion comes for what is still outstanding: wake the Grants
	// and Revokes that wait for one.
	q.send.finishWaiters(verbs.StatusFlushed, fmt.Errorf("ibv: queue pair %#x destroyed: %w", q.qpn, verbs.ErrClosed))
	unreserve := !q.unreserved
	q.unreserved = true
	q.mu.Unlock()
	if unreserve {
		q.sendCQ.unreserve(q.maxSend)
		q.recvCQ.unreserve(q.maxRecv)
	}
	q.d.byQPN.CompareAndDelete(q.qpn, q)
	untrack(q.d, q.d.qps, q)
	var errs []error
	for _, cq := range []*completionQueue{q.sendCQ, q.recvCQ} {
		if cq.isClosed() {
			errs = append(errs, cq.release())
		}
	}
	return errors.Join(errs...)
}

// postDrainMarkerLocked posts a signaled, empty, internal Send on a queue
// pair in ERR (see Close). The caller holds q.mu.
func (q *queuePair) postDrainMarkerLocked() {
	idx, ok := q.send.take(slot{wait: newInternalOp()})
	if !ok {
		return
	}
	wr := C.trpc_send{
		wr_id:  C.uint64_t(encodeWRID(wrInternal, idx)),
		opcode: C.IBV_WR_SEND,
		flags:  C.IBV_SEND_SIGNALED,
	}
	var posted C.int
	if rc := C.trpc_post_send(q.qp, &wr, 1, nil, &posted); rc != 0 {
		q.send.unwindLast(1)
	}
}
