package tcp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// This file is the data path: the writer goroutine, the receiver goroutine
// and the error state machine they share.
//
// Ownership rules that make every completion happen exactly once:
//   - a send request is in sendq until the writer takes it, then in
//     inflight until the receiver pops it on its response, or, Early,
//     until the writer has written it (completeEarly);
//   - a receive is in recvq until the receiver takes it for a message;
//   - whoever removes a request from those lists completes it;
//   - in ERR, what is left is flushed once both goroutines have stopped
//     touching memory (quiesce), or by Close after they have exited.

// writer writes frames in posting order: responses queued by the receiver,
// then requests in the order they were posted. In ERR it writes the
// responses still queued (the error report to the peer among them), shuts
// down its half of the connection and stops.
func (q *queuePair) writer(conn net.Conn) {
	for {
		q.writeMu.Lock()
		wrote, failed, err := q.writeQueued(conn, false, nil, nil)
		q.writeMu.Unlock()
		if err != nil {
			break
		}
		if wrote {
			continue
		}
		if failed {
			break
		}
		select {
		case <-q.wakeWriter:
		case <-q.Errored:
		}
	}
	// Posters check the state under writeMu before writing and the queue
	// pair is in ERR: once a poster already writing is done, nobody writes
	// any more. (A batch the receiver wrote in part is finished above:
	// writeQueued finishes it first, err or not; and the receiver starts
	// none once the writer is gone.)
	q.writeMu.Lock()
	if q.partial {
		q.finishPartial(conn)
	}
	q.writerGone = true
	q.writeMu.Unlock()
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	q.quiesce()
}

// directMaxQueued bounds the direct path, on which PostSend writes
// requests itself when the connection is nearly idle (at most one small
// request in flight, the writer not busy), saving a goroutine hand-off on
// each message of a round trip. Streams of requests go through the writer,
// which batches them. It writes without blocking (writeQueued's try), so
// it takes up to rxWriteMax bytes; where it cannot (no raw connection),
// directMaxQueued, which a nearly idle connection's send buffer takes.
const directMaxQueued = 16 << 10

// writeQueued takes every queued frame and writes it; the caller holds
// writeMu. With direct set it does nothing unless the batch is small and
// the queue pair is not in ERR. It reports whether it wrote anything and
// whether the queue pair is in ERR (then requests are left for the flush).
// A failed write moves the queue pair to ERR and closes conn.
//
// With try set (the receiver, and posters on the direct path) it writes
// without blocking: a peer that is not reading must never stop the
// receiver, as the peer's receiver may be waiting to write to us too,
// nor a poster. What the kernel's send queue did not take is the
// writer's to finish (partial), before anyone writes anything else.
// Batches over rxWriteMax, and those with a Read response to compress
// (compressing while writing blocks), are the writer's.
//
// rx is the receiver, when it is the caller: it delivers the completions
// of the Early requests it wrote (Queue) before it waits. Others hand
// those to a delivery under way, or Run's goroutine (Hand).
func (q *queuePair) writeQueued(conn net.Conn, direct bool, rx *receiving, try syscall.RawConn) (wrote, failed bool, err error) {
	if q.partial {
		if direct || try != nil {
			return false, false, nil
		}
		if err = q.finishPartial(conn); err != nil {
			return true, true, err
		}
		wrote = true
	}
	q.Mu.Lock()
	failed = q.StateLocked() == verbs.QPError
	bound := directMaxQueued
	if try != nil {
		bound = rxWriteMax
	}
	if direct && (failed || len(q.Inflight) > 1 || q.unackedBytes > bound || q.ctrlBytes > 0 || q.sendqBytes > bound) ||
		try != nil && (q.writerGone || compressing(q.ctrl) || q.sendqBytes+q.ctrlBytes > rxWriteMax) {
		q.Mu.Unlock()
		return wrote, failed, nil
	}
	ctrl := q.ctrl
	q.ctrl, q.spareCtrls = q.spareCtrls[:0], ctrl
	q.ctrlBytes, q.delayedAcks, q.urgentAcks = 0, 0, 0
	if len(ctrl) > 0 {
		q.ctrlTakes++
		softrc.Signal(q.ctrlTaken)
	}
	var reqs []*softrc.SendWR
	if !failed {
		reqs = q.takeLocked()
	}
	q.Mu.Unlock()
	if len(ctrl) == 0 && len(reqs) == 0 {
		return wrote, failed, nil
	}
	// Reference the regions whose bytes go out; a request whose region was
	// deregistered ends the batch and the queue pair (a local protection
	// error), after the requests before it are sent.
	b := written{ctrl: ctrl, reqs: reqs, send: reqs}
	for i, w := range reqs {
		if payloadBytes(w) == 0 {
			continue
		}
		if r, ok := w.Vec.Acquire(); !ok {
			b.send, b.bad, b.badRegion = reqs[:i], w, r
			break
		}
	}
	err = q.batch.write(conn, ctrl, b.send, q.maxInline, try)
	if err == errPartial {
		q.partial, q.written = true, b
		softrc.Signal(q.wakeWriter)
		return true, failed, nil
	}
	q.endBatch(conn, &b, err, rx != nil)
	return true, failed, err
}

// rxWriteMax bounds the payload bytes of a batch the receiver or a
// poster writes itself (writeQueued's try); larger ones are the writer's. On loopback a
// 4 MiB landing written by the receiver went into the kernel in one
// writev before the peer began to read (1.2 ms), where the writer's
// first writev stopped sooner and the peer read while the rest went
// out: a Fetch's p50 2.2-2.4 ms through the writer, 2.8-2.9 by the
// receiver (2-core VM). 1 MiB was faster by the receiver, 2 MiB the
// same either way.
const rxWriteMax = 2 << 20

