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
)

// recvBit marks the wr_id of a receive; the low 32 bits are a slot index.
const recvBit = 1 << 63

// queuePair is an RC ibv_qp.
type queuePair struct {
	d         *domain
	sendCQ    *completionQueue
	recvCQ    *completionQueue
	qpn       uint32
	psn       uint32
	info      []byte
	maxInline int

	mu        sync.Mutex       // guards the fields below and serializes posting
	qp        *C.struct_ibv_qp // nil once destroyed
	state     verbs.QPState    // the last state this side moved the QP to
	closed    bool
	failed    bool // a work request completed in error: the QP is in ERR
	send      slots
	recv      slots
	sendBatch [C.TRPC_BATCH]C.trpc_send
	recvBatch [C.TRPC_BATCH]C.trpc_recv
}

// NewQueuePair makes a queue pair. cfg.LocalAddress and cfg.Role are
// ignored: an ibv queue pair exchanges no socket connection of its own.
func (d *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, verbs.ErrClosed
	}
	sendCQ, ok1 := cfg.SendCQ.(*completionQueue)
	recvCQ, ok2 := cfg.RecvCQ.(*completionQueue)
	if !ok1 || !ok2 || sendCQ.d != d || recvCQ.d != d {
		return nil, fmt.Errorf("ibv: new queue pair: completion queues must come from this ibv domain")
	}
	maxSend, maxRecv := cfg.MaxSend, cfg.MaxRecv
	if maxSend == 0 {
		maxSend = 1024
	}
	if maxRecv == 0 {
		maxRecv = 1024
	}
	if maxSend < 0 || maxRecv < 0 || maxSend > d.maxQPWR || maxRecv > d.maxQPWR {
		return nil, fmt.Errorf("ibv: new queue pair: MaxSend %d and MaxRecv %d must be within 1..%d on %s",
			cfg.MaxSend, cfg.MaxRecv, d.maxQPWR, d.name)
	}
	inline := cfg.MaxInline
	if inline <= 0 {
		inline = d.opts.maxInline
	}
	psn, secret, err := randomPSNAndSecret()
	if err != nil {
		return nil, err
	}

	// Hold the queues so that neither is destroyed under ibv_create_qp.
	// Only this method holds two queue locks, under d.mu.
	sendCQ.mu.Lock()
	if recvCQ != sendCQ {
		recvCQ.mu.Lock()
	}
	cqsOpen := sendCQ.cq != nil && recvCQ.cq != nil && !sendCQ.closed && !recvCQ.closed
	var (
		qp    *C.struct_ibv_qp
		caps  C.trpc_qp_caps
		cause error
	)
	if cqsOpen {
		qp, cause = C.trpc_create_qp(d.pd, sendCQ.cq, recvCQ.cq, C.uint32_t(maxSend), C.uint32_t(maxRecv), C.uint32_t(inline), &caps)
		if qp == nil && inline > 0 {
			// Some devices support no inline data at all.
			qp, cause = C.trpc_create_qp(d.pd, sendCQ.cq, recvCQ.cq, C.uint32_t(maxSend), C.uint32_t(maxRecv), 0, &caps)
		}
	}
	if recvCQ != sendCQ {
		recvCQ.mu.Unlock()
	}
	sendCQ.mu.Unlock()
	if !cqsOpen {
		return nil, fmt.Errorf("ibv: new queue pair: completion queue: %w", verbs.ErrClosed)
	}
	if qp == nil {
		return nil, fmt.Errorf("ibv: create RC queue pair (send %d, recv %d, inline %d): %v", maxSend, maxRecv, inline, cause)
	}
	q := &queuePair{
		d:         d,
		sendCQ:    sendCQ,
		recvCQ:    recvCQ,
		qpn:       uint32(qp.qp_num),
		psn:       psn,
		maxInline: min(inline, int(caps.max_inline_data)), // devices may round up
		qp:        qp,
		state:     verbs.QPReset,
		send:      newSlots(maxSend),
		recv:      newSlots(maxRecv),
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
		return fmt.Errorf("ibv: connect: %w: peer link layer %d, local %d", verbs.ErrInvalidInfo, peer.linkLayer, d.linkLayer)
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.closed || q.qp == nil:
		return verbs.ErrClosed
	case q.failed:
		return verbs.ErrQPError
	case q.state != verbs.QPReset && q.state != verbs.QPInit:
		return fmt.Errorf("ibv: connect: queue pair is already %s", q.state)
	}
	if err := q.toInitLocked(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
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
	// Issue no more concurrent Reads than the peer serves.
	initiators := min(d.initiators, peer.responders)
	if rc := C.trpc_qp_to_rts(q.qp, C.uint32_t(q.psn), C.uint8_t(d.opts.timeout), C.uint8_t(d.opts.retryCount),
		C.uint8_t(d.opts.rnrRetry), C.uint8_t(initiators)); rc != 0 {
		return fmt.Errorf("ibv: connect: modify QP %#x to RTS: %v", q.qpn, errnoError(rc))
	}
	q.state = verbs.QPReadyToSend
	return nil
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

// PostSend posts in batches of up to TRPC_BATCH requests. Requests are
// checked in Go first; a bad one ends the call after the good ones before it
// are posted.
func (q *queuePair) PostSend(wrs ...verbs.SendRequest) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.closed || q.qp == nil:
		return verbs.ErrClosed
	case q.failed:
		return verbs.ErrQPError
	case q.state != verbs.QPReadyToSend:
		return verbs.ErrNotConnected
	}
	for start := 0; start < len(wrs); {
		n := 0
		var stop error
		for n < C.TRPC_BATCH && start+n < len(wrs) {
			w := &wrs[start+n]
			addr, lkey, err := q.local(w.Local, w.Op == verbs.OpRead)
			if err == nil && w.Op != verbs.OpSend && w.Op != verbs.OpWrite && w.Op != verbs.OpWriteImm && w.Op != verbs.OpRead {
				err = fmt.Errorf("%w: opcode %s in PostSend", verbs.ErrUnsupported, w.Op)
			}
			if err != nil {
				stop = fmt.Errorf("ibv: send request %d (ID %d): %w", start+n, w.ID, err)
				break
			}
			i, ok := q.send.take(slot{id: w.ID, op: w.Op, length: w.Local.Length})
			if !ok {
				stop = fmt.Errorf("ibv: send request %d (ID %d): %w (%d outstanding)", start+n, w.ID, verbs.ErrQueueFull, q.send.outstanding())
				break
			}
			b := &q.sendBatch[n]
			*b = C.trpc_send{
				wr_id:       C.uint64_t(i),
				addr:        C.uint64_t(addr),
				remote_addr: C.uint64_t(w.Remote.Addr),
				length:      C.uint32_t(w.Local.Length),
				lkey:        C.uint32_t(lkey),
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
			// The NIC copies small payloads out of the work request
			// itself, saving a DMA read; a Read's local buffer is a
			// destination and cannot be inline.
			if w.Op != verbs.OpRead && w.Local.Length > 0 && w.Local.Length <= q.maxInline {
				b.flags = C.IBV_SEND_INLINE
			}
			n++
		}
		if n > 0 {
			var posted C.int
			if rc := C.trpc_post_send(q.qp, &q.sendBatch[0], C.int(n), &posted); rc != 0 {
				for _, b := range q.sendBatch[posted:n] {
					q.send.put(uint32(b.wr_id))
				}
				return fmt.Errorf("ibv: post send request %d: %w", start+int(posted), postError(rc))
			}
		}
		if stop != nil {
			return stop
		}
		start += n
	}
	return nil
}

