package shm

import (
	"errors"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
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
		qp.mu.Lock()
		qp.executing = false
		qp.sq[0] = nil
		qp.sq = qp.sq[1:]
		qp.finishSendLocked(c, wr.Unsignaled)
		qp.mu.Unlock()
	}
}

// startInline runs the part of wr that needs no answer from the peer: all
// of a Write or Read; the copy of a WriteImm or of a Send that fits the
// staging buffer, returning the doorbell to ring. It reports false when
// the remote region is not mapped yet.
func (qp *queuePair) startInline(wr *sendWR) (c verbs.Completion, ran bool, doorbell *message) {
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
		c.Len, c.Imm, c.HasImm = wr.n, wr.Imm, true
		return c, true, &message{typ: msgWriteImm, imm: wr.Imm, key: wr.Remote.Key, length: uint64(wr.n)}
	case verbs.OpSend:
		c = verbs.Completion{ID: wr.ID, Op: wr.Op}
		if st, err := holdLocal(wr.vec); st != verbs.StatusSuccess {
			c.Status, c.Err = st, err
			return c, true, nil
		}
		n := wr.vec.Gather(qp.staging, 0)
		wr.vec.Release()
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
func (qp *queuePair) nextSend() (*sendWR, bool) {
	for {
		qp.mu.Lock()
		if qp.state == verbs.QPError {
			for _, wr := range qp.sq {
				qp.completeSend(verbs.Completion{ID: wr.ID, Op: wr.Op, Status: verbs.StatusFlushed, Err: qp.inflightErr}, wr.Unsignaled)
			}
			qp.sq = nil
			qp.mu.Unlock()
			return nil, false
		}
		if len(qp.sq) > 0 && !qp.executing {
			qp.executing = true
			wr := qp.sq[0]
			qp.mu.Unlock()
			return wr, true
		}
		qp.mu.Unlock()
		select {
		case <-qp.sqSignal:
		case <-qp.failed:
		}
	}
}

// execute runs one request and returns its completion. With fetch false
// (inline execution in PostSend) it only runs Writes and Reads whose remote
// region is mapped already, and reports false for anything else.
func (qp *queuePair) execute(wr *sendWR, fetch bool) (verbs.Completion, bool) {
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
			st, err = qp.request(message{typ: msgWriteImm, imm: wr.Imm, key: wr.Remote.Key, length: uint64(wr.n)})
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
		c.Len = wr.n
		if wr.Op == verbs.OpWriteImm || (wr.Op == verbs.OpSend && wr.HasImm) {
			c.Imm, c.HasImm = wr.Imm, true
		}
	}
	return c, true
}

// write copies the local buffer straight into the peer's mapped region:
// the one copy of a Write.
func (qp *queuePair) write(wr *sendWR, fetch bool) (verbs.Status, error, bool) {
	if wr.n == 0 {
		return verbs.StatusSuccess, nil, true // a zero-length Write touches no memory and checks no key
	}
	if st, err := holdLocal(wr.vec); st != verbs.StatusSuccess {
		return st, err, true
	}
	defer wr.vec.Release()
	return qp.withRemote(wr.Remote.Key, fetch, func(rr *remoteRegion) error {
		dst, err := rr.span(wr.Remote.Addr, wr.n, verbs.AccessRemoteWrite)
		if err == nil {
			wr.vec.GatherParallel(dst, qp.pd.opts.copyWorkers)
		}
		return err
	})
}

// read copies from the peer's mapped region into the local buffer.
func (qp *queuePair) read(wr *sendWR, fetch bool) (verbs.Status, error, bool) {
	if wr.n == 0 {
		return verbs.StatusSuccess, nil, true
	}
	if st, err := holdLocal(wr.vec); st != verbs.StatusSuccess {
		return st, err, true
	}
	defer wr.vec.Release()
	return qp.withRemote(wr.Remote.Key, fetch, func(rr *remoteRegion) error {
		src, err := rr.span(wr.Remote.Addr, wr.n, verbs.AccessRemoteRead)
		if err == nil {
			wr.vec.ScatterParallel(src, qp.pd.opts.copyWorkers)
		}
		return err
	})
}

// sendMessage moves a Send through our staging buffer, in chunks of its
// size: we copy each chunk in, the peer copies it out into its Recv buffer
// and acks.
func (qp *queuePair) sendMessage(wr *sendWR) (verbs.Status, error) {
	if st, err := holdLocal(wr.vec); st != verbs.StatusSuccess {
		return st, err
	}
	defer wr.vec.Release()
	total := wr.n
	for off := 0; ; {
		n := wr.vec.Gather(qp.staging[:min(len(qp.staging), total-off)], off)
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
		case <-qp.failed:
			select {
			case a = <-qp.ackCh: // the ack raced the failure; it wins
			default:
				return qp.inflight()
			}
		}
		if a.seq != m.seq {
			continue // the ack of a request abandoned earlier
		}
		return ackStatus(a.status)
	}
}

// ackStatus turns the status of a peer's ack into ours, with an
// explanation; an unexpected status from the peer is a remote operation
// error.
func ackStatus(s verbs.Status) (verbs.Status, error) {
	switch s {
	case verbs.StatusSuccess:
		return s, nil
	case verbs.StatusReceiverNotReady:
		return s, errors.New("shm: no Recv was posted at the peer within its RNR timeout")
	case verbs.StatusRemoteInvalidRequest:
		return s, errors.New("shm: the Send is larger than the peer's Recv buffer")
	case verbs.StatusRemoteOperation:
		return s, errors.New("shm: the peer's Recv buffer is unusable (bad region, rights or bounds)")
	case verbs.StatusTransport:
		return s, errors.New("shm: the peer's queue pair is in the error state")
	}
	return verbs.StatusRemoteOperation, fmt.Errorf("shm: the peer answered with status %v", s)
}

// inflight is the status of the request executing when the queue pair
// failed.
func (qp *queuePair) inflight() (verbs.Status, error) {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.inflightStatus, qp.inflightErr
}

// lost fails the queue pair after a write to the peer failed.
func (qp *queuePair) lost(err error) (verbs.Status, error) {
	qp.fail(verbs.StatusTransport, fmt.Errorf("shm: connection to the peer lost: %w", err))
	return qp.inflight()
}