// written is a batch of frames handed to the kernel, or, while partial,
// in part: what to release and complete once it is all written.
type written struct {
	ctrl      []ctrlFrame
	reqs      []*softrc.SendWR
	send      []*softrc.SendWR // reqs up to bad
	bad       *softrc.SendWR   // a request whose region was deregistered
	badRegion *softrc.Region
}

// finishPartial writes what the receiver left of its batch (partial),
// blocking; the caller holds writeMu.
func (q *queuePair) finishPartial(conn net.Conn) error {
	err := q.batch.finish(conn)
	b := q.written
	q.partial, q.written = false, written{}
	q.endBatch(conn, &b, err, false)
	return err
}

// endBatch releases what a batch referenced and completes its Early
// requests, as it is written (err nil) or failed to be. delivers: see
// writeQueued's rx.
func (q *queuePair) endBatch(conn net.Conn, b *written, err error, delivers bool) {
	early := false
	for _, w := range b.send {
		if payloadBytes(w) > 0 {
			w.Vec.Release()
		}
		early = early || w.Early
	}
	if early && err == nil {
		if h := afterEarlyWrite; h != nil {
			h()
		}
		q.completeEarly(b.send, delivers)
	}
	for i := range b.ctrl {
		b.ctrl[i].use.Release()
	}
	if b.bad != nil {
		q.Mu.Lock()
		b.bad.LocalErr = true
		q.Mu.Unlock()
		q.Fail(verbs.StatusFlushed, q.Errorf("%v %d: local region %#x was deregistered", b.bad.Op, b.bad.ID, b.badRegion.LocalKey()))
	}
	if err != nil {
		q.Fail(verbs.StatusTransport, q.Errorf("writing to the peer: %w", err))
		conn.Close()
	}
	clear(b.ctrl)
	clear(b.reqs)
}

// compressing reports whether a control frame of ctrl is a Read response
// to compress.
func compressing(ctrl []ctrlFrame) bool {
	for i := range ctrl {
		if ctrl[i].compress.Codec != verbs.CodecNone {
			return true
		}
	}
	return false
}

// afterEarlyWrite, set by tests, runs between writing a batch with Early
// requests and completing them (a writer the host has not run on yet).
var afterEarlyWrite func()

// takeLocked takes the posted requests the writer may send now: all of
// them, or those before the first Fence request that must wait for an
// earlier Read to complete. The caller holds q.Mu.
func (q *queuePair) takeLocked() []*softrc.SendWR {
	reqs := q.Sendq
	k := len(reqs)
	reads, bytes := q.readsInflight, 0
	for i, w := range reqs {
		if w.Fence && reads > 0 {
			k = i
			break
		}
		if w.Op == verbs.OpRead {
			reads++
		}
		bytes += payloadBytes(w)
	}
	q.readsInflight = reads
	if k == len(reqs) {
		q.Sendq, q.spareReqs = q.spareReqs[:0], reqs
	} else {
		q.Sendq = append(q.spareReqs[:0], reqs[k:]...)
		clear(reqs[k:])
		reqs = reqs[:k]
		q.spareReqs = reqs
	}
	q.Inflight = append(q.Inflight, reqs...)
	q.unackedBytes += bytes
	q.sendqBytes -= bytes
	return reqs
}

// earlyLocked marks the Lazy requests of ws Early when they are posted
// while a delivery of the send queue's completions is under way (a
// server's answer posted by a handler running where its request was
// delivered), and reports whether all of ws are Early. An Early request
// completes as it is written (completeEarly), and its frame says so
// (flagNoAck): the peer writes no acknowledgement for it, nor wakes for
// one to write, and a request-response exchange leaves nothing owed for
// the lazy-ack sweeper. Posted elsewhere (a goroutine of its own, not in
// a delivery) a Lazy request waits for its acknowledgement as before, as
// completing it where it is written would wake the queue's poller. The
// caller holds q.Mu.
func (q *queuePair) earlyLocked(ws []softrc.SendWR) (all bool) {
	checked, delivering := false, false
	all = len(ws) > 0
	for i := range ws {
		w := &ws[i]
		if !w.Lazy || w.Op == verbs.OpRead {
			all = false
			continue
		}
		if !checked {
			checked, delivering = true, q.SendCQ.Delivering()
		}
		w.Early = delivering
		all = all && delivering
	}
	return all
}

// holdEarly is the receiver's, as it delivers a frame with more of the
// peer's frames read already: the Early requests posted meanwhile (the
// answers of the calls it runs) wait in the send queue, and it writes
// them, in one batch with their acknowledgements, when it has delivered
// what it read (releaseHeld): a burst of requests is answered with one
// write, not one each, and without waking the writer goroutine.
func (q *queuePair) holdEarly() {
	q.Mu.Lock()
	q.holding = true
	q.Mu.Unlock()
}

// releaseHeld ends holdEarly, and the receiver's busy spell (rxBusy), as
// the receiver is about to wait for the next frame, writing what was
// held back: itself, when nobody else is writing (writeQueued's rx:
// without blocking, what the kernel does not take left to the writer),
// else through the writer. The completions of what it wrote are the
// receiver's to deliver (it does, before it waits).
func (r *receiving) releaseHeld() {
	q := r.q
	q.Mu.Lock()
	q.holding = false
	q.rxBusy.Store(false)
	held := q.held
	q.held = false
	q.Mu.Unlock()
	if !held {
		return
	}
	q.writeOrWake(r, false)
}

// writeOrWake writes what is queued from the receiver r without blocking
// (writeQueued's try; direct as there), when the writer is not at work,
// and otherwise, or when that wrote nothing, wakes the writer.
func (q *queuePair) writeOrWake(r *receiving, direct bool) {
	if r.raw != nil && q.writeMu.TryLock() {
		wrote, _, _ := q.writeQueued(r.conn, direct, r, r.raw)
		q.writeMu.Unlock()
		if wrote {
			return
		}
	}
	softrc.Signal(q.wakeWriter)
}

