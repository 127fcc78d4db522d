package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Receive slots and credits of a link that carries frames (see frame.go).
//
// Each side posts FrameSlots Recvs, each at its own slot of slotSize bytes
// from the control pool. Every Send (a frame) the peer posts consumes one
// of them, so a side may post one only while it holds a credit: it starts with FrameSlots-1 and one reserved slot that only a
// credit-only frame may use, so returning credits never deadlocks. A side
// returns the slots it reposted in the header of every frame it sends, and
// sends a credit-only frame when it holds FrameSlots/2 unreturned ones.
const (
	FrameSlots = 32
	// maxFrameInline bounds the tensors a FETCH_RESP carries inline, so a
	// large eager threshold does not make every slot large.
	maxFrameInline = 64 << 10
	// frameSlack is a slot's room for the header, key and metadata.
	frameSlack = 4 << 10
)

// SlotSizeFor is the slot size both sides derive from the session's eager
// threshold (HandshakeResponse.eager_threshold): room for the inline
// tensors, or at least for a request's metadata (MaxFrameMetadataBytes),
// and the slack.
func SlotSizeFor(eager int) int {
	n := max(min(max(eager, 0), maxFrameInline), MaxFrameMetadataBytes+16) + frameSlack
	return (n + 255) &^ 255
}

// FrameInline is the largest tensor a FETCH_RESP carries inline.
func FrameInline(eager int) int { return min(max(eager, 0), maxFrameInline) }

// Framing is a link's frame state.
type Framing struct {
	SlotSize int
	slots    []*mempool.Buffer
	// serve handles a request frame (server side; nil on a client, which
	// refuses requests). It runs where completions are handled (see
	// Link.poll): it must copy body if it keeps it, and must not block. releases receives the
	// transfer ids a client's frame carried: it takes them off the
	// session's books at once and returns what is left to do (revoking
	// their grants, releasing their buffers), or nil; see HandleFrame.
	serve    func(h frameHeader, body []byte)
	releases func(ids []uint64) (finish func())

	Received   atomic.Uint64 // frames received, for Stats and tests
	Indirect   atomic.Uint64 // of which with frameIndirect, for tests
	ReleasedIn atomic.Uint64 // transfer ids released by the peer's frames on this lane, for tests

	Mu          sync.Mutex
	Credits     int // Sends this side may post
	reserve     int // 0 or 1: the slot kept for credit-only frames
	Outstanding int // posted and not yet returned by the peer
	Unreturned  uint32
	wake        chan struct{} // closed when credits come back to waiters
	waiting     int           // Acquires waiting on wake (wakeLocked)
	Pending     map[uint64]*PendingCall
	inflight    atomic.Int32 // len(Pending), kept under Mu and read without it (InFlight)
	abandoned   int          // pending requests whose callers stopped waiting
	MaxAbandon  int          // maxAbandoned; tests lower it
	// Client side: transfer ids to release and refs to cancel, sent with
	// the next frame or, when none goes out soon, in a RELEASE frame.
	relIDs  []uint64
	relRefs []uint64

	kick   chan struct{} // asks the creditor for a credit-only frame
	flush  chan struct{} // asks the releaser for a RELEASE frame
	cancel chan struct{} // the same, for a queued cancellation (CancelDelay)
	Cancel context.CancelFunc
}

// FrameReply is a response frame, decoded where completions are handled (so
// the slot's bytes are copied once, by protobuf): the status it carries
// (nil for OK) and on OK the body, or bad when the server broke the format.
type FrameReply struct {
	Flags  uint16
	Status error
	Msg    proto.Message
	Bad    error
}

// FrameUnmarshaler is a response message that decodes a frame's body
// itself rather than through proto.Unmarshal (which copies each bytes
// field into new memory): a Fetch's answer, whose inline tensor goes
// into reused memory.
type FrameUnmarshaler interface {
	proto.Message
	UnmarshalFrame(body []byte) error
}

// FrameMarshaler is a message that encodes itself into a frame's body,
// faster than proto.Marshal, into what proto.Marshal would write (package
// rpc's small calls' bodies).
type FrameMarshaler interface {
	proto.Message
	// FrameSize is the length of the encoding; AppendFrame appends it.
	FrameSize() int
	AppendFrame(b []byte) []byte
}

