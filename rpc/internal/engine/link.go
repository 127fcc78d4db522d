package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// poolAccess is how pool arenas are registered on a data plane: for local
// access only. No key opens an arena; a peer reaches only what a transfer
// grants it (link.grant): one buffer, one right, its session's queue pair,
// until the transfer ends.
const poolAccess = verbs.AccessLocalWrite

// Domain is one opened transport, shared by every session of a Server or
// Client: its provider's protection domain and the registrations of the
// tensor and control pools.
type Domain struct {
	Name string
	PD   verbs.ProtectionDomain
	Reg  *verbs.PoolRegistration
	// Ctl is the control pool's registration: the links' own small
	// buffers, local access only.
	Ctl *verbs.PoolRegistration
	// caller caches registrations of caller memory (caller.go).
	caller callerCache
}

func OpenDomain(p verbs.Provider, pool, ctl *mempool.Pool) (*Domain, error) {
	if _, err := p.Devices(); err != nil {
		return nil, err
	}
	pd, err := p.Open("")
	if err != nil {
		return nil, err
	}
	reg, err := verbs.RegisterPool(pd, pool, poolAccess)
	if err != nil {
		pd.Close()
		return nil, err
	}
	ctlReg, err := verbs.RegisterPool(pd, ctl, verbs.AccessLocalWrite)
	if err != nil {
		reg.Close()
		pd.Close()
		return nil, err
	}
	return &Domain{Name: p.Name(), PD: pd, Reg: reg, Ctl: ctlReg}, nil
}

// Grant opens the first n bytes of buf to the link's peer with one right
// (verbs.AccessRemoteRead: the receiver always pulls), on this link's
// queue pair only.
func (l *Link) Grant(buf *mempool.Buffer, n int, access verbs.Access) (verbs.Grant, error) {
	mr, ok := l.Domain.Reg.Region(buf.Arena())
	if !ok {
		return nil, fmt.Errorf("tensorrpc: buffer's arena %d is not registered with %s", buf.Arena().ID(), l.Domain.Name)
	}
	return l.QP.Grant(mr, buf.Offset(), n, access)
}

func (d *Domain) Close() {
	d.caller.close()
	d.Ctl.Close()
	d.Reg.Close()
	d.PD.Close()
}

// NewControlPool makes the pool of the links' own buffers (receive and
// verifying-send buffers, 512 bytes a session; with frames, frameSlots
// receive slots of slotSizeFor(eager threshold) bytes, 640 KiB by default,
// and the frames being sent). It is separate from the
// tensor pool so that a full tensor pool (a peer hoarding memory) never
// stops new sessions from opening, and it is registered for local access
// only.
func NewControlPool() (*mempool.Pool, error) {
	return mempool.NewPool(mempool.WithBacking(mempool.BackingMemfd), mempool.WithName("tensorrpc-control"),
		mempool.WithArenaSize(1<<20), mempool.WithLimit(ControlPoolLimit), mempool.WithPinning(false))
}

// ControlPoolLimit bounds the control pool. Receive slots, which stay
// posted for a session's life, may take at most half of it (lanesAllowed):
// the rest is for the frames being sent, so sending never waits on slots.
const ControlPoolLimit = 256 << 20

// LanesAllowed is how many of want lanes a new session may have while the
// control pool's posted slots stay within half its limit: possibly none,
// since slots are never waited for (postSlots); the session is then
// refused (ResourceExhausted).
func LanesAllowed(ctl *mempool.Pool, want, slotSize int) int {
	perLane := int64(FrameSlots * slotSize)
	room := ControlPoolLimit/2 - ctl.Stats().InUse
	return max(0, min(want, int(room/perLane)))
}

// SendDepth bounds a link's outstanding work requests (Reads and the
// Sends of frames); its receive queue holds the frameSlots receive slots.
const SendDepth = 1024

// sendRoom is how many of the send queue's sendDepth entries requests
// that take no frame credit (Reads) may hold at once; beyond it they wait for one to complete. The
// rest is kept for the Sends of frames, which credits bound to frameSlots
// outstanding, so that a burst of Reads (a Call naming hundreds of
// tensors, many calls at once) never makes a response frame fail with a
// full queue: every request gets its response.
const sendRoom = SendDepth - 2*FrameSlots