// completeEarly completes the Early requests of send, just written, that
// are still in flight (a cumulative acknowledgement of a later request
// may have completed one already): their completions are queued for the
// caller to deliver (delivers: the receiver), or handed to the send
// queue (softrc.CQ.Hand): the delivery under way takes them.
func (q *queuePair) completeEarly(send []*softrc.SendWR, delivers bool) {
	var buf [4]softrc.Entry
	es := buf[:0]
	q.Mu.Lock()
	for _, w := range send {
		if !w.Early {
			continue
		}
		i := slices.Index(q.Inflight, w)
		if i < 0 {
			continue
		}
		q.Inflight = slices.Delete(q.Inflight, i, i+1)
		q.unackedBytes -= payloadBytes(w)
		es = q.CompleteSend(es, w, verbs.StatusSuccess, nil)
	}
	q.Mu.Unlock()
	if delivers {
		q.SendCQ.Queue(es...)
	} else {
		q.SendCQ.Hand(es...)
	}
}

// frameBatch gathers frames into one writev: headers and small payloads are
// copied into an arena, larger payloads are written straight from the
// registered memory.
type frameBatch struct {
	arena []byte
	cuts  []cut
	bufs  net.Buffers
	// out is what WriteTo consumes (it advances the slice it is called
	// on): a field, so that the call does not move a local to the heap.
	// After flushNow's errPartial, what is left for finish.
	out net.Buffers
	now nowWriter
}

// cut ends an arena segment at end and follows it with an external payload.
type cut struct {
	end int
	ext []byte
}

func (b *frameBatch) add(h *header, payload []byte, inline int) {
	n := len(b.arena)
	if cap(b.arena)-n < headerSize {
		b.arena = append(b.arena, make([]byte, headerSize)...)
	} else {
		b.arena = b.arena[:n+headerSize]
	}
	h.put(b.arena[n:])
	if len(payload) <= inline {
		b.arena = append(b.arena, payload...)
	} else {
		b.cuts = append(b.cuts, cut{end: len(b.arena), ext: payload})
	}
}

// addVec adds a frame whose payload is the n bytes of v.
func (b *frameBatch) addVec(h *header, v softrc.Vec, n, inline int) {
	if len(v) <= 1 {
		var p []byte
		if len(v) == 1 {
			p = v[0].B
		}
		b.add(h, p, inline)
		return
	}
	b.add(h, nil, inline)
	if n <= inline {
		for _, s := range v {
			b.arena = append(b.arena, s.B...)
		}
		return
	}
	for _, s := range v {
		b.cuts = append(b.cuts, cut{end: len(b.arena), ext: s.B})
	}
}

// write writes the frames of ctrl and reqs, in one writev where it can.
// With try set (the receiver) it writes without blocking, and reports
// errPartial when the kernel took less than all: the rest waits in the
// batch for finish. try is never set for a Read response to compress.
func (b *frameBatch) write(conn net.Conn, ctrl []ctrlFrame, reqs []*softrc.SendWR, inline int, try syscall.RawConn) error {
	b.arena, b.cuts, b.bufs = b.arena[:0], b.cuts[:0], b.bufs[:0]
	if raceEnabled {
		inline = math.MaxInt // see race.go
	}
	for i := range ctrl {
		f := &ctrl[i]
		// Acknowledgements are cumulative: of consecutive ones, the last
		// says it all.
		if f.hdr.op == frameAck && f.hdr.status == 0 && i+1 < len(ctrl) &&
			ctrl[i+1].hdr.op == frameAck && ctrl[i+1].hdr.status == 0 {
			continue
		}
		if f.compress.Codec != verbs.CodecNone {
			plan := packFor(f.compress, f.payload)
			f.hdr.imm = answerImm(plan)
			if codec := plan.Codec; codec != zchunk.Stored {
				// What is batched goes first, then the response as a
				// stream of chunks, each compressed while the one before
				// it is written.
				if err := b.flush(conn); err != nil {
					return err
				}
				h := f.hdr
				h.flags = flagCompress
				var hb [headerSize]byte
				h.put(hb[:])
				if _, err := conn.Write(hb[:]); err != nil {
					return err
				}
				if _, err := zchunk.WriteStream(conn, codec, zchunk.Segments{f.payload}, len(f.payload)); err != nil {
					return err
				}
				continue
			}
		}
		b.add(&f.hdr, f.payload, inline)
	}
	for _, w := range reqs {
		h := header{key: w.Remote.Key, imm: w.Imm, seq: w.Seq, addr: w.Remote.Addr, length: uint64(w.N)}
		if w.HasImm {
			h.flags = flagImm
		}
		if w.Early {
			h.flags |= flagNoAck
		} else if w.Lazy {
			h.flags |= flagLazyAck
		}
		switch w.Op {
		case verbs.OpSend:
			h.op = frameSend
		case verbs.OpWrite:
			h.op = frameWrite
		case verbs.OpWriteImm:
			h.op = frameWriteImm
		case verbs.OpRead:
			h.op = frameReadReq
			if w.Compress.Codec != verbs.CodecNone {
				h.flags |= flagCompress
				h.imm = compressImm(w.Compress)
			}
			b.add(&h, nil, inline)
			continue
		}
		b.addVec(&h, w.Vec, w.N, inline)
	}
	if try != nil {
		return b.flushNow(try)
	}
	return b.flush(conn)
}

// errPartial: a write without blocking (frameBatch.flushNow) left part
// of the batch for finish.
var errPartial = errors.New("tcp: batch written in part")

// gather lists the batch's segments in order in bufs.
func (b *frameBatch) gather() {
	start := 0
	for _, c := range b.cuts {
		if c.end > start {
			b.bufs = append(b.bufs, b.arena[start:c.end])
		}
		b.bufs = append(b.bufs, c.ext)
		start = c.end
	}
	if start < len(b.arena) {
		b.bufs = append(b.bufs, b.arena[start:])
	}
}