// MessageSize is the length of msg's encoding in a frame (0 for nil).
func MessageSize(msg proto.Message) int {
	if msg == nil {
		return 0
	}
	if m, ok := msg.(FrameMarshaler); ok {
		return m.FrameSize()
	}
	return proto.Size(msg)
}

// AppendMessage appends msg's encoding, of MessageSize's length, to b.
// msg's sizes must be as MessageSize left them (it caches protobuf's).
func AppendMessage(b []byte, msg proto.Message) ([]byte, error) {
	if m, ok := msg.(FrameMarshaler); ok {
		return m.AppendFrame(b), nil
	}
	return proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(b, msg)
}

// PendingCall is a request frame awaiting its response; into says what
// the response's body decodes into, by its flags. Once its caller has
// stopped waiting, late holds what the caller leaves to do when the
// response arrives or the link closes (revoke what it granted).
type PendingCall struct {
	// Ch receives once the answer is in (Deliver): Reply then has it. A
	// channel of empty values is one allocation where one of FrameReply,
	// which holds pointers, is two.
	Ch    chan struct{}
	reply FrameReply
	Want  uint8 // the response's type
	Into  func(flags uint16) proto.Message
	late  func()
	// bell, when set, is rung after the answer is in Ch (awaitBell).
	bell atomic.Pointer[bell]
	// tbell, when set, is rung instead: its caller is locked to its
	// thread (awaitBell).
	tbell atomic.Pointer[threadBell]
}

// Deliver hands pc its answer: once, by whoever took pc from Pending.
func (pc *PendingCall) Deliver(r FrameReply) {
	pc.reply = r
	pc.Ch <- struct{}{} // buffered
}

// Reply is the answer Deliver gave, for one that received from Ch.
func (pc *PendingCall) Reply() FrameReply { return pc.reply }

// decodeReply decodes a response frame's body for pc.
func (pc *PendingCall) decodeReply(flags uint16, body []byte) FrameReply {
	r := FrameReply{Flags: flags}
	st, rest, err := DecodeStatus(body)
	switch {
	case err != nil:
		r.Bad = err
	case st != nil:
		r.Status = st
	default:
		m := pc.Into(flags)
		var err error
		if u, ok := m.(FrameUnmarshaler); ok {
			err = u.UnmarshalFrame(rest)
		} else {
			err = proto.Unmarshal(rest, m)
		}
		if err != nil {
			r.Bad = fmt.Errorf("%w: %v", errFrame, err)
		}
		r.Msg = m
	}
	return r
}

// EnableFrames makes the link carry frames with slots of slotSize bytes;
// serve and releases (server side) handle requests. Call it before
// connect.
func (l *Link) EnableFrames(slotSize int, serve func(frameHeader, []byte), releases func([]uint64) (finish func())) {
	l.Frames = &Framing{
		SlotSize: slotSize, serve: serve, releases: releases, Credits: FrameSlots - 1, reserve: 1, MaxAbandon: MaxAbandoned,
		wake: make(chan struct{}), Pending: map[uint64]*PendingCall{}, kick: make(chan struct{}, 1), flush: make(chan struct{}, 1), cancel: make(chan struct{}, 1),
	}
}

// postSlots allocates the slots and posts them; it starts the creditor.
// It never waits for the control pool (a session gets only the lanes whose
// slots fit: lanesAllowed), so a full one fails the link at once.
func (l *Link) postSlots(ctx context.Context) error {
	f := l.Frames
	if err := allocSlots(l.CtlPool, f); err != nil {
		return err
	}
	for i := range f.slots {
		if err := l.postSlot(uint64(i)); err != nil {
			return err
		}
	}
	cctx, cancel := context.WithCancel(context.Background())
	f.Cancel = cancel
	l.wg.Add(1)
	go l.creditor(cctx)
	if f.serve == nil {
		l.wg.Add(1)
		go l.releaser(cctx)
	}
	return nil
}

func (l *Link) postSlot(i uint64) error {
	local, err := l.Domain.Ctl.Local(l.Frames.slots[i])
	if err != nil {
		return err
	}
	return postRecv(l.QP, verbs.RecvRequest{ID: i, Local: local})
}

// releaseSlots frees the framing's buffers once the queue pair is closed.
func (f *Framing) releaseSlots() {
	if f.Cancel != nil {
		f.Cancel()
	}
	for _, b := range f.slots {
		b.Release()
	}
	f.slots = nil
}

