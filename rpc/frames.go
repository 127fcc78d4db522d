package rpc

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Receive slots and credits of a link that carries frames (see frame.go).
//
// Each side posts frameSlots Recvs, each at its own slot of slotSize bytes
// from the control pool. Every Send (a frame) the peer posts consumes one
// of them, so a side may post one only while it holds a credit: it starts with frameSlots-1 and one reserved slot that only a
// credit-only frame may use, so returning credits never deadlocks. A side
// returns the slots it reposted in the header of every frame it sends, and
// sends a credit-only frame when it holds frameSlots/2 unreturned ones.
const (
	frameSlots = 32
	// maxFrameInline bounds the tensors a FETCH_RESP carries inline, so a
	// large eager threshold does not make every slot large.
	maxFrameInline = 64 << 10
	// frameSlack is a slot's room for the header, key and metadata.
	frameSlack = 4 << 10
)

// slotSizeFor is the slot size both sides derive from the session's eager
// threshold (HandshakeResponse.eager_threshold): room for the inline
// tensors, or at least for a request's metadata (MaxFrameMetadataBytes),
// and the slack.
func slotSizeFor(eager int) int {
	n := max(min(max(eager, 0), maxFrameInline), MaxFrameMetadataBytes+16) + frameSlack
	return (n + 255) &^ 255
}

// frameInline is the largest tensor a FETCH_RESP carries inline.
func frameInline(eager int) int { return min(max(eager, 0), maxFrameInline) }

// framing is a link's frame state.
type framing struct {
	slotSize int
	slots    []*mempool.Buffer
	// serve handles a request frame (server side; nil on a client, which
	// refuses requests). It runs in the polling goroutine: it must copy
	// body if it keeps it, and must not block. releases receives the
	// transfer ids a client's frame carried.
	serve    func(h frameHeader, body []byte)
	releases func(ids []uint64)

	received   atomic.Uint64 // frames received, for Stats and tests
	indirect   atomic.Uint64 // of which with frameIndirect, for tests
	releasedIn atomic.Uint64 // transfer ids released by the peer's frames on this lane, for tests

	mu          sync.Mutex
	credits     int // Sends this side may post
	reserve     int // 0 or 1: the slot kept for credit-only frames
	outstanding int // posted and not yet returned by the peer
	unreturned  uint32
	wake        chan struct{} // closed when credits come back
	pending     map[uint64]*pendingCall
	abandoned   int // pending requests whose callers stopped waiting
	maxAbandon  int // maxAbandoned; tests lower it
	// Client side: transfer ids to release and refs to cancel, sent with
	// the next frame or, when none goes out soon, in a RELEASE frame.
	relIDs  []uint64
	relRefs []uint64

	kick   chan struct{} // asks the creditor for a credit-only frame
	flush  chan struct{} // asks the releaser for a RELEASE frame
	cancel context.CancelFunc
}

// frameReply is a response frame, decoded in the polling goroutine (so
// the slot's bytes are copied once, by protobuf): the status it carries
// (nil for OK) and on OK the body, or bad when the server broke the format.
type frameReply struct {
	flags  uint16
	status error
	msg    proto.Message
	bad    error
}

// pendingCall is a request frame awaiting its response; into says what
// the response's body decodes into, by its flags. Once its caller has
// stopped waiting, late holds what the caller leaves to do when the
// response arrives or the link closes (revoke what it granted).
type pendingCall struct {
	ch   chan frameReply
	want uint8 // the response's type
	into func(flags uint16) proto.Message
	late func()
}

// decodeReply decodes a response frame's body for pc.
func (pc *pendingCall) decodeReply(flags uint16, body []byte) frameReply {
	r := frameReply{flags: flags}
	st, rest, err := decodeStatus(body)
	switch {
	case err != nil:
		r.bad = err
	case st != nil:
		r.status = st
	default:
		m := pc.into(flags)
		if err := proto.Unmarshal(rest, m); err != nil {
			r.bad = fmt.Errorf("%w: %v", errFrame, err)
		}
		r.msg = m
	}
	return r
}