// Link is one session's connected queue pair. Its completions, handled
// one at a time and in order (in the provider's receiver where the queue
// allows, else in the link's polling goroutine: see poll), go to the
// waiter that posted the work request, or, for a received frame, to the
// framing.
type Link struct {
	Domain *Domain
	QP     verbs.QueuePair
	cq     verbs.CompletionQueue
	out    *mempool.Buffer // a small buffer the verifying Send goes from
	// CtlPool is the control pool the link's buffers come from; fr (set by
	// enableFrames, before connect) carries the frames: its Recvs are
	// receive slots and its Sends need credits.
	CtlPool *mempool.Pool
	Frames  *Framing

	// Until Verified is set, received Sends are the negotiation's verifying
	// round trip: their bytes go to verifyCh instead of the framing.
	Verified atomic.Bool
	verifyCh chan []byte
	// Opened is set (server side) once the session is open on this lane:
	// from then on its frame calls are served. Read without a lock on
	// every frame call.
	Opened atomic.Bool

	NextID  atomic.Uint64
	Reads   atomic.Uint64 // Reads posted, for tests
	Mu      sync.Mutex
	Waiters map[uint64]*Waiter
	closed  bool
	shut    chan struct{} // closed when Close has finished
	Failure error         // the first fatal completion or closing reason
	Dead    chan struct{}
	wg      sync.WaitGroup
	// room holds a token for each request under way that counts against
	// sendRoom.
	room chan struct{}
	// bell (nil where the queue pair is a verbs.Poller, or not on Linux)
	// is what one caller at a time, the one that set belled, waits on for
	// its answer (awaitBell).
	bell   *bell
	tbell  *threadBell // the bell of callers locked to their threads
	belled atomic.Bool
	// answerWait is how long, lately, a locked caller on this link waited
	// for its answer (nanoseconds, a moving average; awaitBell).
	answerWait atomic.Int64
	// Squeeze is the session's compression of what this side reads
	// (nil: none), shared by its lanes; set before the session opens.
	Squeeze *Compression
	// rescue runs calls where their frames are read (RunRescued);
	// lastOfBatch says, to the goroutine handling completions, that the
	// one it handles is the last of its batch. Atomic: a delivery left
	// behind (rescue) still runs its call while the receiver it detached
	// from delivers the next batch in another goroutine; runHere reads it
	// only in the goroutine that wrote it, before its call.
	rescue      *rescue
	lastOfBatch atomic.Bool
	waiter      waitPoller // the Detacher of a queue polled with Wait
}

// Waiter receives the completion of one work request. When its poster
// stops waiting (its context ended), abandoned runs instead, so buffers the
// request still uses are freed only once the hardware is done with them.
//
// done, for PostAsync, runs instead of both, where the completion is
// handled: it must never wait (see poll).
type Waiter struct {
	Ch        chan verbs.Completion
	abandoned func(verbs.Completion)
	done      func(verbs.Completion)
	// frame, for a frame's Send nothing waits on (postFrameBuf): its
	// buffer, released as the Send completes, and then sent runs (if not
	// nil); without a closure a frame.
	frame *mempool.Buffer
	sent  func()
}

// finish runs what w does when its request completes (c), but for a
// plain waiter's channel and an abandoned one's: it reports whether it
// did.
func (w *Waiter) finish(c verbs.Completion) bool {
	switch {
	case w.done != nil:
		w.done(c)
	case w.frame != nil:
		// A frame's waiter is nobody's once its request completes (the
		// link took it off Waiters): it goes back to frameWaiters first.
		buf, sent := w.frame, w.sent
		*w = Waiter{}
		frameWaiters.Put(w)
		buf.Release()
		if sent != nil {
			sent()
		}
	default:
		return false
	}
	return true
}

// frameWaiters recycles the Waiters of frames' Sends (postFrameBuf), two
// a small call.
var frameWaiters = sync.Pool{New: func() any { return new(Waiter) }}