// PostRecv posts receive buffers; before Connect it first moves the queue
// pair to INIT, so receives may be posted before the peer's Send can arrive.
func (q *queuePair) PostRecv(wrs ...verbs.RecvRequest) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.closed || q.qp == nil:
		return verbs.ErrClosed
	case q.failed:
		return verbs.ErrQPError
	}
	if err := q.toInitLocked(); err != nil {
		return err
	}
	for start := 0; start < len(wrs); {
		n := 0
		var stop error
		for n < C.TRPC_BATCH && start+n < len(wrs) {
			w := &wrs[start+n]
			addr, lkey, err := q.local(w.Local, true)
			if err != nil {
				stop = fmt.Errorf("ibv: receive request %d (ID %d): %w", start+n, w.ID, err)
				break
			}
			i, ok := q.recv.take(slot{id: w.ID, op: verbs.OpRecv, length: w.Local.Length})
			if !ok {
				stop = fmt.Errorf("ibv: receive request %d (ID %d): %w (%d outstanding)", start+n, w.ID, verbs.ErrQueueFull, q.recv.outstanding())
				break
			}
			q.recvBatch[n] = C.trpc_recv{
				wr_id:  C.uint64_t(recvBit | uint64(i)),
				addr:   C.uint64_t(addr),
				length: C.uint32_t(w.Local.Length),
				lkey:   C.uint32_t(lkey),
			}
			n++
		}
		if n > 0 {
			var posted C.int
			if rc := C.trpc_post_recv(q.qp, &q.recvBatch[0], C.int(n), &posted); rc != 0 {
				for _, b := range q.recvBatch[posted:n] {
					q.recv.put(uint32(b.wr_id))
				}
				return fmt.Errorf("ibv: post receive request %d: %w", start+int(posted), postError(rc))
			}
		}
		if stop != nil {
			return stop
		}
		start += n
	}
	return nil
}