// enableFrames makes the link carry frames with slots of slotSize bytes;
// serve and releases (server side) handle requests. Call it before
// connect.
func (l *link) enableFrames(slotSize int, serve func(frameHeader, []byte), releases func([]uint64)) {
	l.fr = &framing{
		slotSize: slotSize, serve: serve, releases: releases, credits: frameSlots - 1, reserve: 1, maxAbandon: maxAbandoned,
		wake: make(chan struct{}), pending: map[uint64]*pendingCall{}, kick: make(chan struct{}, 1), flush: make(chan struct{}, 1),
	}
}

// postSlots allocates the slots and posts them; it starts the creditor.
// It never waits for the control pool (a session gets only the lanes whose
// slots fit: lanesAllowed), so a full one fails the link at once.
func (l *link) postSlots(ctx context.Context) error {
	f := l.fr
	if err := allocSlots(l.ctlPool, f); err != nil {
		return err
	}
	for i := range f.slots {
		if err := l.postSlot(uint64(i)); err != nil {
			return err
		}
	}
	cctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	l.wg.Add(1)
	go l.creditor(cctx)
	if f.serve == nil {
		l.wg.Add(1)
		go l.releaser(cctx)
	}
	return nil
}

func (l *link) postSlot(i uint64) error {
	local, err := l.dev.ctl.Local(l.fr.slots[i])
	if err != nil {
		return err
	}
	return l.qp.PostRecv(verbs.RecvRequest{ID: i, Local: local})
}

// releaseSlots frees the framing's buffers once the queue pair is closed.
func (f *framing) releaseSlots() {
	if f.cancel != nil {
		f.cancel()
	}
	for _, b := range f.slots {
		b.Release()
	}
	f.slots = nil
}

// completeSlot handles a Recv completion, in the polling goroutine: the
// verifying message or a frame; then it reposts the slot. A write with
// immediate, which the protocol never sends, fails the link.
func (l *link) completeSlot(c verbs.Completion) {
	f := l.fr
	if c.ID >= uint64(len(f.slots)) || (c.Op == verbs.OpRecv && (c.Len > f.slotSize || c.Len < 0)) {
		l.fail(fmt.Errorf("receive completion for slot %d of %d bytes", c.ID, c.Len))
		return
	}
	verified := l.verified.Load()
	var err error
	switch {
	case !verified && c.Op == verbs.OpRecv:
		data := f.slots[c.ID].Bytes()[:c.Len]
		select {
		case l.verifyCh <- append([]byte(nil), data[:min(len(data), verifyBytes)]...):
		default:
		}
	case verified && c.Op == verbs.OpRecv:
		err = l.handleFrame(f.slots[c.ID].Bytes()[:c.Len])
	case c.Op == verbs.OpRecvImm:
		err = errors.New("a write with immediate, which frames never use")
	}
	if err != nil {
		l.fail(fmt.Errorf("peer broke the frame protocol: %w", err))
		return
	}
	if err := l.postSlot(c.ID); err != nil {
		l.fail(fmt.Errorf("reposting a receive: %w", err))
		return
	}
	if verified {
		f.mu.Lock()
		f.unreturned++
		kick := f.unreturned >= frameSlots/2
		f.mu.Unlock()
		if kick {
			select {
			case f.kick <- struct{}{}:
			default:
			}
		}
	}
}