// reset empties the batch, dropping its references to user memory.
func (b *frameBatch) reset() {
	clear(b.bufs)
	for i := range b.cuts {
		b.cuts[i].ext = nil
	}
	b.arena, b.cuts, b.bufs, b.out = b.arena[:0], b.cuts[:0], b.bufs[:0], nil
}

// flush writes what the batch holds and empties it.
func (b *frameBatch) flush(conn net.Conn) error {
	if len(b.arena) == 0 && len(b.cuts) == 0 {
		return nil
	}
	b.gather()
	var err error
	if raceEnabled {
		// One plain write, which the race detector annotates; writev is
		// not annotated. Every payload is in the arena.
		_, err = conn.Write(b.arena)
	} else {
		b.out = b.bufs
		_, err = b.out.WriteTo(conn)
	}
	b.reset()
	return err
}

// flushNow writes what the batch holds as far as the kernel's send queue
// takes it without blocking; errPartial leaves the rest in out for
// finish, else the batch is emptied.
func (b *frameBatch) flushNow(raw syscall.RawConn) error {
	if len(b.arena) == 0 && len(b.cuts) == 0 {
		return nil
	}
	b.gather()
	b.out = b.bufs
	for consume(&b.out, 0); len(b.out) > 0; {
		n, asked, err := b.now.write(raw, b.out)
		if err != nil {
			b.reset()
			return err
		}
		consume(&b.out, n)
		if n < asked {
			return errPartial // the kernel's send queue is full
		}
	}
	b.reset()
	return nil
}

// writeNowCap, set by tests, bounds the bytes each nowWriter.write writes, of
// how many it is offered: the kernel's send queue is full past them.
var writeNowCap func(asked int) int

// finish writes, blocking, what flushNow left, and empties the batch.
func (b *frameBatch) finish(conn net.Conn) error {
	var err error
	for len(b.out) > 0 && err == nil {
		if raceEnabled {
			// See flush: one plain write at a time.
			var n int
			n, err = conn.Write(b.out[0])
			consume(&b.out, n)
			continue
		}
		_, err = b.out.WriteTo(conn)
	}
	b.reset()
	return err
}

// consume drops the first n bytes of v.
func consume(v *net.Buffers, n int) {
	for len(*v) > 0 {
		l := len((*v)[0])
		if n < l {
			(*v)[0] = (*v)[0][n:]
			return
		}
		n -= l
		*v = (*v)[1:]
	}
}

// receiver reads frames and applies them in order. After a fatal error it
// keeps reading and discarding frames, so that the peer can finish writing
// and read the error report, until the peer closes or the linger timeout
// passes.
//
// The completions it produces it Queues and hands over itself (Deliver)
// after each frame, so that the consumer's reaction (a reply posted on a
// received request) runs here, without waking another goroutine. A
// consumer whose reaction may wait detaches the delivery
// (verbs.Detacher): the receiver then goes on in a new goroutine
// (receiving.resume), and this one leaves once the reaction is done.
func (q *queuePair) receiver(conn net.Conn, br *bufio.Reader) {
	r := &receiving{q: q, conn: conn, br: br, raw: q.raw} // raw: set by start before this goroutine
	r.cont = func() { r.loop(true) }
	r.resume = func() { q.Continue(r.cont) }
	r.loop(false)
}

// receiving is the receiver's state, which a goroutine taking over the
// role (resume) continues from.
type receiving struct {
	q        *queuePair
	conn     net.Conn
	br       *bufio.Reader
	raw      syscall.RawConn // nil: the receiver never writes
	draining bool
	holding  bool // holdEarly is on
	// err and fatal are the last frame's outcome (apply's), which the
	// goroutine that delivered it, or the one taking over, acts on.
	err   error
	fatal bool
	// cont continues the loop after a delivery; resume runs it in a new
	// goroutine of the queue pair's (Continue).
	cont, resume func()
}

// loop receives until the connection fails; afterDeliver starts it where
// a detached delivery left it, the last frame's outcome still to act on.
func (r *receiving) loop(afterDeliver bool) {
	q, br := r.q, r.br
	var hb [headerSize]byte
	for {
		if !afterDeliver {
			if _, r.err = io.ReadFull(br, hb[:]); r.err != nil {
				break
			}
			q.rxBusy.Store(true)
			var h header
			if h, r.err = parseHeader(hb[:]); r.err != nil {
				break
			}
			if !r.draining && q.InError() {
				r.draining = true
				q.quiesce()
			}
			if r.draining {
				if r.err = r.skip(&h); r.err != nil {
					break
				}
				continue
			}
			r.fatal, r.err = q.apply(&h, br)
			if !r.holding && br.Buffered() > 0 {
				r.holding = true
				q.holdEarly()
			}
			if q.DeliverFrom(r.resume) {
				return // another goroutine receives now (resume)
			}
		}
		afterDeliver = false
		if r.err != nil {
			break
		}
		if br.Buffered() == 0 {
			// The next read may wait.
			r.holding = false
			r.releaseHeld()
			r.flushAcks()
			if q.DeliverFrom(r.resume) {
				return // (the completions of Early requests written here)
			}
		}
		if r.fatal {
			r.draining = true
			q.quiesce()
		}
	}
	err := r.err
	if errors.Is(err, io.EOF) {
		err = fmt.Errorf("the peer closed the connection: %w", err)
	}
	q.Fail(verbs.StatusTransport, q.Errorf("reading from the peer: %w", err))
	if !r.draining {
		q.quiesce()
	}
	q.Deliver()
}

// skip reads past the payload of a frame received while draining.
func (r *receiving) skip(h *header) error {
	if h.op == frameReadResp && h.flags&flagCompress != 0 {
		if h.length > maxDrain {
			return fmt.Errorf("not reading a compressed %d-byte read response while in ERR", h.length)
		}
		_, err := zchunk.Skip(r.br, int(h.length))
		return err
	}
	if h.hasPayload() {
		return skipPayload(r.br, h.length)
	}
	return nil
}