// verifyBytes is the size of the buffers of the verifying round trip; the
// message is the session id.
const verifyBytes = 64

// NewLink makes a queue pair on dom. local is this host's address on the
// session's gRPC connection (zero when unknown) and role who opens the data
// connection: the server accepts, the client dials, so a server never
// connects to an address a client named.
func NewLink(ctx context.Context, dom *Domain, ctl *mempool.Pool, local netip.Addr, role verbs.ConnectRole) (*Link, error) {
	cq, err := dom.PD.NewCompletionQueue(2 * (FrameSlots + SendDepth))
	if err != nil {
		return nil, err
	}
	qp, err := dom.PD.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: SendDepth, MaxRecv: FrameSlots, LocalAddress: local, Role: role})
	if err != nil {
		cq.Close()
		return nil, err
	}
	// Never a wait on the control pool: a full one refuses the link.
	out, err := ctl.TryAlloc(verifyBytes)
	if err != nil {
		err = status.Errorf(codes.ResourceExhausted, "tensorrpc: control pool: %v", err)
		qp.Close()
		cq.Close()
		return nil, err
	}
	l := &Link{Domain: dom, QP: qp, cq: cq, out: out, CtlPool: ctl, verifyCh: make(chan []byte, 1), Waiters: make(map[uint64]*Waiter), Dead: make(chan struct{}), shut: make(chan struct{}), room: make(chan struct{}, sendRoom)}
	if _, ok := qp.(verbs.Poller); !ok {
		l.bell = newBell()
		l.tbell = newThreadBell()
	}
	l.waiter.l = l
	var det verbs.Detacher = &l.waiter
	if _, ok := cq.(verbs.CompletionRunner); ok {
		det, _ = cq.(verbs.Detacher) // the provider's receiver hands over, or none
	}
	l.rescue = newRescue(det)
	return l, nil
}

// SendVerify Sends msg (at most verifyBytes) over the link and waits for
// its completion.
func (l *Link) SendVerify(ctx context.Context, msg []byte) error {
	if len(msg) > verifyBytes {
		return fmt.Errorf("verifying message of %d bytes", len(msg))
	}
	copy(l.out.Bytes(), msg)
	local, err := l.Domain.Ctl.Local(l.out)
	if err != nil {
		return err
	}
	local.Length = len(msg)
	return l.PostWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, nil, false, nil)
}