// local checks a local buffer in Go, so that a bad one fails the post
// instead of reaching the NIC, and returns its address and key.
func (q *queuePair) local(l verbs.Local, written bool) (addr uint64, lkey uint32, err error) {
	if l.Offset < 0 || l.Length < 0 || l.Length > 1<<31 {
		return 0, 0, fmt.Errorf("%w: local offset %d, length %d", verbs.ErrInvalidMemory, l.Offset, l.Length)
	}
	if l.Region == nil {
		if l.Length == 0 {
			return 0, 0, nil
		}
		return 0, 0, fmt.Errorf("%w: %d local bytes without a region", verbs.ErrInvalidMemory, l.Length)
	}
	r, ok := l.Region.(*memoryRegion)
	if !ok || r.d != q.d {
		return 0, 0, fmt.Errorf("%w: local region belongs to another protection domain", verbs.ErrInvalidMemory)
	}
	if l.Offset > r.Len() || l.Length > r.Len()-l.Offset {
		return 0, 0, fmt.Errorf("%w: local [%d, %d) outside the %d-byte region", verbs.ErrInvalidMemory, l.Offset, l.Offset+l.Length, r.Len())
	}
	if written && l.Length > 0 && r.access&verbs.AccessLocalWrite == 0 {
		return 0, 0, fmt.Errorf("%w: local region is not registered with %s", verbs.ErrInvalidMemory, verbs.AccessLocalWrite)
	}
	if !r.registered() {
		return 0, 0, fmt.Errorf("%w: local region is deregistered", verbs.ErrInvalidMemory)
	}
	return r.addr + uint64(l.Offset), r.lkey, nil
}

func postError(rc C.int) error {
	if errnoError(rc) == syscall.ENOMEM {
		return fmt.Errorf("%w: the device refused more work requests", verbs.ErrQueueFull)
	}
	return errnoError(rc)
}

// complete turns a completion of this queue pair into a verbs.Completion and
// frees its slot. last reports that the queue pair is closed and this was
// its last outstanding request, so it can be destroyed now.
func (q *queuePair) complete(wc *C.trpc_wc) (c verbs.Completion, last bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	id := uint64(wc.wr_id)
	var (
		sl slot
		ok bool
	)
	if id&recvBit != 0 {
		sl, ok = q.recv.put(uint32(id))
	} else {
		sl, ok = q.send.put(uint32(id))
	}
	c = verbs.Completion{ID: sl.id, Op: sl.op, Status: wcStatus(wc.status), Len: sl.length}
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
		// An RC queue pair goes to ERR on any failed completion.
		q.failed = true
		c.Len = 0
		if c.Err == nil {
			c.Err = wcError(wc)
		}
	}
	last = q.closed && q.qp != nil && q.send.outstanding() == 0 && q.recv.outstanding() == 0
	return c, last
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
// at the latest by the domain's Close.
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
	q.mu.Unlock()
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