// handleFrame decodes and dispatches one received frame.
func (l *link) handleFrame(b []byte) error {
	h, body, releases, err := decodeFrame(b)
	if err != nil {
		return err
	}
	f := l.fr
	f.received.Add(1)
	if h.Flags&frameIndirect != 0 {
		f.indirect.Add(1)
	}
	f.mu.Lock()
	if int64(h.Credits) > int64(f.outstanding) {
		f.mu.Unlock()
		return fmt.Errorf("%d credits returned, %d outstanding", h.Credits, f.outstanding)
	}
	if h.Credits > 0 {
		n := int(h.Credits)
		f.outstanding -= n
		if f.reserve == 0 {
			f.reserve, n = 1, n-1
		}
		f.credits += n
		close(f.wake)
		f.wake = make(chan struct{})
	}
	f.mu.Unlock()
	server := f.serve != nil
	if len(releases) > 0 || h.Type == frameRelease {
		if !server {
			return fmt.Errorf("%w: releases sent to the client", errFrame)
		}
		if ids := readU64s(releases); len(ids) > 0 {
			f.releasedIn.Add(uint64(len(ids)))
			f.releases(ids)
		}
	}
	switch h.Type {
	case frameFetchReq, frameSendReq, frameCallReq, frameRelease:
		if !server {
			return fmt.Errorf("%w: a request to the client", errFrame)
		}
		f.serve(h, body)
	case frameFetchResp, frameSendResp, frameCallResp:
		if server {
			return fmt.Errorf("%w: a response to the server", errFrame)
		}
		f.mu.Lock()
		pc, ok := f.pending[h.Ref]
		if ok && pc.want != h.Type {
			f.mu.Unlock()
			return fmt.Errorf("%w: a response of type %d to a request awaiting type %d", errFrame, h.Type, pc.want)
		}
		delete(f.pending, h.Ref)
		if ok && pc.late != nil {
			f.abandoned--
		}
		f.mu.Unlock()
		switch {
		case !ok:
		case pc.late != nil:
			l.wg.Add(1) // the polling goroutine is counted: close waits for this
			go func() {
				defer l.wg.Done()
				pc.late()
			}()
		default:
			pc.ch <- pc.decodeReply(h.Flags, body) // buffered
		}
	}
	return nil
}