// RecvVerify waits for the peer's verifying message.
func (l *Link) RecvVerify(ctx context.Context) ([]byte, error) {
	select {
	case msg := <-l.verifyCh:
		return msg, nil
	case <-l.Dead:
		return nil, l.Failure
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Connect connects the queue pair, posts the receive slots (enableFrames
// comes first) and starts polling.
func (l *Link) Connect(ctx context.Context, remote []byte) error {
	if l.Frames == nil {
		return errors.New("tensorrpc: a link connected without frames")
	}
	if err := l.QP.Connect(ctx, remote); err != nil {
		return err
	}
	if err := l.postSlots(ctx); err != nil {
		return err
	}
	l.wg.Add(1)
	go l.poll()
	return nil
}

// poll hands every completion to complete until the queue is closed. On a
// queue that can run its completions where they are produced (tcp's and
// shm's: verbs.CompletionRunner), complete mostly runs in the provider's
// receiver, and this goroutine only takes what other goroutines produce;
// so complete, and all it calls, must never wait for the provider's
// progress (see verbs.CompletionRunner): what may wait goes to a goroutine
// of its own (see Waiter, HandleFrame, and package rpc's serveFrame).
func (l *Link) poll() {
	defer l.wg.Done()
	if r, ok := l.cq.(verbs.CompletionRunner); ok {
		r.Run(context.Background(), func(cs []verbs.Completion) {
			for i, c := range cs {
				l.lastOfBatch.Store(i == len(cs)-1)
				l.complete(c)
			}
		})
		return
	}
	l.pollWait()
}

// pollWait is poll for a queue without a CompletionRunner (ibv's): it
// waits for completions and handles them, until the queue is closed or a
// call it ran was left behind (waitPoller.Detach): another goroutine
// polls then, and this one leaves once that call returns.
func (l *Link) pollWait() {
	gen := l.waiter.gen.Load()
	batch := make([]verbs.Completion, 64)
	for {
		n, err := l.cq.Wait(context.Background(), batch)
		if err != nil {
			return // the queue was closed
		}
		for i, c := range batch[:n] {
			l.lastOfBatch.Store(i == n-1)
			l.complete(c)
			if l.waiter.gen.Load() != gen {
				return // detached after the batch's last: the next poller has the rest
			}
		}
	}
}

// waitPoller is the verbs.Detacher of a link whose queue is polled with
// Wait (pollWait): the goroutine delivering is always the link's poller,
// and handing its role over is starting another.
type waitPoller struct {
	l   *Link
	gen atomic.Uint64 // the poller's; Detach moves it on
}

// DeliveryToken implements verbs.Detacher (called in the poller).
func (w *waitPoller) DeliveryToken() uint64 { return w.gen.Load() + 1 }

// Detach implements verbs.Detacher: a new poller takes over; the old one
// leaves once the call it runs returns.
func (w *waitPoller) Detach(tok uint64) bool {
	if tok == 0 || !w.gen.CompareAndSwap(tok-1, tok) {
		return false
	}
	w.l.wg.Add(1) // the old poller is still counted: Close waits for both
	go func() {
		defer w.l.wg.Done()
		w.l.pollWait()
	}()
	return true
}

func (l *Link) complete(c verbs.Completion) {
	// Any failure, a flushed Recv included, means the queue pair is in the
	// error state: the peer refused one of our requests, or we refused one
	// of its (the target's side sees only its Recvs flushed). Either way
	// the plane is dead, and the session with it. (close marks the link
	// failed before it flushes, so its own flushes change nothing.)
	if c.Status != verbs.StatusSuccess {
		l.Fail(verbs.CompletionError(c))
	}
	if c.Op == verbs.OpRecv || c.Op == verbs.OpRecvImm {
		if c.Status == verbs.StatusSuccess {
			l.completeSlot(c)
		}
		return
	}
	l.Mu.Lock()
	w, ok := l.Waiters[c.ID]
	delete(l.Waiters, c.ID)
	l.Mu.Unlock()
	if !ok {
		return
	}
	switch {
	case w.finish(c):
	case w.abandoned != nil:
		// The poster's onFail may wait (a Deregister on shm waits for
		// the peer): not here, which may be the provider's receiver.
		l.wg.Add(1) // counted, as this goroutine is: Close waits for it
		go func() {
			defer l.wg.Done()
			w.abandoned(c)
		}()
	default:
		w.Ch <- c // buffered
	}
}

// Fail records the link's first failure and marks it dead.
func (l *Link) Fail(err error) {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	if l.Failure == nil {
		l.Failure = err
		close(l.Dead)
		if l.bell != nil {
			l.bell.close() // the caller waiting on it returns
		}
		if l.tbell != nil {
			l.tbell.close()
		}
	}
}

// Post posts one work request and waits for its completion. onFail (if not
// nil) runs exactly once if and only if Post returns an error: at once, or,
// when ctx ends while the request is under way, later, when the request
// completes, so that the caller's buffers are freed only once the data
// plane is done with them.
//
// A Send consumes one of the peer's receive slots: Post takes a credit
// for it first (see framing).
func (l *Link) Post(ctx context.Context, wr verbs.SendRequest, onFail func()) error {
	return l.PostWith(ctx, wr, onFail, true, nil)
}

// PostWith is post; credit false posts without taking a credit (the
// verifying round trip, and frames that took theirs already). unposted, if
// not nil, runs when the request never reached the queue pair.
func (l *Link) PostWith(ctx context.Context, wr verbs.SendRequest, onFail func(), credit bool, unposted func()) error {
	_, err := l.postWait(ctx, wr, onFail, credit, unposted)
	return err
}

// postWait is PostWith, returning the request's completion when it
// succeeded.
func (l *Link) postWait(ctx context.Context, wr verbs.SendRequest, onFail func(), credit bool, unposted func()) (verbs.Completion, error) {
	fail := func(err error) (verbs.Completion, error) {
		if onFail != nil {
			onFail()
		}
		return verbs.Completion{}, err
	}
	if credit && wr.Op == verbs.OpSend {
		if err := l.Acquire(ctx, false); err != nil {
			return fail(err)
		}
		unposted = func() { l.Frames.Refund(0, nil, nil) }
	}
	freeRoom := func() {}
	if wr.Op != verbs.OpSend {
		if err := l.takeRoom(ctx); err != nil {
			return fail(err)
		}
		freeRoom = func() { <-l.room }
	}
	notPosted := func(err error) (verbs.Completion, error) {
		freeRoom()
		if unposted != nil {
			unposted()
		}
		return fail(err)
	}
	w := &Waiter{Ch: make(chan verbs.Completion, 1)}
	wr.ID = l.NextID.Add(1)
	if wr.Op == verbs.OpRead {
		l.Reads.Add(1)
	}
	l.Mu.Lock()
	if l.closed || l.Failure != nil {
		err := l.Failure
		l.Mu.Unlock()
		return notPosted(Unavailable(err))
	}
	l.Waiters[wr.ID] = w
	l.Mu.Unlock()
	if err := postSend(l.QP, &wr); err != nil {
		l.Mu.Lock()
		delete(l.Waiters, wr.ID)
		l.Mu.Unlock()
		if errors.Is(err, verbs.ErrQueueFull) {
			return notPosted(status.Errorf(codes.ResourceExhausted, "tensorrpc: data plane send queue full (%d outstanding): %v", SendDepth, err))
		}
		return notPosted(CompletionStatus(verbs.Completion{Op: wr.Op, Status: verbs.StatusFlushed, Err: err}))
	}
	var c verbs.Completion
	select {
	case c = <-w.Ch:
	case <-ctx.Done():
		l.Mu.Lock()
		if _, pending := l.Waiters[wr.ID]; pending {
			w.abandoned = func(verbs.Completion) {
				freeRoom()
				if onFail != nil {
					onFail()
				}
			}
			l.Mu.Unlock()
			return verbs.Completion{}, status.FromContextError(ctx.Err()).Err()
		}
		l.Mu.Unlock()
		c = <-w.Ch // delivered just now
	}
	freeRoom()
	if err := CompletionStatus(c); err != nil {
		return fail(err)
	}
	return c, nil
}

// Busy is how many requests are under way on the link: frame calls
// awaiting their answers, and one-sided Reads and Writes (a Fetch's
// bytes, read after its answer came).
func (l *Link) Busy() int {
	n := len(l.room)
	if l.Frames != nil {
		n += l.Frames.InFlight()
	}
	return n
}

// takeRoom waits for room in the send queue for a request that takes no
// frame credit (see sendRoom).
func (l *Link) takeRoom(ctx context.Context) error {
	select {
	case l.room <- struct{}{}:
		return nil
	default:
	}
	select {
	case l.room <- struct{}{}:
		return nil
	case <-l.Dead:
		l.Mu.Lock()
		defer l.Mu.Unlock()
		return Unavailable(l.Failure)
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// ReadAsync posts a Read of remote into local without waiting for it:
// done runs with its error (nil when the bytes are in local) where
// completions are handled, or at close, so it must never wait. It
// reports false, having posted nothing (done does not run), when the
// send queue has no room at once (see takeRoom) or the link has closed.
// What a caller that would otherwise wait for the Read in a goroutine of
// its own (PostWith) saves: that goroutine, and the wake-up of it when
// the Read completes.
func (l *Link) ReadAsync(local verbs.Local, remote verbs.Remote, done func(error)) bool {
	return l.readAsync(verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: remote}, func(c verbs.Completion) {
		done(CompletionStatus(c))
	})
}

// readAsync is ReadAsync for the Read wr, done given its completion.
func (l *Link) readAsync(wr verbs.SendRequest, done func(verbs.Completion)) bool {
	select {
	case l.room <- struct{}{}:
	default:
		return false
	}
	l.Reads.Add(1)
	err := l.PostAsync(wr, func(c verbs.Completion) {
		<-l.room
		done(c)
	})
	if err != nil {
		<-l.room
		return false
	}
	return true
}

// PostAsync posts one work request without waiting for it: done runs
// with its completion (where completions are handled, see poll, or at
// close), so it must never wait. On error the request was not posted
// and done does not run.
func (l *Link) PostAsync(wr verbs.SendRequest, done func(verbs.Completion)) error {
	return l.postWaiter(wr, &Waiter{done: done})
}

// postWaiter is PostAsync with the request's waiter w made by the caller.
func (l *Link) postWaiter(wr verbs.SendRequest, w *Waiter) error {
	wr.ID = l.NextID.Add(1)
	l.Mu.Lock()
	if l.closed || l.Failure != nil {
		err := l.Failure
		l.Mu.Unlock()
		return Unavailable(err)
	}
	l.Waiters[wr.ID] = w
	l.Mu.Unlock()
	if err := postSend(l.QP, &wr); err != nil {
		l.Mu.Lock()
		_, ours := l.Waiters[wr.ID]
		delete(l.Waiters, wr.ID)
		l.Mu.Unlock()
		if !ours {
			// A Close that began meanwhile took w and finished it
			// (flushed): it has heard, as if posted.
			return nil
		}
		return err
	}
	return nil
}

// Close flushes the queue pair, stops polling and fails every waiter that
// is left, so every posted request's waiter hears exactly once. A Close
// that finds another under way waits for it: when any Close returns, what
// the link held (its slots, what abandoned requests hold) is released.
func (l *Link) Close(reason error) {
	l.Mu.Lock()
	if l.closed {
		l.Mu.Unlock()
		<-l.shut
		return
	}
	l.closed = true
	l.Mu.Unlock()
	defer close(l.shut)
	l.Fail(reason)
	if l.Frames != nil && l.Frames.Cancel != nil {
		l.Frames.Cancel() // the creditor
	}
	l.QP.Close() // waits for the provider's goroutines, a detached one too (see rescue)
	l.cq.Close()
	l.wg.Wait()
	if l.rescue != nil {
		dog.drop(l.rescue)
	}
	l.Mu.Lock()
	left := l.Waiters
	l.Waiters = map[uint64]*Waiter{}
	l.Mu.Unlock()
	for _, w := range left {
		c := verbs.Completion{Status: verbs.StatusFlushed, Err: reason}
		switch {
		case w.finish(c):
		case w.abandoned != nil:
			w.abandoned(c)
		default:
			w.Ch <- c
		}
	}
	l.out.Release()
	if l.Frames != nil {
		l.Frames.closePending()
		l.Frames.releaseSlots()
	}
}

// CompletionStatus maps a completion to a gRPC status error (nil on
// success).
func CompletionStatus(c verbs.Completion) error {
	switch c.Status {
	case verbs.StatusSuccess:
		return nil
	case verbs.StatusRemoteAccess:
		return status.Error(codes.PermissionDenied, verbs.CompletionError(c).Error())
	case verbs.StatusLocalLength, verbs.StatusLocalProtection, verbs.StatusRemoteInvalidRequest:
		return status.Error(codes.InvalidArgument, verbs.CompletionError(c).Error())
	case verbs.StatusBadData:
		return status.Error(codes.DataLoss, verbs.CompletionError(c).Error())
	default:
		return status.Error(codes.Unavailable, verbs.CompletionError(c).Error())
	}
}

// Unavailable is the status of a call whose link failed with err. When the
// peer closed the connection (PeerClosed), it says so in those words
// rather than with the provider's chain of errors.
func Unavailable(err error) error {
	if err == nil {
		err = ErrClosed
	}
	if PeerClosed(err) {
		return status.Error(codes.Unavailable, "tensorrpc: data plane down: the peer closed the connection (it stopped, restarted or failed)")
	}
	return status.Errorf(codes.Unavailable, "tensorrpc: data plane down: %v", err)
}

// PeerClosed reports whether err is the end of a connection the peer
// closed: an end of file, or a reset or broken pipe.
func PeerClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

var ErrClosed = errors.New("tensorrpc: closed")