// completeSlot handles a Recv completion (see Link.poll for where): the
// verifying message or a frame; then it reposts the slot. A write with
// immediate, which the protocol never sends, fails the link.
func (l *Link) completeSlot(c verbs.Completion) {
	f := l.Frames
	if c.ID >= uint64(len(f.slots)) || (c.Op == verbs.OpRecv && (c.Len > f.SlotSize || c.Len < 0)) {
		l.Fail(fmt.Errorf("receive completion for slot %d of %d bytes", c.ID, c.Len))
		return
	}
	verified := l.Verified.Load()
	var err error
	switch {
	case !verified && c.Op == verbs.OpRecv:
		data := f.slots[c.ID].Bytes()[:c.Len]
		select {
		case l.verifyCh <- append([]byte(nil), data[:min(len(data), verifyBytes)]...):
		default:
		}
	case verified && c.Op == verbs.OpRecv:
		err = l.HandleFrame(f.slots[c.ID].Bytes()[:c.Len])
	case c.Op == verbs.OpRecvImm:
		err = errors.New("a write with immediate, which frames never use")
	}
	if err != nil {
		l.Fail(fmt.Errorf("peer broke the frame protocol: %w", err))
		return
	}
	if err := l.postSlot(c.ID); err != nil {
		l.Fail(fmt.Errorf("reposting a receive: %w", err))
		return
	}
	if verified {
		f.Mu.Lock()
		f.Unreturned++
		kick := f.Unreturned >= FrameSlots/2
		f.Mu.Unlock()
		if kick {
			f.kickCreditor()
		}
	}
}

