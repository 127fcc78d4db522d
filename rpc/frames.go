package rpc

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Receive slots and credits of a link that carries frames (see frame.go).
//
// Each side posts frameSlots Recvs, each at its own slot of slotSize bytes
// from the control pool. Every Send (a frame) and every WriteImm the peer
// posts consumes one of them, so a side may post one only while it holds a
// credit: it starts with frameSlots-1 and one reserved slot that only a
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
// threshold (HandshakeResponse.eager_threshold).
func slotSizeFor(eager int) int {
	n := min(max(eager, 0), maxFrameInline) + frameSlack
	return (n + 255) &^ 255
}

// frameInline is the largest tensor a FETCH_RESP carries inline.
func frameInline(eager int) int { return min(max(eager, 0), maxFrameInline) }

// framing is a link's frame state.
type framing struct {
	slotSize int
	slots    []*mempool.Buffer
	// serve handles a FETCH_REQ (server side; nil on a client, which
	// refuses requests). It must not block.
	serve func(h frameHeader, key string)

	mu          sync.Mutex
	credits     int // Sends and WriteImms this side may post
	reserve     int // 0 or 1: the slot kept for credit-only frames
	outstanding int // posted and not yet returned by the peer
	unreturned  uint32
	wake        chan struct{} // closed when credits come back
	pending     map[uint64]chan fetchResult

	kick   chan struct{} // asks the creditor for a credit-only frame
	cancel context.CancelFunc
	credit *mempool.Buffer // the credit-only frame's buffer
}

// enableFrames makes the link carry frames with slots of slotSize bytes;
// serve (server side) handles requests. Call it before connect.
func (l *link) enableFrames(slotSize int, serve func(frameHeader, string)) {
	l.fr = &framing{
		slotSize: slotSize, serve: serve, credits: frameSlots - 1, reserve: 1,
		wake: make(chan struct{}), pending: map[uint64]chan fetchResult{}, kick: make(chan struct{}, 1),
	}
}

// postSlots allocates the slots and posts them; it starts the creditor.
func (l *link) postSlots(ctx context.Context) error {
	f := l.fr
	for range frameSlots {
		b, err := l.ctlPool.Alloc(ctx, f.slotSize)
		if err != nil {
			return err
		}
		f.slots = append(f.slots, b)
	}
	b, err := l.ctlPool.Alloc(ctx, frameHeaderLen)
	if err != nil {
		return err
	}
	f.credit = b
	for i := range f.slots {
		if err := l.postSlot(uint64(i)); err != nil {
			return err
		}
	}
	cctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	l.wg.Add(1)
	go l.creditor(cctx)
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
	if f.credit != nil {
		f.credit.Release()
		f.credit = nil
	}
}

// completeSlot handles a Recv completion of a framing link, in the polling
// goroutine: the verifying message, a frame, or a WriteImm; then it
// reposts the slot.
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
	case verified && l.onRecv != nil:
		l.onRecv(c)
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
	h, payload, err := decodeFrame(b)
	if err != nil {
		return err
	}
	f := l.fr
	f.mu.Lock()
	if int64(h.credits) > int64(f.outstanding) {
		f.mu.Unlock()
		return fmt.Errorf("%d credits returned, %d outstanding", h.credits, f.outstanding)
	}
	if h.credits > 0 {
		n := int(h.credits)
		f.outstanding -= n
		if f.reserve == 0 {
			f.reserve, n = 1, n-1
		}
		f.credits += n
		close(f.wake)
		f.wake = make(chan struct{})
	}
	f.mu.Unlock()
	switch h.typ {
	case frameFetchReq:
		if f.serve == nil {
			return fmt.Errorf("%w: a request to the client", errFrame)
		}
		f.serve(h, string(payload))
	case frameFetchResp:
		if f.serve != nil {
			return fmt.Errorf("%w: a response to the server", errFrame)
		}
		r, err := decodeFetchResp(payload)
		if err != nil {
			return err
		}
		r.fallback = h.flags&frameFallback != 0
		f.mu.Lock()
		ch, ok := f.pending[h.ref]
		delete(f.pending, h.ref)
		f.mu.Unlock()
		if ok {
			ch <- r // buffered
		}
	}
	return nil
}

// acquire takes a credit for one Send or WriteImm, waiting for one while
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

// refund gives back a credit taken for a request that was never posted,
// and the returns its frame would have carried.
func (f *framing) refund(returns uint32) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.outstanding--
	if f.reserve == 0 {
		f.reserve = 1
	} else {
		f.credits++
	}
	f.unreturned += returns
	close(f.wake)
	f.wake = make(chan struct{})
}

// takeReturns is the credits the next frame returns.
func (f *framing) takeReturns() uint32 {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.unreturned
	f.unreturned = 0
	return n
}

// sendFrame sends one frame, waiting for a credit first.
func (l *link) sendFrame(ctx context.Context, typ uint8, flags uint16, ref uint64, payload []byte) error {
	f := l.fr
	if frameHeaderLen+len(payload) > f.slotSize {
		return status.Errorf(codes.Internal, "tensorrpc: frame of %d bytes exceeds the %d-byte slot", frameHeaderLen+len(payload), f.slotSize)
	}
	if err := l.acquire(ctx, false); err != nil {
		return err
	}
	buf, err := l.ctlPool.Alloc(ctx, frameHeaderLen+len(payload))
	if err != nil {
		f.refund(0)
		return status.Errorf(codes.ResourceExhausted, "tensorrpc: frame buffer: %v", err)
	}
	b := buf.Bytes()[:frameHeaderLen+len(payload)]
	copy(b[frameHeaderLen:], payload)
	returns := f.takeReturns()
	putFrameHeader(b, frameHeader{typ: typ, flags: flags, ref: ref, credits: returns}, len(payload))
	local, err := l.dev.ctl.Local(buf)
	if err != nil {
		buf.Release()
		return status.Error(codes.Internal, err.Error())
	}
	local.Length = len(b)
	if err := l.postWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, func() { buf.Release() }, false, func() { f.refund(returns) }); err != nil {
		return err
	}
	buf.Release()
	return nil
}

// creditor sends a credit-only frame whenever the polling goroutine finds
// half the slots unreturned, one at a time, from the link's own buffer.
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
		if err := l.acquire(ctx, true); err != nil {
			return
		}
		b := f.credit.Bytes()[:frameHeaderLen]
		returns := f.takeReturns()
		putFrameHeader(b, frameHeader{typ: frameCredit, credits: returns}, 0)
		local, err := l.dev.ctl.Local(f.credit)
		if err != nil {
			l.fail(err)
			return
		}
		local.Length = frameHeaderLen
		if err := l.postWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, nil, false, func() { f.refund(returns) }); err != nil {
			return
		}
	}
}

// expect registers a call awaiting the FETCH_RESP for ref.
func (f *framing) expect(ref uint64) chan fetchResult {
	ch := make(chan fetchResult, 1)
	f.mu.Lock()
	f.pending[ref] = ch
	f.mu.Unlock()
	return ch
}

// forget drops a call's registration.
func (f *framing) forget(ref uint64) {
	f.mu.Lock()
	delete(f.pending, ref)
	f.mu.Unlock()
}