// apply executes one frame. fatal reports that the queue pair entered ERR
// because of it; err that the connection is unusable.
func (q *queuePair) apply(h *header, br *bufio.Reader) (fatal bool, err error) {
	switch h.op {
	case frameWrite, frameWriteImm:
		return q.applyWrite(h, br)
	case frameSend:
		return q.applySend(h, br)
	case frameReadReq:
		return q.applyReadRequest(h, br.Buffered() == 0), nil
	case frameReadResp:
		return q.applyReadResponse(h, br)
	case frameAck:
		return q.applyAck(h)
	}
	return false, fmt.Errorf("unexpected frame opcode %d", h.op)
}

// readPayload reads a payload from the connection straight into dst.
func readPayload(br *bufio.Reader, dst []byte) error {
	if raceEnabled {
		// See race.go: chunks smaller than the read buffer make bufio read
		// into its own buffer and copy, after the read's annotations.
		for len(dst) > 0 {
			n, err := br.Read(dst[:min(len(dst), readBufferSize-1)])
			dst = dst[n:]
			if err != nil && len(dst) > 0 {
				if errors.Is(err, io.EOF) {
					err = io.ErrUnexpectedEOF
				}
				return err
			}
		}
		return nil
	}
	_, err := io.ReadFull(br, dst)
	return err
}