// HandleFrame decodes and dispatches one received frame.
func (l *Link) HandleFrame(b []byte) error {
	h, body, releases, err := DecodeFrame(b)
	if err != nil {
		return err
	}
	f := l.Frames
	f.Received.Add(1)
	if h.Flags&frameIndirect != 0 {
		f.Indirect.Add(1)
	}
	f.Mu.Lock()
	if int64(h.Credits) > int64(f.Outstanding) {
		f.Mu.Unlock()
		return fmt.Errorf("%d credits returned, %d outstanding", h.Credits, f.Outstanding)
	}
	if h.Credits > 0 {
		n := int(h.Credits)
		f.Outstanding -= n
		if f.reserve == 0 {
			f.reserve, n = 1, n-1
		}
		f.Credits += n
		f.wakeLocked()
	}
	f.Mu.Unlock()
	server := f.serve != nil
	if len(releases) > 0 || h.Type == frameRelease {
		if !server {
			return fmt.Errorf("%w: releases sent to the client", errFrame)
		}
		if ids := ReadU64s(releases); len(ids) > 0 {
			f.ReleasedIn.Add(uint64(len(ids)))
			if finish := f.releases(ids); finish != nil {
				if h.Type == frameFetchReq {
					// The transfers are off the books already (the
					// session's bound and its refs see them gone); their
					// grants are revoked once the Fetch they came with is
					// answered, not before: a client fetching in a loop
					// releases each tensor with its next request, and on
					// shm revoking first put the revocation's message
					// ahead of the answer, and its handling ahead of the
					// client's copy (shm Fetch p50 1 MiB 63.8 -> 57.5
					// µs, 4 MiB 443 -> 193, 2-core VM). Serving a Fetch
					// never waits (serve must not block) nor needs the
					// memory they free.
					defer finish()
				} else {
					finish()
				}
			}
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
		f.Mu.Lock()
		pc, ok := f.Pending[h.Ref]
		if ok && pc.Want != h.Type {
			f.Mu.Unlock()
			return fmt.Errorf("%w: a response of type %d to a request awaiting type %d", errFrame, h.Type, pc.Want)
		}
		delete(f.Pending, h.Ref)
		f.inflight.Store(int32(len(f.Pending)))
		if ok && pc.late != nil {
			f.abandoned--
		}
		f.Mu.Unlock()
		switch {
		case !ok:
		case pc.late != nil:
			l.wg.Add(1) // the polling goroutine is counted until the queue pair is closed: close waits for this
			go func() {
				defer l.wg.Done()
				pc.late()
			}()
		default:
			pc.Deliver(pc.decodeReply(h.Flags, body))
			if b := pc.bell.Load(); b != nil {
				b.ring()
			} else if b := pc.tbell.Load(); b != nil {
				b.ring()
			}
		}
	}
	return nil
}

// Acquire takes a credit for one Send, waiting for one while
// none is left (until ctx ends or the link dies). reserve lets a
// credit-only frame take the reserved slot.
func (l *Link) Acquire(ctx context.Context, reserve bool) error {
	f := l.Frames
	for waited := false; ; waited = true {
		f.Mu.Lock()
		if waited {
			f.waiting--
		}
		switch {
		case f.Credits > 0:
			f.Credits--
			f.Outstanding++
			f.Mu.Unlock()
			return nil
		case reserve && f.reserve > 0:
			f.reserve--
			f.Outstanding++
			f.Mu.Unlock()
			return nil
		}
		wake := f.wake
		f.waiting++
		f.Mu.Unlock()
		var err error
		select {
		case <-wake:
			continue
		case <-l.Dead:
			err = Unavailable(l.Failure)
		case <-ctx.Done():
			err = status.FromContextError(ctx.Err()).Err()
		}
		f.Mu.Lock()
		f.waiting--
		f.Mu.Unlock()
		return err
	}
}

// Refund gives back a credit taken for a frame that was never posted,
// with the returns and releases it would have carried.
func (f *Framing) Refund(returns uint32, ids, refs []uint64) {
	f.Mu.Lock()
	defer f.Mu.Unlock()
	f.Outstanding--
	if f.reserve == 0 {
		f.reserve = 1
	} else {
		f.Credits++
	}
	f.Unreturned += returns
	f.relIDs = append(f.relIDs, ids...)
	f.relRefs = append(f.relRefs, refs...)
	f.wakeLocked()
}

// wakeLocked wakes the Acquires waiting for credits, if any (a new
// channel only then: credits come back with every frame). The caller
// holds f.Mu.
func (f *Framing) wakeLocked() {
	if f.waiting > 0 {
		close(f.wake)
		f.wake = make(chan struct{})
	}
}

// take takes the credits the next frame returns and up to room queued
// releases; refs, the refs to cancel, only for a RELEASE frame.
func (f *Framing) take(room int, refs bool) (uint32, []uint64, []uint64) {
	f.Mu.Lock()
	defer f.Mu.Unlock()
	n := f.Unreturned
	f.Unreturned = 0
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

// SendFrame sends one frame, waiting for a credit first: its body is raw
// and then msg, marshaled in place (either may be empty). A client's frame
// also carries the releases queued so far. posted reports whether the
// frame reached the queue pair (on error, the peer may or may not see it).
func (l *Link) SendFrame(ctx context.Context, typ uint8, flags uint16, ref uint64, raw []byte, msg proto.Message) (posted bool, err error) {
	return l.sendFrame(ctx, typ, flags, ref, raw, msg, true, nil)
}

// PostFrame is SendFrame for a request whose answer the caller waits for:
// it returns once the frame is posted, without waiting for the Send's
// completion (its buffer goes back when it completes). A Send that fails
// fails the link, which the caller waiting for the answer sees (Dead); so
// the caller wakes once, for the answer, and not also for the Send's
// acknowledgement when it comes apart from the answer. sent, if not nil,
// runs once the Send has completed (or the link closed), where
// completions are handled, so it must never wait (see Link.poll); it
// runs only when the frame was posted.
func (l *Link) PostFrame(ctx context.Context, typ uint8, flags uint16, ref uint64, raw []byte, msg proto.Message, sent func()) (posted bool, err error) {
	return l.sendFrame(ctx, typ, flags, ref, raw, msg, false, sent)
}

func (l *Link) sendFrame(ctx context.Context, typ uint8, flags uint16, ref uint64, raw []byte, msg proto.Message, wait bool, sent func()) (posted bool, err error) {
	f := l.Frames
	size := len(raw)
	if msg != nil {
		size += MessageSize(msg)
	}
	if frameHeaderLen+size > f.SlotSize {
		return false, status.Errorf(codes.Internal, "tensorrpc: frame of %d bytes exceeds the %d-byte slot", frameHeaderLen+size, f.SlotSize)
	}
	if err := l.Acquire(ctx, typ == frameCredit); err != nil {
		return false, err
	}
	room := min((f.SlotSize-frameHeaderLen-size)/8, MaxReleases)
	if typ == frameCredit {
		room = 0
	}
	returns, ids, refs := f.take(room, typ == frameRelease)
	if typ == frameRelease {
		raw = AppendReleases(raw, refs)
		size += 8 * len(refs)
	}
	n := size + 8*len(ids)
	buf, err := l.CtlPool.Alloc(ctx, frameHeaderLen+n)
	if err != nil {
		f.Refund(returns, ids, refs)
		return false, status.Errorf(codes.ResourceExhausted, "tensorrpc: frame buffer: %v", err)
	}
	b := buf.Bytes()[:frameHeaderLen+n]
	body := append(b[frameHeaderLen:frameHeaderLen], raw...)
	if msg != nil {
		body, err = AppendMessage(body, msg)
	}
	if err != nil || len(body) != size || (size > 0 && &body[0] != &b[frameHeaderLen]) {
		buf.Release()
		f.Refund(returns, ids, refs)
		return false, status.Errorf(codes.Internal, "tensorrpc: encoding a frame: %d of %d bytes: %v", len(body), size, err)
	}
	AppendReleases(body[len(body):], ids)
	PutFrameHeader(b, frameHeader{Type: typ, Flags: flags, Ref: ref, Credits: returns, Releases: uint16(len(ids))}, n)
	local, err := l.Domain.Ctl.Local(buf)
	if err != nil {
		buf.Release()
		f.Refund(returns, ids, refs)
		return false, status.Error(codes.Internal, err.Error())
	}
	local.Length = len(b)
	if !wait {
		if err := l.postFrameBuf(local, buf, sent); err != nil {
			f.Refund(returns, ids, refs)
			switch {
			case errors.Is(err, verbs.ErrQueueFull):
				err = status.Errorf(codes.ResourceExhausted, "tensorrpc: data plane send queue full (%d outstanding): %v", SendDepth, err)
			case status.Code(err) == codes.Unknown:
				err = CompletionStatus(verbs.Completion{Op: verbs.OpSend, Status: verbs.StatusFlushed, Err: err})
			}
			return false, err
		}
		return true, nil
	}
	posted = true
	err = l.PostWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, func() { buf.Release() }, false, func() {
		posted = false
		f.Refund(returns, ids, refs)
	})
	if err == nil {
		buf.Release()
	}
	return posted, err
}

// TrySendFrame is sendFrame for where completions are handled: it never waits. It
// sends only when a credit and a buffer are at hand, and it does not wait
// for the Send's completion (the buffer goes back when it completes, and
// then sent runs, if not nil, as PostFrame's does). It reports whether the
// frame was posted; when not, nothing was taken and sent does not run.
func (l *Link) TrySendFrame(typ uint8, flags uint16, ref uint64, raw []byte, msg proto.Message, sent func()) bool {
	f := l.Frames
	size := len(raw)
	if msg != nil {
		size += MessageSize(msg)
	}
	if frameHeaderLen+size > f.SlotSize {
		return false
	}
	f.Mu.Lock()
	if f.Credits == 0 {
		f.Mu.Unlock()
		return false
	}
	f.Credits--
	f.Outstanding++
	f.Mu.Unlock()
	returns, ids, refs := f.take(0, false)
	buf, err := l.CtlPool.TryAlloc(frameHeaderLen + size)
	if err != nil {
		f.Refund(returns, ids, refs)
		return false
	}
	b := buf.Bytes()[:frameHeaderLen+size]
	body := append(b[frameHeaderLen:frameHeaderLen], raw...)
	if msg != nil {
		body, err = AppendMessage(body, msg)
	}
	local, lerr := l.Domain.Ctl.Local(buf)
	if err != nil || lerr != nil || len(body) != size || (size > 0 && &body[0] != &b[frameHeaderLen]) {
		buf.Release()
		f.Refund(returns, ids, refs)
		return false
	}
	PutFrameHeader(b, frameHeader{Type: typ, Flags: flags, Ref: ref, Credits: returns}, size)
	local.Length = len(b)
	if err := l.postFrameBuf(local, buf, sent); err != nil {
		f.Refund(returns, ids, refs)
		return false
	}
	return true
}

// postFrameBuf posts the Send of a frame in buf (local) without waiting
// for its completion, which nothing waits on (LazyCompletion): buf goes
// back when it completes, and then sent runs, if not nil. If the post
// fails, buf goes back at once and sent never runs.
func (l *Link) postFrameBuf(local verbs.Local, buf *mempool.Buffer, sent func()) error {
	w := frameWaiters.Get().(*Waiter)
	w.frame, w.sent = buf, sent
	err := l.postWaiter(verbs.SendRequest{Op: verbs.OpSend, Local: local, LazyCompletion: true}, w)
	if err != nil {
		// postWaiter took it off Waiters again: it is ours.
		*w = Waiter{}
		frameWaiters.Put(w)
		buf.Release()
	}
	return err
}

// creditor sends a credit-only frame whenever completion handling finds
// half the slots unreturned, one at a time.
func (l *Link) creditor(ctx context.Context) {
	defer l.wg.Done()
	f := l.Frames
	for {
		select {
		case <-f.kick:
		case <-ctx.Done():
			return
		}
		f.Mu.Lock()
		enough := f.Unreturned >= FrameSlots/2
		f.Mu.Unlock()
		if !enough {
			continue // a frame returned them meanwhile
		}
		if _, err := l.SendFrame(ctx, frameCredit, 0, 0, nil, nil); err != nil {
			select {
			case <-l.Dead:
				return // the session ends with its lane
			case <-ctx.Done():
				return
			case <-time.After(creditRetry):
				// A transient failure (a full send queue): the peer may
				// be waiting for these credits, so try again.
				f.kickCreditor()
			}
		}
	}
}

// creditRetry is how long the creditor waits before it tries again a
// credit-only frame that failed to post while the link lives.
const creditRetry = time.Millisecond

// kickCreditor asks the creditor for a credit-only frame.
func (f *Framing) kickCreditor() {
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// QueueRelease queues a transfer id to release or a ref to cancel (client
// side); the next frame carries it, or a RELEASE frame soon: within
// ReleaseDelay for a release, CancelDelay for a cancellation.
func (f *Framing) QueueRelease(id, ref uint64) {
	f.Mu.Lock()
	if id != 0 {
		f.relIDs = append(f.relIDs, id)
	}
	if ref != 0 {
		f.relRefs = append(f.relRefs, ref)
	}
	f.Mu.Unlock()
	ch := f.flush
	if ref != 0 {
		ch = f.cancel
	}
	select {
	case ch <- struct{}{}:
	default:
	}
}

// ReleaseDelay is how long queued releases wait for a frame to take them
// along before the releaser sends them in a RELEASE frame of their own. A
// caller that fetches again within it sends them with its request: the
// server then reads one frame, not two, and nobody is woken for the
// release (a goroutine woken per release cost a 1 MiB shm Fetch about a
// hand-off per call). The releaser then wakes once per ReleaseDelay at
// most, not once per release, and arms its timer as often: on a process
// with many Ps, arming a timer on a P that had none starts an idle one
// (the runtime's wakeNetPoller), so the delay bounds those starts too.
// At 500 µs, a stream of 1 MiB shm Fetches between goroutines of one
// process under GOMAXPROCS=16 (handoffs -size 1048576 -cases fetch-shm,
// 2-core VM) paid 0.19-0.26 idle-P starts and 0.11-0.14 hand-offs a
// call, 0.08 of each the releaser's; at 5 ms, 0.13-0.15 and 0.07-0.09. What
// it holds back is only server memory of tensors the client dropped
// while idle, freed 5 ms later (a Close flushes at once).
const ReleaseDelay = 5 * time.Millisecond

// CancelDelay is ReleaseDelay for a cancelled call's ref: the server's
// handler hears of the cancellation within it.
const CancelDelay = 500 * time.Microsecond

// releaseDelay and cancelDelay are the delays the releasers use (tests
// change them before a link starts).
var releaseDelay, cancelDelay = ReleaseDelay, CancelDelay

// releaser sends what is queued for release when no other frame took it
// along within ReleaseDelay (CancelDelay for a cancellation).
func (l *Link) releaser(ctx context.Context) {
	defer l.wg.Done()
	f := l.Frames
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		delay := releaseDelay
		select {
		case <-f.flush:
		case <-f.cancel:
			delay = cancelDelay
		case <-ctx.Done():
			return
		}
		t.Reset(delay)
		due := time.Now().Add(delay)
		for waiting := true; waiting; {
			select {
			case <-t.C:
				waiting = false
			case <-f.cancel:
				// A cancellation cuts the wait short.
				if left := time.Until(due); left > cancelDelay {
					due = due.Add(cancelDelay - left)
					t.Reset(cancelDelay)
				}
			case <-ctx.Done():
				return
			}
		}
		select { // what this flush takes along needs no other
		case <-f.flush:
		default:
		}
		l.FlushReleases(ctx) // on error the link is dead or closing: the session's end frees everything
	}
}

// FlushReleases sends what is queued for release now, in RELEASE frames,
// until nothing is left or ctx ends or the link fails.
func (l *Link) FlushReleases(ctx context.Context) {
	f := l.Frames
	for {
		f.Mu.Lock()
		left := len(f.relIDs) + len(f.relRefs)
		f.Mu.Unlock()
		if left == 0 {
			return
		}
		if _, err := l.SendFrame(ctx, frameRelease, 0, 0, nil, nil); err != nil {
			return
		}
	}
}

// Expect registers a request awaiting the response frame of type want for
// ref, whose body decodes into what into returns.
func (f *Framing) Expect(ref uint64, want uint8, into func(flags uint16) proto.Message) *PendingCall {
	pc := &PendingCall{Ch: make(chan struct{}, 1), Want: want, Into: into}
	f.Mu.Lock()
	f.Pending[ref] = pc
	f.inflight.Store(int32(len(f.Pending)))
	f.Mu.Unlock()
	return pc
}

// InFlight is the number of requests awaiting their answers (abandoned
// ones included), read without a lock.
func (f *Framing) InFlight() int { return int(f.inflight.Load()) }

// Forget drops a request's registration.
func (f *Framing) Forget(ref uint64) {
	f.Mu.Lock()
	delete(f.Pending, ref)
	f.inflight.Store(int32(len(f.Pending)))
	f.Mu.Unlock()
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
func (f *Framing) abandon(ref uint64, pc *PendingCall, late func()) (tooMany bool) {
	if late == nil {
		f.Forget(ref)
		return false
	}
	f.Mu.Lock()
	if f.Pending[ref] == pc {
		pc.late = late
		f.abandoned++
		tooMany = f.abandoned > f.MaxAbandon
		f.Mu.Unlock()
		return tooMany
	}
	f.Mu.Unlock()
	late()
	return false
}

// MaxAbandoned bounds the requests a client abandoned (cancelled) whose
// answers have not come: more than a server may have under way and
// refusing (2 × MaxFrameCalls per session), with room to spare.
const MaxAbandoned = 4 * MaxFrameCalls

// Abandon is framing.Abandon on l's requests; when the server has left
// too many of them unanswered, it fails l, which ends the session.
func (l *Link) Abandon(ref uint64, pc *PendingCall, late func()) {
	if l.Frames.abandon(ref, pc, late) {
		l.Fail(status.Errorf(codes.Unavailable, "tensorrpc: the server left more than %d cancelled calls unanswered, holding what they granted; the session is ended to free it", l.Frames.MaxAbandon))
	}
}

// closePending runs the late work of every abandoned request, once the
// link is closed.
func (f *Framing) closePending() {
	f.Mu.Lock()
	left := f.Pending
	f.Pending = map[uint64]*PendingCall{}
	f.inflight.Store(0)
	f.Mu.Unlock()
	for _, pc := range left {
		if pc.late != nil {
			pc.late()
		}
	}
}

// slotsMu serialises the allocation of receive slots. TryAlloc does not
// wait for an arena another allocation is mapping: it maps one more, and
// the lanes of a session connect at once, so without it a burst of them
// would map arenas of doubling sizes up to the control pool's limit and
// refuse one another with the pool nearly empty.
var slotsMu sync.Mutex

// allocSlots allocates f's receive slots from ctl without waiting for
// memory (postSlots): a full control pool refuses the lane.
func allocSlots(ctl *mempool.Pool, f *Framing) error {
	slotsMu.Lock()
	defer slotsMu.Unlock()
	for range FrameSlots {
		b, err := ctl.TryAlloc(f.SlotSize)
		if err != nil {
			return status.Errorf(codes.ResourceExhausted, "tensorrpc: receive slots: control pool: %v", err)
		}
		f.slots = append(f.slots, b)
	}
	return nil
}

// MaxFrameCalls bounds the calls a session may have under way as frames
// (each is a goroutine, and a waiting Fetch a rendezvous waiter); more
// are answered ResourceExhausted.
const MaxFrameCalls = 1024

// MaxFrameMetadataBytes bounds the encoded metadata a call carries as a
// frame (rpc.MaxFrameMetadataBytes).
const MaxFrameMetadataBytes = 8 << 10

// QueuedReleases is how many releases f holds unsent.
func (f *Framing) QueuedReleases() int {
	f.Mu.Lock()
	defer f.Mu.Unlock()
	return len(f.relIDs) + len(f.relRefs)
}
