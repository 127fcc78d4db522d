package shm

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// runSender executes the send queue in posting order. One-sided requests
// are copies between our regions and the peer's mapped regions; a Send or
// WriteImm waits for the peer's ack before the next request starts, so the
// data of every earlier Write is in place before the peer sees it, and no
// later request runs after one that failed.
func (qp *queuePair) runSender() {
	defer close(qp.workerDone)
	for {
		wr, ok := qp.nextSend()
		if !ok {
			return
		}
		c, _ := qp.execute(wr, true)
		qp.Mu.Lock()
		qp.executing = false
		qp.Sendq[0] = nil
		qp.Sendq = qp.Sendq[1:]
		qp.finishSendLocked(c, wr.Unsignaled)
		qp.Mu.Unlock()
	}
}

// startInline runs the part of wr that needs no answer from the peer: all
// of a Write or Read; the copy of a WriteImm or of a Send that fits the
// staging buffer, returning the doorbell to ring. It reports false when
// the remote region is not mapped yet.
func (qp *queuePair) startInline(wr *softrc.SendWR) (c verbs.Completion, ran bool, doorbell *message) {
	if qp.peerDown() {
		return verbs.Completion{ID: wr.ID, Op: wr.Op, Status: verbs.StatusTransport, Err: errPeerDown}, true, nil
	}
	switch wr.Op {
	case verbs.OpWrite, verbs.OpRead:
		c, ran = qp.execute(wr, false)
		return c, ran, nil
	case verbs.OpWriteImm:
		c = verbs.Completion{ID: wr.ID, Op: wr.Op}
		st, err, ran := qp.write(wr, false)
		if !ran {
			return c, false, nil
		}
		if st != verbs.StatusSuccess {
			c.Status, c.Err = st, err
			return c, true, nil
		}
		c.Len, c.Imm, c.HasImm = wr.N, wr.Imm, true
		return c, true, &message{typ: msgWriteImm, imm: wr.Imm, key: wr.Remote.Key, length: uint64(wr.N)}
	case verbs.OpSend:
		c = verbs.Completion{ID: wr.ID, Op: wr.Op}
		if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
			c.Status, c.Err = st, err
			return c, true, nil
		}
		n := wr.Vec.Gather(qp.staging, 0)
		wr.Vec.Release()
		m := &message{typ: msgSend, flags: flagLast, length: uint64(n), total: uint64(n)}
		c.Len = n
		if wr.HasImm {
			m.flags |= flagHasImm
			m.imm = wr.Imm
			c.Imm, c.HasImm = wr.Imm, true
		}
		return c, true, m
	}
	return c, false, nil
}

// nextSend waits for the next request. Once the queue pair is in the
// error state it flushes the send queue and reports false.
func (qp *queuePair) nextSend() (*softrc.SendWR, bool) {
	for {
		qp.Mu.Lock()
		if qp.StateLocked() == verbs.QPError {
			qp.FlushSendsLocked()
			qp.Mu.Unlock()
			return nil, false
		}
		if len(qp.Sendq) > 0 && !qp.executing {
			qp.executing = true
			wr := qp.Sendq[0]
			qp.Mu.Unlock()
			return wr, true
		}
		qp.Mu.Unlock()
		select {
		case <-qp.sqSignal:
		case <-qp.Errored:
		}
	}
}

// execute runs one request and returns its completion. With fetch false
// (inline execution in PostSend) it only runs Writes and Reads whose remote
// region is mapped already, and reports false for anything else.
func (qp *queuePair) execute(wr *softrc.SendWR, fetch bool) (verbs.Completion, bool) {
	c := verbs.Completion{ID: wr.ID, Op: wr.Op}
	if qp.peerDown() {
		c.Status, c.Err = verbs.StatusTransport, errPeerDown
		return c, true
	}
	var st verbs.Status
	var err error
	done := true
	switch wr.Op {
	case verbs.OpWrite, verbs.OpWriteImm:
		st, err, done = qp.write(wr, fetch)
		if done && st == verbs.StatusSuccess && wr.Op == verbs.OpWriteImm {
			st, err = qp.request(message{typ: msgWriteImm, imm: wr.Imm, key: wr.Remote.Key, length: uint64(wr.N)})
		}
	case verbs.OpRead:
		st, err, done = qp.read(wr, fetch)
	case verbs.OpSend:
		st, err = qp.sendMessage(wr)
	}
	if !done {
		return c, false
	}
	c.Status, c.Err = st, err
	if st == verbs.StatusSuccess {
		c.Len = wr.N
		if wr.Op == verbs.OpWriteImm || (wr.Op == verbs.OpSend && wr.HasImm) {
			c.Imm, c.HasImm = wr.Imm, true
		}
	}
	return c, true
}

// write copies the local buffer straight into the peer's mapped region:
// the one copy of a Write.
func (qp *queuePair) write(wr *softrc.SendWR, fetch bool) (verbs.Status, error, bool) {
	if wr.N == 0 {
		return verbs.StatusSuccess, nil, true // a zero-length Write touches no memory and checks no key
	}
	if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
		return st, err, true
	}
	defer wr.Vec.Release()
	return qp.withRemote(wr.Remote.Key, fetch, func(rr *remoteRegion) error {
		dst, err := rr.span(wr.Remote.Addr, wr.N, verbs.AccessRemoteWrite)
		if err == nil {
			wr.Vec.GatherParallel(dst, qp.pd.opts.copyWorkers)
		}
		return err
	})
}

// read copies from the peer's mapped region into the local buffer.
func (qp *queuePair) read(wr *softrc.SendWR, fetch bool) (verbs.Status, error, bool) {
	if wr.N == 0 {
		return verbs.StatusSuccess, nil, true
	}
	if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
		return st, err, true
	}
	defer wr.Vec.Release()
	return qp.withRemote(wr.Remote.Key, fetch, func(rr *remoteRegion) error {
		src, err := rr.span(wr.Remote.Addr, wr.N, verbs.AccessRemoteRead)
		if err == nil {
			wr.Vec.ScatterParallel(src, qp.pd.opts.copyWorkers)
		}
		return err
	})
}

// sendMessage moves a Send through our staging buffer, in chunks of its
// size: we copy each chunk in, the peer copies it out into its Recv buffer
// and acks.
func (qp *queuePair) sendMessage(wr *softrc.SendWR) (verbs.Status, error) {
	if st, err := wr.Vec.Hold(); st != verbs.StatusSuccess {
		return st, err
	}
	defer wr.Vec.Release()
	total := wr.N
	for off := 0; ; {
		n := wr.Vec.Gather(qp.staging[:min(len(qp.staging), total-off)], off)
		m := message{typ: msgSend, offset: uint64(off), length: uint64(n), total: uint64(total)}
		if wr.HasImm {
			m.flags |= flagHasImm
			m.imm = wr.Imm
		}
		off += n
		if off == total {
			m.flags |= flagLast
		}
		if st, err := qp.request(m); st != verbs.StatusSuccess || off == total {
			return st, err
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