// acquire takes a credit for one Send, waiting for one while
// none is left (until ctx ends or the link dies). reserve lets a
// credit-only frame take the reserved slot.
func (l *link) acquire(ctx context.Context, reserve bool) error {
	f := l.fr
	for {
		f.mu.Lock()
		switch {
		case f.credits > 0:
			f.credits--
			f.outstanding++
			f.mu.Unlock()
			return nil
		case reserve && f.reserve > 0:
			f.reserve--
			f.outstanding++
			f.mu.Unlock()
			return nil
		}
		wake := f.wake
		f.mu.Unlock()
		select {
		case <-wake:
		case <-l.dead:
			return unavailable(l.failure)
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// refund gives back a credit taken for a frame that was never posted,
// with the returns and releases it would have carried.
func (f *framing) refund(returns uint32, ids, refs []uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.outstanding--
	if f.reserve == 0 {
		f.reserve = 1
	} else {
		f.credits++
	}
	f.unreturned += returns
	f.relIDs = append(f.relIDs, ids...)
	f.relRefs = append(f.relRefs, refs...)
	close(f.wake)
	f.wake = make(chan struct{})
}

// take takes the credits the next frame returns and up to room queued
// releases; refs, the refs to cancel, only for a RELEASE frame.
func (f *framing) take(room int, refs bool) (uint32, []uint64, []uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.unreturned
	f.unreturned = 0
	k := min(room, len(f.relIDs))
	ids := slices.Clone(f.relIDs[:k])
	f.relIDs = f.relIDs[k:]
	var rs []uint64
	if refs {
		k := min(room-len(ids), len(f.relRefs))
		rs = slices.Clone(f.relRefs[:k])
		f.relRefs = f.relRefs[k:]
	}
	return n, ids, rs
}

// sendFrame sends one frame, waiting for a credit first: its body is raw
// and then msg, marshaled in place (either may be empty). A client's frame
// also carries the releases queued so far. posted reports whether the
// frame reached the queue pair (on error, the peer may or may not see it).
func (l *link) sendFrame(ctx context.Context, typ uint8, flags uint16, ref uint64, raw []byte, msg proto.Message) (posted bool, err error) {
	f := l.fr
	size := len(raw)
	if msg != nil {
		size += proto.Size(msg)
	}
	if frameHeaderLen+size > f.slotSize {
		return false, status.Errorf(codes.Internal, "tensorrpc: frame of %d bytes exceeds the %d-byte slot", frameHeaderLen+size, f.slotSize)
	}
	if err := l.acquire(ctx, typ == frameCredit); err != nil {
		return false, err
	}
	room := min((f.slotSize-frameHeaderLen-size)/8, maxReleases)
	if typ == frameCredit {
		room = 0
	}
	returns, ids, refs := f.take(room, typ == frameRelease)
	if typ == frameRelease {
		raw = appendReleases(raw, refs)
		size += 8 * len(refs)
	}
	n := size + 8*len(ids)
	buf, err := l.ctlPool.Alloc(ctx, frameHeaderLen+n)
	if err != nil {
		f.refund(returns, ids, refs)
		return false, status.Errorf(codes.ResourceExhausted, "tensorrpc: frame buffer: %v", err)
	}
	b := buf.Bytes()[:frameHeaderLen+n]
	body := append(b[frameHeaderLen:frameHeaderLen], raw...)
	if msg != nil {
		body, err = proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(body, msg)
	}
	if err != nil || len(body) != size || (size > 0 && &body[0] != &b[frameHeaderLen]) {
		buf.Release()
		f.refund(returns, ids, refs)
		return false, status.Errorf(codes.Internal, "tensorrpc: encoding a frame: %d of %d bytes: %v", len(body), size, err)
	}
	appendReleases(body[len(body):len(body)], ids)
	putFrameHeader(b, frameHeader{Type: typ, Flags: flags, Ref: ref, Credits: returns, Releases: uint16(len(ids))}, n)
	local, err := l.dev.ctl.Local(buf)
	if err != nil {
		buf.Release()
		f.refund(returns, ids, refs)
		return false, status.Error(codes.Internal, err.Error())
	}
	local.Length = len(b)
	posted = true
	err = l.postWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, func() { buf.Release() }, false, func() {
		posted = false
		f.refund(returns, ids, refs)
	})
	if err == nil {
		buf.Release()
	}
	return posted, err
}

// trySendFrame is sendFrame for the polling goroutine: it never waits. It
// sends only when a credit and a buffer are at hand, and it does not wait
// for the Send's completion (the buffer goes back when it completes). It
// reports whether the frame was posted; when not, nothing was taken.
func (l *link) trySendFrame(typ uint8, flags uint16, ref uint64, raw []byte, msg proto.Message) bool {
	f := l.fr
	size := len(raw)
	if msg != nil {
		size += proto.Size(msg)
	}
	if frameHeaderLen+size > f.slotSize {
		return false
	}
	f.mu.Lock()
	if f.credits == 0 {
		f.mu.Unlock()
		return false
	}
	f.credits--
	f.outstanding++
	f.mu.Unlock()
	returns, ids, refs := f.take(0, false)
	buf, err := l.ctlPool.TryAlloc(frameHeaderLen + size)
	if err != nil {
		f.refund(returns, ids, refs)
		return false
	}
	b := buf.Bytes()[:frameHeaderLen+size]
	body := append(b[frameHeaderLen:frameHeaderLen], raw...)
	if msg != nil {
		body, err = proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(body, msg)
	}
	local, lerr := l.dev.ctl.Local(buf)
	if err != nil || lerr != nil || len(body) != size || (size > 0 && &body[0] != &b[frameHeaderLen]) {
		buf.Release()
		f.refund(returns, ids, refs)
		return false
	}
	putFrameHeader(b, frameHeader{Type: typ, Flags: flags, Ref: ref, Credits: returns}, size)
	local.Length = len(b)
	if err := l.postAsync(verbs.SendRequest{Op: verbs.OpSend, Local: local}, func(verbs.Completion) { buf.Release() }); err != nil {
		buf.Release()
		f.refund(returns, ids, refs)
		return false
	}
	return true
}

// creditor sends a credit-only frame whenever the polling goroutine finds
// half the slots unreturned, one at a time.
func (l *link) creditor(ctx context.Context) {
	defer l.wg.Done()
	f := l.fr
	for {
		select {
		case <-f.kick:
		case <-ctx.Done():
			return
		}
		f.mu.Lock()
		enough := f.unreturned >= frameSlots/2
		f.mu.Unlock()
		if !enough {
			continue // a frame returned them meanwhile
		}
		if _, err := l.sendFrame(ctx, frameCredit, 0, 0, nil, nil); err != nil && ctx.Err() == nil {
			return
		}
	}
}

// queueRelease queues a transfer id to release or a ref to cancel (client
// side); the next frame carries it, or a RELEASE frame soon.
func (f *framing) queueRelease(id, ref uint64) {
	f.mu.Lock()
	if id != 0 {
		f.relIDs = append(f.relIDs, id)
	}
	if ref != 0 {
		f.relRefs = append(f.relRefs, ref)
	}
	f.mu.Unlock()
	select {
	case f.flush <- struct{}{}:
	default:
	}
}

// releaser sends what is queued for release when no other frame took it
// along: after letting the goroutines that may be about to send a frame
// run first.
func (l *link) releaser(ctx context.Context) {
	defer l.wg.Done()
	f := l.fr
	for {
		select {
		case <-f.flush:
		case <-ctx.Done():
			return
		}
		runtime.Gosched()
		l.flushReleases(ctx) // on error the link is dead or closing: the session's end frees everything
	}
}

// flushReleases sends what is queued for release now, in RELEASE frames,
// until nothing is left or ctx ends or the link fails.
func (l *link) flushReleases(ctx context.Context) {
	f := l.fr
	for {
		f.mu.Lock()
		left := len(f.relIDs) + len(f.relRefs)
		f.mu.Unlock()
		if left == 0 {
			return
		}
		if _, err := l.sendFrame(ctx, frameRelease, 0, 0, nil, nil); err != nil {
			return
		}
	}
}

// expect registers a request awaiting the response frame of type want for
// ref, whose body decodes into what into returns.
func (f *framing) expect(ref uint64, want uint8, into func(flags uint16) proto.Message) *pendingCall {
	pc := &pendingCall{ch: make(chan frameReply, 1), want: want, into: into}
	f.mu.Lock()
	f.pending[ref] = pc
	f.mu.Unlock()
	return pc
}

// forget drops a request's registration.
func (f *framing) forget(ref uint64) {
	f.mu.Lock()
	delete(f.pending, ref)
	f.mu.Unlock()
}

// abandon is for a caller that stops waiting for pc's response: late runs
// when the response arrives, or when the link closes; at once when the
// response has arrived already.
//
// It reports whether more than maxAbandoned requests now wait so: a server
// answers every request, its calls under way are bounded, and what an
// abandoned request holds (its grants, its source buffers) stays until the
// answer, so a server that leaves that many unanswered holds the client's
// memory: the caller then ends the session, which frees it all.
func (f *framing) abandon(ref uint64, pc *pendingCall, late func()) (tooMany bool) {
	if late == nil {
		f.forget(ref)
		return false
	}
	f.mu.Lock()
	if f.pending[ref] == pc {
		pc.late = late
		f.abandoned++
		tooMany = f.abandoned > f.maxAbandon
		f.mu.Unlock()
		return tooMany
	}
	f.mu.Unlock()
	late()
	return false
}

// maxAbandoned bounds the requests a client abandoned (cancelled) whose
// answers have not come: more than a server may have under way and
// refusing (2 × maxFrameCalls per session), with room to spare.
const maxAbandoned = 4 * maxFrameCalls

// abandon is framing.abandon on l's requests; when the server has left
// too many of them unanswered, it fails l, which ends the session.
func (l *link) abandon(ref uint64, pc *pendingCall, late func()) {
	if l.fr.abandon(ref, pc, late) {
		l.fail(status.Errorf(codes.Unavailable, "tensorrpc: the server left more than %d cancelled calls unanswered, holding what they granted; the session is ended to free it", l.fr.maxAbandon))
	}
}

// closePending runs the late work of every abandoned request, once the
// link is closed.
func (f *framing) closePending() {
	f.mu.Lock()
	left := f.pending
	f.pending = map[uint64]*pendingCall{}
	f.mu.Unlock()
	for _, pc := range left {
		if pc.late != nil {
			pc.late()
		}
	}
}
