package shm

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// runSender executes the send queue in posting order. One-sided requests
// are copies between our regions and the peer's mapped regions; a Send or
// WriteImm waits on Inflight for the peer's ack (see ringLocked) before the
// next request starts, so the data of every earlier Write is in place
// before the peer sees it, and no later request runs after one that
// failed.
func (qp *queuePair) runSender() {
	for {
		wr, ok := qp.nextSend()
		if !ok {
			return
		}
		st, err, _, doorbell, ring := qp.start(wr, true)
		qp.Mu.Lock()
		qp.Sendq = softrc.TakeFront(qp.Sendq, 1)
		if ring && qp.StateLocked() == verbs.QPError {
			st, err = qp.FailureLocked()
			ring = false
		}
		qp.ringLocked(wr, st, err, doorbell, ring)
		qp.Mu.Unlock()
	}
}

// start runs the part of wr that needs no answer from the peer: all of a
// Write or Read; the copy of a WriteImm, or of a Send through the staging
// buffer, each chunk but the last taken by the peer before the next (only
// the sender, with fetch set, runs Sends larger than the buffer). It
// returns the doorbell to ring, the WriteImm's or the Send's last chunk,
// or, with fetch false (PostSend running wr itself), ran false when the
// remote region is not mapped yet: asking the peer for it is the sender's
// job.
func (qp *queuePair) start(wr *softrc.SendWR, fetch bool) (st verbs.Status, err error, ran bool, doorbell message, ring bool) {
	if qp.peerDown() {
		return verbs.StatusTransport, errPeerDown, true, doorbell, false
	}
	switch wr.Op {
	case verbs.OpWrite, verbs.OpWriteImm:
		st, err, ran = qp.write(wr, fetch)
		if ran && st == verbs.StatusSuccess && wr.Op == verbs.OpWriteImm {
			doorbell, ring = message{typ: msgWriteImm, imm: wr.Imm, key: wr.Remote.Key, length: uint64(wr.N)}, true
		}
		return st, err, ran, doorbell, ring
	case verbs.OpRead:
		st, err, ran = qp.read(wr, fetch)
		return st, err, ran, doorbell, false
	case verbs.OpSend:
		st, err, doorbell, ring = qp.sendMessage(wr)
		return st, err, true, doorbell, ring
	}
	return 0, nil, false, doorbell, false
}

// nextSend waits for the next request. Once the queue pair is in the
// error state it flushes the send queue and reports false.
func (qp *queuePair) nextSend() (*softrc.SendWR, bool) {
	for {
		qp.Mu.Lock()
		if qp.StateLocked() == verbs.QPError {
			// Requests run outside this goroutine (PostSend's, the Reads
			// run early, runQueuedLocked's) complete before the flush of
			// the ones posted after them.
			qp.Mu.Unlock()
			qp.inline.Wait()
			qp.Mu.Lock()
			qp.FlushSendsLocked()
			clear(qp.early)
			qp.Mu.Unlock()
			return nil, false
		}
		for len(qp.Sendq) > 0 && !qp.executing && !qp.ackHeld && qp.StateLocked() != verbs.QPError && qp.completeEarlyLocked(qp.Sendq[0]) {
		}
		if len(qp.Sendq) > 0 && !qp.executing && !qp.ackHeld && qp.StateLocked() != verbs.QPError {
			if _, early := qp.early[qp.Sendq[0]]; !early { // else its poster goes on when its copy ends
				qp.executing, qp.runningOp = true, qp.Sendq[0].Op
				wr := qp.Sendq[0]
				qp.Mu.Unlock()
				return wr, true
			}
		}
		qp.Mu.Unlock()
		select {
		case <-qp.sqSignal:
		case <-qp.Errored:
		}
	}
}

// write copies the local buffer straight into the peer's mapped region
// (or, for memory without a memfd, by cross-memory attach): the one copy
// of a Write.
func (qp *queuePair) write(wr *softrc.SendWR, fetch bool) (verbs.Status, error, bool) {
	if wr.N == 0 {
		return verbs.StatusSuccess, nil, true // a zero-length Write touches no memory and checks no key
	}
	if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
		return st, err, true
	}
	defer wr.Vec.Release()
	return qp.withRemote(wr.Remote.Key, fetch, func(rr *remoteRegion) error {
		if rr.cma {
			return qp.cmaCopy(rr, wr, verbs.AccessRemoteWrite)
		}
		dst, err := rr.span(wr.Remote.Addr, wr.N, verbs.AccessRemoteWrite)
		if err == nil {
			wr.Vec.GatherParallel(dst, qp.pd.opts.copyWorkers)
		}
		return err
	})
}

// read copies from the peer's mapped region (or, for memory without a
// memfd, by cross-memory attach) into the local buffer.
func (qp *queuePair) read(wr *softrc.SendWR, fetch bool) (verbs.Status, error, bool) {
	if wr.N == 0 {
		return verbs.StatusSuccess, nil, true
	}
	if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
		return st, err, true
	}
	defer wr.Vec.Release()
	return qp.withRemote(wr.Remote.Key, fetch, func(rr *remoteRegion) error {
		if rr.cma {
			return qp.cmaCopy(rr, wr, verbs.AccessRemoteRead)
		}
		src, err := rr.span(wr.Remote.Addr, wr.N, verbs.AccessRemoteRead)
		if err == nil {
			wr.Vec.ScatterParallel(src, qp.pd.opts.copyWorkers)
		}
		return err
	})
}

// sendMessage moves a Send through our staging buffer, in chunks of its
// size: we copy each chunk in, the peer copies it out into its Recv buffer
// and acks. It returns the last chunk's message, for the caller to ring.
func (qp *queuePair) sendMessage(wr *softrc.SendWR) (verbs.Status, error, message, bool) {
	if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
		return st, err, message{}, false
	}
	defer wr.Vec.Release()
	for off := 0; ; {
		n := wr.Vec.Gather(qp.staging[:min(len(qp.staging), wr.N-off)], off)
		m := message{typ: msgSend, offset: uint64(off), length: uint64(n), total: uint64(wr.N)}
		if wr.HasImm {
			m.flags |= flagHasImm
			m.imm = wr.Imm
		}
		if off += n; off == wr.N {
			m.flags |= flagLast
			return verbs.StatusSuccess, nil, m, true
		}
		if st, err := qp.request(m); st != verbs.StatusSuccess {
			return st, err, message{}, false
		}
	}
}

// request sends a message that the peer acks and waits for the ack.
func (qp *queuePair) request(m message) (verbs.Status, error) {
	qp.nextSeq++
	m.seq = qp.nextSeq
	if err := qp.send(&m, -1); err != nil {
		return qp.lost(err)
	}
	for {
		var a message
		select {
		case a = <-qp.ackCh:
		case <-qp.Errored:
			select {
			case a = <-qp.ackCh: // the ack raced the failure; it wins
			default:
				return qp.Failure()
			}
		}
		if a.seq != m.seq {
			continue // the ack of a request abandoned earlier
		}
		return softrc.Refused(a.status)
	}
}

// lost fails the queue pair after a write to the peer failed.
func (qp *queuePair) lost(err error) (verbs.Status, error) {
	qp.fail(verbs.StatusTransport, fmt.Errorf("shm: connection to the peer lost: %w", err))
	return qp.Failure()
}
