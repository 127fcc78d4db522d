package shm

import (
	"fmt"
	"math"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// inbound is a Send or WriteImm from the peer that has not completed yet:
// it waits for a Recv (under the RNR timer) or, for a Send of several
// chunks, for its next chunk.
type inbound struct {
	send  bool    // a Send; else a WriteImm
	chunk message // the latest chunk (the doorbell, for WriteImm)
	seq   uint64  // of the latest chunk, which the peer waits to have acked
	total uint64
	next  uint64 // offset of the next chunk of a Send
	recv  *softrc.RecvWR
	timer *time.Timer
}

func (in *inbound) stopTimer() {
	if in.timer != nil {
		in.timer.Stop()
		in.timer = nil
	}
}

// runReceiver reads the peer's control messages until the connection ends.
func (qp *queuePair) runReceiver() { qp.socketReceiver(newMsgBuffers()) }

// socketReceiver is runReceiver's loop. A delivery of what a message
// completed that the consumer detaches (verbs.Detacher) hands the loop to
// a new goroutine (Continue), and this one returns.
func (qp *queuePair) socketReceiver(bufs *msgBuffers) {
	resume := func() { qp.Continue(func() { qp.socketReceiver(bufs) }) }
	for {
		m, fd, err := readMessage(qp.conn, bufs)
		if err != nil {
			qp.failAndClose(fmt.Errorf("shm: connection to the peer lost: %w", err))
			break
		}
		detached, err := qp.handleFrom(m, fd, resume)
		if detached {
			return
		}
		if err != nil {
			qp.failAndClose(fmt.Errorf("shm: peer broke the protocol: %w", err))
			break
		}
	}
	qp.receiverEnded()
	close(qp.readerDone)
}

// failAndClose fails the queue pair and closes its connection: the peer
// is gone, broke the protocol or stopped answering, and nothing is to wait
// on it any more.
func (qp *queuePair) failAndClose(err error) {
	qp.fail(verbs.StatusTransport, err)
	qp.conn.Close()
}

// handleFrom is handle in a receiver, which resume continues in a new
// goroutine if the consumer detaches the delivery (softrc.QP.DeliverFrom):
// detached then reports that the caller is no longer the receiver. A
// message that broke the protocol is delivered without resume: the
// receiver that acts on the error is the caller.
func (qp *queuePair) handleFrom(m message, fd int, resume func()) (detached bool, err error) {
	if err := qp.handleMessage(m, fd); err != nil || resume == nil {
		qp.Deliver()
		return false, err
	}
	return qp.DeliverFrom(resume), nil
}

func (qp *queuePair) handleMessage(m message, fd int) error {
	if m.typ == msgMapReply {
		return qp.onMapReply(m, fd)
	}
	if fd >= 0 {
		closeFD(fd)
		return fmt.Errorf("message type %d carried an fd", m.typ)
	}
	switch m.typ {
	case msgSend, msgWriteImm:
		return qp.onRequest(m)
	case msgAck:
		if mine, err := qp.onAck(m); mine || err != nil {
			return err
		}
		select {
		case qp.ackCh <- m:
			return nil
		default:
			return fmt.Errorf("unexpected ack %d", m.seq)
		}
	case msgMapRequest:
		qp.onMapRequest(m)
	case msgUnmap:
		qp.onUnmap(m)
	case msgUnmapAck:
		qp.unmapConfirmed(m.seq)
	case msgGrant:
		return qp.onGrant(m)
	default:
		return fmt.Errorf("unexpected message type %d on a connected queue pair", m.typ)
	}
	return nil
}

// onRequest receives a Send chunk or a WriteImm doorbell. The first chunk
// of a message takes a Recv, or waits up to the RNR timeout for one.
func (qp *queuePair) onRequest(m message) error {
	if m.typ == msgWriteImm && m.length > 0 {
		// The peer wrote the bytes itself, into memory it mapped; the
		// doorbell's key and length become the Recv's completion, which
		// receivers check: they must name what this queue pair lets the
		// peer write, as on tcp, where the target checks the write.
		if err := qp.checkWriteImm(m); err != nil {
			qp.send(&message{typ: msgAck, seq: m.seq, status: verbs.StatusRemoteAccess}, -1)
			return fmt.Errorf("WriteImm doorbell: %w", err)
		}
	}
	if m.typ == msgSend {
		last := m.flags&flagLast != 0
		switch {
		case m.length > uint64(len(qp.peerStaging)):
			return fmt.Errorf("Send chunk of %d bytes exceeds the %d-byte staging buffer", m.length, len(qp.peerStaging))
		case m.total > uint64(math.MaxInt) || m.offset > m.total || m.length > m.total-m.offset:
			return fmt.Errorf("Send chunk [%d, +%d) of a %d-byte message", m.offset, m.length, m.total)
		case last != (m.offset+m.length == m.total):
			return fmt.Errorf("Send chunk [%d, +%d) of a %d-byte message is marked last=%v", m.offset, m.length, m.total, last)
		case !last && m.length == 0:
			return fmt.Errorf("empty Send chunk at %d of a %d-byte message", m.offset, m.total)
		}
	}
	qp.Mu.Lock()
	if qp.StateLocked() == verbs.QPError {
		qp.Mu.Unlock()
		qp.send(&message{typ: msgAck, seq: m.seq, status: verbs.StatusTransport}, -1)
		return nil
	}
	in := qp.inbound
	if m.typ == msgWriteImm || m.offset == 0 {
		if in != nil {
			qp.Mu.Unlock()
			return fmt.Errorf("new request %d while request %d is incomplete", m.seq, in.seq)
		}
		in = &inbound{send: m.typ == msgSend, chunk: m, seq: m.seq, total: m.total}
		qp.inbound = in
		if len(qp.Recvq) == 0 {
			in.timer = time.AfterFunc(qp.pd.opts.rnrTimeout, func() { qp.rnrExpired(in) })
			qp.Mu.Unlock()
			return nil
		}
	} else {
		if in == nil || !in.send || in.recv == nil || m.offset != in.next || m.total != in.total {
			qp.Mu.Unlock()
			return fmt.Errorf("Send chunk at %d does not continue a message", m.offset)
		}
		in.chunk, in.seq = m, m.seq
	}
	var buf [1]message // the one ack of the usual delivery, without an allocation
	acks := qp.deliverLocked(in, buf[:0])
	qp.Mu.Unlock()
	qp.sendAll(acks)
	qp.releaseRecvHere()
	return nil
}

// checkWriteImm checks a WriteImm doorbell's key and length against the
// windows this queue pair opens to its peer: a region with remote write,
// or a grant with write made on this queue pair, at least that long.
func (qp *queuePair) checkWriteImm(m message) error {
	w, err := qp.pd.Table.Window(m.key, qp.QP)
	if err == nil {
		// The doorbell names no address: the window must hold its length.
		_, err = softrc.InWindow(m.key, w.Addr, w.Len, w.Access, verbs.AccessRemoteWrite, w.Addr, m.length)
	}
	return err
}

// deliverLocked completes in's latest chunk, taking a Recv first if in has
// none (there is one). It returns the acks to send after unlocking,
// appended to acks (a caller's array spares an allocation a message); the
// caller then calls releaseRecv.
func (qp *queuePair) deliverLocked(in *inbound, acks []message) []message {
	m := in.chunk
	if in.recv == nil {
		r := qp.TakeRecvLocked()
		in.recv = r
		in.stopTimer()
		if in.send {
			st, peer, err := r.Fit(in.total)
			if st != verbs.StatusSuccess {
				// As on RC: the receiver's Recv fails and its queue pair
				// goes to the error state; the sender learns why.
				err = qp.Errorf("%w", err)
				qp.inbound = nil
				qp.releaseRecvLocked()
				qp.completeRecv(verbs.Completion{ID: r.ID, Op: verbs.OpRecv, Status: st, Err: err})
				acks = append(acks, message{typ: msgAck, seq: m.seq, status: peer})
				return append(acks, qp.failLocked(verbs.StatusFlushed, err)...)
			}
			r.Vec.Release()
		}
	}
	ack := append(acks, message{typ: msgAck, seq: m.seq})
	if in.send {
		if _, ok := in.recv.Vec.Acquire(); ok {
			in.recv.Vec.Scatter(int(m.offset), qp.peerStaging[:m.length])
			in.recv.Vec.Release()
		}
		in.next = m.offset + m.length
		if m.flags&flagLast == 0 {
			return ack
		}
		c := verbs.Completion{ID: in.recv.ID, Op: verbs.OpRecv, Len: int(in.total)}
		if m.flags&flagHasImm != 0 {
			c.Imm, c.HasImm = m.imm, true
		}
		qp.holdRecvLocked(c)
	} else {
		qp.holdRecvLocked(verbs.Completion{ID: in.recv.ID, Op: verbs.OpRecvImm, Len: int(min(m.length, uint64(math.MaxInt))), Imm: m.imm, HasImm: true, Key: m.key})
	}
	qp.inbound = nil
	return ack
}

// rnrExpired refuses a request that found no Recv in time: the sender's
// queue pair fails with StatusReceiverNotReady and, as any queue pair that
// goes to ERR, then shuts down its side of the connection (sendAll), so
// that this one goes to ERR too once it reads that: the error is fatal to
// the connection, as package verbs documents.
func (qp *queuePair) rnrExpired(in *inbound) {
	qp.Mu.Lock()
	if qp.inbound != in || in.recv != nil {
		qp.Mu.Unlock()
		return
	}
	qp.inbound = nil
	in.timer = nil
	qp.Mu.Unlock()
	qp.send(&message{typ: msgAck, seq: in.seq, status: verbs.StatusReceiverNotReady}, -1)
}