// readVec reads n payload bytes from the connection straight into the
// segments of v, in order.
func readVec(br *bufio.Reader, v softrc.Vec, n int) error {
	for _, s := range v {
		if n == 0 {
			break
		}
		k := min(n, len(s.B))
		if err := readPayload(br, s.B[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// applyWrite lands a Write or WriteImm. Key, rights and bounds are checked,
// and for WriteImm a receive is taken, before a byte of the region is
// written; the payload is read from the socket straight into the region.
func (q *queuePair) applyWrite(h *header, br *bufio.Reader) (bool, error) {
	use, buf, aerr := q.pd.Table.Remote(h.key, q.QP, h.addr, h.length, verbs.AccessRemoteWrite)
	if aerr != nil {
		return q.refuseAndSkip(h, br, verbs.StatusRemoteAccess, aerr)
	}
	var r *softrc.RecvWR
	if h.op == frameWriteImm {
		var err error
		if r, err = q.WaitRecv(q.pd.opts.rnrTimeout); err != nil {
			use.Release()
			if !errors.Is(err, softrc.ErrRNR) {
				return false, err
			}
			return q.refuseAndSkip(h, br, verbs.StatusReceiverNotReady, fmt.Errorf("%w within %v", softrc.ErrRNR, q.pd.opts.rnrTimeout))
		}
	}
	err := readPayload(br, buf)
	use.Release()
	if err != nil {
		if r != nil {
			q.RecvCQ.Queue(q.CompleteRecv(r, verbs.Completion{Status: verbs.StatusTransport, Err: err}))
		}
		return false, err
	}
	switch {
	case h.flags&flagNoAck != 0:
	case r != nil:
		q.queueAck(h.seq, h.flags&flagLazyAck != 0)
	default:
		q.queueCtrl(ctrlFrame{hdr: header{op: frameAck, seq: h.seq}})
	}
	if r != nil {
		q.RecvCQ.Queue(q.CompleteRecv(r, verbs.Completion{Op: verbs.OpRecvImm, Len: len(buf), Imm: h.imm, HasImm: true, Key: h.key}))
	}
	return false, nil
}

// applySend lands a Send in the oldest posted receive.
func (q *queuePair) applySend(h *header, br *bufio.Reader) (bool, error) {
	r, err := q.WaitRecv(q.pd.opts.rnrTimeout)
	if err != nil {
		if !errors.Is(err, softrc.ErrRNR) {
			return false, err
		}
		return q.refuseAndSkip(h, br, verbs.StatusReceiverNotReady, fmt.Errorf("%w within %v", softrc.ErrRNR, q.pd.opts.rnrTimeout))
	}
	if local, remote, cause := r.Fit(h.length); local != verbs.StatusSuccess {
		q.refuse(h, remote, cause)
		q.RecvCQ.Queue(q.CompleteRecv(r, verbs.Completion{Status: local, Err: cause}))
		return true, skipPayload(br, h.length)
	}
	n := int(h.length)
	err = readVec(br, r.Vec, n)
	r.Vec.Release()
	if err != nil {
		q.RecvCQ.Queue(q.CompleteRecv(r, verbs.Completion{Status: verbs.StatusTransport, Err: err}))
		return false, err
	}
	c := verbs.Completion{Op: verbs.OpRecv, Len: n}
	if h.flags&flagImm != 0 {
		c.Imm, c.HasImm = h.imm, true
	}
	// The acknowledgement is queued first so that a reply posted on the
	// receive completion carries it.
	if h.flags&flagNoAck == 0 {
		q.queueAck(h.seq, h.flags&flagLazyAck != 0)
	}
	q.RecvCQ.Queue(q.CompleteRecv(r, c))
	return false, nil
}

// applyReadRequest queues the response to a Read; the writer, or the
// receiver before it waits when nothing more is read (last), sends the
// region's bytes straight from memory.
func (q *queuePair) applyReadRequest(h *header, last bool) bool {
	use, buf, aerr := q.pd.Table.Remote(h.key, q.QP, h.addr, h.length, verbs.AccessRemoteRead)
	if aerr != nil {
		return q.refuse(h, verbs.StatusRemoteAccess, aerr)
	}
	q.awaitCtrlRoom()
	f := ctrlFrame{hdr: header{op: frameReadResp, seq: h.seq, length: h.length}, payload: buf, use: use}
	if h.flags&flagCompress != 0 && q.compressOK.Load() {
		f.compress = compressionOf(h.imm)
		if last {
			// Decided here, so that a response that goes as it is
			// (zchunk.Stored) is the receiver's to write.
			if plan := packFor(f.compress, buf); plan.Codec == zchunk.Stored {
				f.hdr.imm = answerImm(plan)
				f.compress = verbs.Compression{}
			}
		}
	}
	if last && f.compress.Codec == verbs.CodecNone {
		// Nothing more read: the receiver writes the response itself
		// before it waits (releaseHeld), without waking the writer.
		q.Mu.Lock()
		q.ctrl = append(q.ctrl, f)
		q.ctrlBytes += len(f.payload)
		q.held = true
		q.Mu.Unlock()
		return false
	}
	q.queueCtrl(f)
	return false
}

// maxQueuedCtrl bounds the control frames (read responses, acks) waiting
// for the writer. A peer that sends requests but does not read the answers
// makes the writer block on the socket; the receiver then waits here
// instead of queueing without bound, and TCP's flow control pushes back on
// the peer.
const maxQueuedCtrl = 4096

// awaitCtrlRoom waits, on the receiver, until the writer has taken the
// queued control frames when there are maxQueuedCtrl of them, or the queue
// pair fails.
func (q *queuePair) awaitCtrlRoom() {
	for {
		q.Mu.Lock()
		full := len(q.ctrl) >= maxQueuedCtrl && q.StateLocked() != verbs.QPError
		q.Mu.Unlock()
		if !full {
			return
		}
		softrc.Signal(q.wakeWriter) // (some may be held for the receiver)
		select {
		case <-q.ctrlTaken:
		case <-q.Errored:
			return
		}
	}
}

// maxDrain is the largest payload of a refused request that the receiver
// reads and throws away to stay in step with the stream. A refused request
// declaring more is not read at all: its NAK is already on its way, and the
// connection, useless in ERR anyway, goes.
const maxDrain = 64 << 20

// refuseAndSkip refuses h, so that its NAK goes out at once, before
// anything else is read, and then skips its payload (see maxDrain).
func (q *queuePair) refuseAndSkip(h *header, br *bufio.Reader, status verbs.Status, cause error) (bool, error) {
	q.refuse(h, status, cause)
	return true, skipPayload(br, h.length)
}

// skipPayload reads and drops n payload bytes, unless n exceeds maxDrain.
func skipPayload(br *bufio.Reader, n uint64) error {
	if n > maxDrain {
		return fmt.Errorf("not reading a %d-byte payload of a refused request", n)
	}
	_, err := br.Discard(int(n))
	return err
}

// passEarlyLocked completes the Early requests at the head of Inflight
// that came before request seq, which the peer answers now: it read them
// before it, and acknowledges none of them (flagNoAck), and the writer
// that wrote them completes them only after its write returned, which a
// busy host may delay past the peer's answer to a later request (a Read
// posted behind an Early request, answered while the writer had not yet
// run on). Their completions are Queued for the receiver to deliver. The
// caller holds q.Mu.
func (q *queuePair) passEarlyLocked(seq uint64) {
	var buf [4]softrc.Entry
	es := buf[:0]
	for len(q.Inflight) > 0 && q.Inflight[0].Early && q.Inflight[0].Seq < seq {
		w := q.Inflight[0]
		q.Inflight = softrc.TakeFront(q.Inflight, 1)
		q.unackedBytes -= payloadBytes(w)
		es = q.CompleteSend(es, w, verbs.StatusSuccess, nil)
	}
	if len(es) > 0 {
		q.SendCQ.Queue(es...)
	}
}

// applyReadResponse reads the data of the oldest outstanding Read straight
// into its local buffer.
func (q *queuePair) applyReadResponse(h *header, br *bufio.Reader) (bool, error) {
	q.Mu.Lock()
	q.passEarlyLocked(h.seq)
	if len(q.Inflight) == 0 {
		q.Mu.Unlock()
		return false, fmt.Errorf("read response %d with no request outstanding", h.seq)
	}
	w := q.Inflight[0]
	q.Mu.Unlock()
	if w.Seq != h.seq || w.Op != verbs.OpRead || uint64(w.N) != h.length {
		return false, fmt.Errorf("read response %d of %d bytes does not answer the oldest request %d (%v of %d bytes)", h.seq, h.length, w.Seq, w.Op, w.N)
	}
	status, fatal := verbs.StatusSuccess, false
	var cause, lost error
	packed := h.flags&flagCompress != 0
	if packed && w.Compress.Codec == verbs.CodecNone {
		return false, fmt.Errorf("read response %d came compressed, unasked", h.seq)
	}
	if w.Compress.Codec != verbs.CodecNone {
		w.Sampled = float64(h.imm>>8&0xffff) / 100
	}
	if w.N > 0 {
		if st, why := w.Vec.Hold(); st == verbs.StatusSuccess {
			var err error
			if packed {
				err = q.readPacked(h, w, br)
			} else {
				err = readVec(br, w.Vec, w.N)
			}
			w.Vec.Release()
			if packed && (errors.Is(err, zchunk.ErrCorrupt) || errors.Is(err, zchunk.ErrBadHeader)) {
				// The Read fails as bad data; then the connection, whose
				// stream cannot be followed past a lie.
				status, fatal = verbs.StatusBadData, true
				cause = q.Errorf("READ %d: %w", w.ID, err)
				q.Fail(verbs.StatusFlushed, cause)
				lost = fmt.Errorf("read response %d: %w", h.seq, err)
			} else if err != nil {
				return false, err
			}
		} else {
			var err error
			if packed {
				_, err = zchunk.Skip(br, w.N)
			} else {
				_, err = br.Discard(int(h.length))
			}
			if err != nil {
				return false, err
			}
			status, fatal = st, true
			cause = q.Errorf("READ %d: %w", w.ID, why)
			q.Fail(verbs.StatusFlushed, cause)
		}
	}
	q.Mu.Lock()
	q.Inflight = softrc.TakeFront(q.Inflight, 1)
	q.readsInflight--
	fenced := q.readsInflight == 0 && len(q.Sendq) > 0
	q.Mu.Unlock()
	if fenced {
		softrc.Signal(q.wakeWriter) // a Fence request may go now
	}
	q.SendCQ.Queue(q.CompleteSend(nil, w, status, cause)...)
	return fatal, lost
}

// applyAck completes the requests an acknowledgement covers (see
// softrc.QP.Ack). A negative acknowledgement fails its request and moves
// the queue pair to ERR.
func (q *queuePair) applyAck(h *header) (bool, error) {
	failed, err := q.Ack(h.seq, verbs.Status(h.status), func(done []*softrc.SendWR, _ *softrc.SendWR) {
		for _, w := range done {
			q.unackedBytes -= payloadBytes(w)
		}
	})
	if err != nil && h.status != 0 && h.seq <= q.sentSeq() {
		// The refusal of a request completed as it was written (Early):
		// the queue pair ends with what the peer said.
		st, why := softrc.Refused(verbs.Status(h.status))
		q.Fail(st, q.Errorf("the peer refused request %d: %w", h.seq, why))
		return true, nil
	}
	return failed, err
}

// sentSeq is the sequence number of the last request posted.
func (q *queuePair) sentSeq() uint64 {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.nextSeq
}

// refuse reports a failed request to the peer and moves the queue pair to
// ERR, as a responder error does in RC. It returns true (fatal).
func (q *queuePair) refuse(h *header, status verbs.Status, cause error) bool {
	// One step, so that the peer never sees the NAK of a queue pair not
	// yet in ERR, and the writer, woken by ERR, still finds the NAK.
	q.Mu.Lock()
	q.ctrl = append(q.ctrl, ctrlFrame{hdr: header{op: frameAck, status: uint8(status), seq: h.seq}})
	q.FailLocked(verbs.StatusFlushed, q.Errorf("refused the peer's %s %d: %w", requestOps[h.op], h.seq, cause))
	q.Mu.Unlock()
	softrc.Signal(q.wakeWriter)
	return true
}

// maxDelayedAcks bounds how many acknowledgements of messages that
// completed a receive may wait without waking the writer (queueAck). They
// wait so that a reply posted in reaction to the completion, which the
// receiver hands over before it reads on (softrc.CQ.Deliver), carries
// them: a request-response exchange then costs one frame batch per
// direction and no wake-up of the writer. What no reply took, the
// receiver writes itself before it waits for the next frame (flushAcks),
// but for lazy ones (below).
const maxDelayedAcks = 16

// lazyAckDelay is how long the acknowledgements of requests marked
// flagLazyAck (verbs.SendRequest.LazyCompletion: nothing waits for their
// completion, which only frees the sender's buffer) may wait for a frame
// going back before the writer sends them on their own. A client's
// answer is such a request: its acknowledgement rides the client's next
// request, and neither side writes or wakes up for it. (Go's timers below
// a millisecond round up to about one when the process is idle, which is
// why acknowledgements that something waits for never wait for a timer.)
var lazyAckDelay atomic.Int64 // nanoseconds; 500 µs (tests change it)

func init() { lazyAckDelay.Store(int64(500 * time.Microsecond)) }

// queueAck queues the acknowledgement of request seq without waking the
// writer (see maxDelayedAcks); lazy says the request was marked
// flagLazyAck, and such acknowledgements wait for a frame going back or
// the sweeper. Session 8 flushed lazy ones too with fewer than 5 Ps,
// where a caller woken by a channel hand-off ran before the receiver
// waited and its next request took them. Since callers are woken through
// the netpoller (the engine's answer bell) that no longer holds: on 2
// CPUs, GOMAXPROCS=2, keeping them back took a 4 KiB Fetch from 3.6-4.0
// hand-offs, 0.24-0.44 idle-P starts and 12.2-12.9 syscalls per call to
// 3.05, 0.03 and 9.0, and its p50 from 31.7-33.8 to 26.0-31.2 µs; with
// GOMAXPROCS=1, from 4.0 hand-offs and 13 syscalls to 3.1 and 9.
func (q *queuePair) queueAck(seq uint64, lazy bool) {
	q.awaitCtrlRoom()
	q.Mu.Lock()
	q.ctrl = append(q.ctrl, ctrlFrame{hdr: header{op: frameAck, seq: seq}})
	q.delayedAcks++
	if !lazy {
		q.urgentAcks++
	}
	wake := q.delayedAcks >= maxDelayedAcks
	if wake {
		q.delayedAcks, q.urgentAcks = 0, 0
	}
	q.Mu.Unlock()
	if wake {
		softrc.Signal(q.wakeWriter)
	}
}

// owedAcks reports whether delayed acknowledgements wait, and whether
// any of them is not lazy.
func (q *queuePair) owedAcks() (any, urgent bool) {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.delayedAcks > 0, q.urgentAcks > 0
}

// flushAcks writes the delayed acknowledgements no frame took, as the
// receiver is about to wait for the next frame: itself, on the direct
// path's terms (see writeQueued), when nobody is writing (without
// blocking: writeQueued's rx); else the writer is woken for them. When
// all of them are lazy, it only makes sure that the lazy-ack sweeper
// looks at them. Never are they left unsent.
func (r *receiving) flushAcks() {
	q := r.q
	if any, urgent := q.owedAcks(); !urgent {
		if any {
			q.armLazyAcks()
		}
		return
	}
	// The goroutine the completion woke (the caller of a round trip) is
	// next to run here: let it, so that the request it posts next carries
	// the acknowledgements, and our writing them is not on its way.
	runtime.Gosched()
	if any, urgent := q.owedAcks(); !urgent {
		if any {
			q.armLazyAcks()
		}
		return
	}
	q.writeOrWake(r, true)
}

// armLazyAcks puts the queue pair on the lazy-ack sweeper's list.
func (q *queuePair) armLazyAcks() {
	q.Mu.Lock()
	armed := q.lazyArmed
	q.lazyArmed = true
	q.Mu.Unlock()
	if !armed {
		lazyAcks.add(q)
	}
}

// lazyAckSweep is what the sweeper does with the queue pair: it wakes the
// writer for acknowledgements owed since the previous sweep that no frame
// took meanwhile, and reports whether the queue pair still owes any.
func (q *queuePair) lazyAckSweep() (keep bool) {
	q.Mu.Lock()
	owed := q.delayedAcks > 0
	due := owed && q.lazyMark == q.ctrlTakes
	q.lazyMark = q.ctrlTakes
	if due {
		q.delayedAcks, q.urgentAcks = 0, 0
	}
	if !owed || due {
		q.lazyArmed = false
	}
	q.Mu.Unlock()
	if due {
		softrc.Signal(q.wakeWriter)
	}
	return owed && !due
}

// lazyAcks is the sweeper of lazy acknowledgements: one goroutine for the
// process, which runs only while some queue pair owes lazy
// acknowledgements, and looks at them every lazyAckDelay. (A timer per
// queue pair, reset on every exchange, would wake the netpoller's thread
// each time.)
var lazyAcks lazySweeper

type lazySweeper struct {
	mu      sync.Mutex
	qps     map[*queuePair]struct{}
	running bool
	emptied chan struct{} // remove took the last queue pair off the list
}

func (w *lazySweeper) add(q *queuePair) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.qps == nil {
		w.qps = map[*queuePair]struct{}{}
		w.emptied = make(chan struct{}, 1)
	}
	w.qps[q] = struct{}{}
	if !w.running {
		w.running = true
		go w.run()
	}
}

// remove takes q off the list (quiesce) at once; the sweeper ends soon
// after the last queue pair on it closes.
func (w *lazySweeper) remove(q *queuePair) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.qps[q]; !ok {
		return
	}
	delete(w.qps, q)
	if len(w.qps) == 0 {
		softrc.Signal(w.emptied)
	}
}

// lazySweeperIdle is how many sweeps with no queue pair on the list the
// sweeper makes before it ends (at once when the last one on it closed),
// so that a steady stream of exchanges that owe lazy acknowledgements,
// which leaves the list empty between some of them, does not start a
// goroutine every few sweeps. Few: small calls answered where their
// requests were delivered owe none (earlyLocked), and arm the sweeper
// only now and then (a call run on a goroutine of its own, one left
// behind), and each sweep after that is a wake-up of the process for
// nothing (20 of them cost a 4 KiB tcp Call 0.01-0.02 hand-offs on 2
// CPUs).
const lazySweeperIdle = 2

func (w *lazySweeper) run() {
	idle := 0
	t := time.NewTimer(time.Duration(lazyAckDelay.Load()))
	defer t.Stop()
	for first := true; ; first = false {
		if !first {
			t.Reset(time.Duration(lazyAckDelay.Load())) // fired or stopped: nothing stale in t.C (Go 1.23 timers)
		}
		closed := false
		select {
		case <-t.C:
		case <-w.emptied:
			t.Stop()
			closed = true
		}
		w.mu.Lock()
		if closed && len(w.qps) == 0 {
			w.running = false
			w.mu.Unlock()
			return
		}
		for q := range w.qps {
			if !q.lazyAckSweep() {
				delete(w.qps, q)
			}
		}
		if len(w.qps) > 0 {
			idle = 0
		} else if idle++; idle >= lazySweeperIdle {
			w.running = false
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
	}
}

func (q *queuePair) queueCtrl(f ctrlFrame) {
	q.Mu.Lock()
	q.ctrl = append(q.ctrl, f)
	q.ctrlBytes += len(f.payload)
	q.Mu.Unlock()
	softrc.Signal(q.wakeWriter)
}

// payloadBytes is how many bytes a request sends to the peer.
func payloadBytes(w *softrc.SendWR) int {
	if w.Op == verbs.OpRead {
		return 0
	}
	return w.N
}

// FailedLocked gives the connection the linger timeout to deliver what is
// queued for the peer.
func (q *queuePair) FailedLocked() {
	if conn := q.ConnLocked(); conn != nil {
		conn.SetDeadline(time.Now().Add(q.pd.opts.lingerTimeout))
	}
}

// quiesce records that one goroutine no longer touches memory; the last
// one completes every request still queued with an error status (see
// softrc.QP.Flush) and drops the queued responses.
func (q *queuePair) quiesce() {
	q.Mu.Lock()
	q.active--
	last := q.active == 0
	q.Mu.Unlock()
	if last {
		lazyAcks.remove(q)
		q.Flush()
		q.releaseCtrl()
	}
}

// releaseCtrl drops the responses still queued for the writer.
func (q *queuePair) releaseCtrl() {
	q.Mu.Lock()
	ctrl := q.ctrl
	q.ctrl, q.ctrlBytes = nil, 0
	q.sendqBytes, q.unackedBytes, q.readsInflight = 0, 0, 0
	q.Mu.Unlock()
	for i := range ctrl {
		ctrl[i].use.Release()
	}
}

// isRunning reports whether the sweeper's goroutine runs (tests).
func (w *lazySweeper) isRunning() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.running
}

// readPacked reads a compressed Read response (flagCompress) into w's
// local segments, and notes in w how it came.
func (q *queuePair) readPacked(h *header, w *softrc.SendWR, br *bufio.Reader) error {
	segs := make(zchunk.Segments, 0, len(w.Vec))
	for _, s := range w.Vec {
		segs = append(segs, s.B)
	}
	wire, err := zchunk.ReadStream(br, segs, w.N)
	w.Packed, w.Wire = verbs.CodecNamed(zchunk.Codec(h.imm&0xff).String()), int(wire)
	return err
}
