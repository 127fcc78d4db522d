package softrc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Wire is what a provider adds to a queue pair: how its requests, responses
// and doorbells move to the peer. The core (QP) does the contract's part of
// every verb first (checks, state, queue room, errors) and calls the wire
// for the rest.
type Wire interface {
	// PostSendUnlock is called by PostSend with Mu held, once ws passed
	// every check and took their send queue slots. It queues the requests
	// (usually on Sendq) or runs them, and releases Mu.
	PostSendUnlock(ws []SendWR)
	// PostRecvUnlock is called by PostRecv with Mu held, once the
	// receives are on Recvq. It releases Mu.
	PostRecvUnlock()
	// FailedLocked is called with Mu held as the queue pair enters ERR,
	// once its state, cause and flush status are set.
	FailedLocked()
	// Shutdown is called by Close without Mu, the queue pair closed and
	// in ERR, once the core closed the wire's connection and its
	// goroutines returned (see Start). It stops what else of the wire
	// touches memory or the queues, and releases the wire's resources;
	// Close then flushes what is left on the queues.
	Shutdown()
}

// Offer is a data connection a peer opened to a queue pair, waiting for
// its Connect, with the hello it presented. The core closes the offers
// nobody takes.
type Offer interface {
	Hello() Hello
	Close()
}

// Hello is what a dialer presents on its data connection: the id of the
// queue pair it wants, the secret that queue pair issued and its own.
type Hello struct {
	QPID             uint64
	Acceptor, Dialer Secret
}

// SendWR is a posted send queue request whose local memory was checked at
// post time: Vec replaces the request's Local and Segments.
type SendWR struct {
	ID         uint64
	Op         verbs.Opcode
	Imm        uint32
	HasImm     bool // a WriteImm always has one
	Unsignaled bool
	// Lazy is the request's LazyCompletion.
	Lazy bool
	// Early, set by a provider that acknowledges in software as it takes
	// a Lazy request to write, says that the request completes once its
	// bytes are written (the writer completes it, and the peer is told not
	// to acknowledge it): done where a delivery of completions is under
	// way, which takes that completion with it (CQ.Hand).
	Early  bool
	Fence  bool
	Remote verbs.Remote
	Vec    Vec // the local segments
	N      int // their length
	seg    [1]Seg
	// Seq is the wire's number for the request.
	Seq uint64
	// LocalErr says the request's region was deregistered before its data
	// moved; the flush completes it with StatusLocalProtection.
	LocalErr bool
	// Compress is a Read's request to compress its data on the wire;
	// Packed and Wire, set by the provider that received the data, go
	// into its completion (verbs.Completion).
	Compress verbs.Compression
	Packed   verbs.Codec
	Wire     int
	Sampled  float64
}

// RecvWR is a posted receive.
type RecvWR struct {
	ID  uint64
	Vec Vec
	N   int
	seg [1]Seg
}

// ErrRNR says no receive was posted within the RNR timeout (WaitRecv).
var ErrRNR = errors.New("no receive posted")

// ErrStopped says the queue pair entered ERR while WaitRecv waited.
var ErrStopped = errors.New("queue pair stopped")

// QP is the state of a soft-RC queue pair that does not depend on its
// wire: its state machine (RESET, INIT, RTS, ERR) with the cause of ERR,
// its work queues (Sendq, Inflight, Recvq) and their slots, the flush that
// completes what is left in ERR, the offers of data connections, and the
// checks and errors of every verb. A provider's queue pair embeds it and
// adds Connect, Grant and its Wire.
//
// Every error it returns begins with the provider and the queue pair's id
// ("tcp: queue pair 7: ..."); a post to a queue pair in ERR carries the
// cause.
type QP struct {
	Domain         *Domain
	ID             uint64
	Secret         Secret
	Info           []byte // LocalInfo
	SendCQ, RecvCQ *CQ
	SendQ, RecvQ   *WorkQueue // slots, held until a completion is polled
	// Errored is closed on entering ERR.
	Errored chan struct{}
	// RecvPosted gets a token (one slot) when receives are posted.
	RecvPosted chan struct{}

	wire     Wire
	incoming chan Offer
	wg       sync.WaitGroup // the wire's goroutines (Start)
	closing  atomic.Bool    // Close has begun

	// Mu guards the fields below, and those a wire keeps with them.
	Mu          sync.Mutex
	state       verbs.QPState
	closed      bool
	connecting  bool
	accepting   bool // offers of data connections are welcome
	takesOffers bool // accepting, while not connecting or connected
	cause       error
	flushStatus verbs.Status // of the oldest request outstanding in ERR
	// Sendq holds send requests posted and not yet started, Inflight those
	// started and not yet completed, Recvq the receives posted and not yet
	// taken; each in posting order. A wire moves requests along them; the
	// flush completes what is left.
	Sendq    []*SendWR
	Inflight []*SendWR
	Recvq    []*RecvWR
	ackDone  []*SendWR // AckLocked's done, reused by Ack
	conn     net.Conn  // the wire's connection (Start)
	// roles counts the wire's goroutines (Start's, and Continue's, which
	// take over one of them) still running: the last to return closes
	// conn.
	roles atomic.Int32
}

// Start records conn, the connection Connect's link made, and runs the
// wire's goroutines fs on it; the caller holds Mu (Connect's start). The
// last of them to return closes conn; Close closes it and waits for them.
func (q *QP) Start(conn net.Conn, fs ...func()) {
	q.conn = conn
	q.roles.Store(int32(len(fs)))
	for _, f := range fs {
		q.run(f)
	}
}

// Continue runs f, a wire's goroutine taking over from one of Start's
// (or an earlier Continue's) that is about to return having handed its
// role over (a receiver whose delivery was detached, see DeliverFrom):
// counted as they are, so that Close waits for it and conn closes only
// when the last of them returns. Call it before the goroutine it takes
// over from returns.
func (q *QP) Continue(f func()) {
	q.roles.Add(1)
	q.run(f)
}

func (q *QP) run(f func()) {
	q.wg.Add(1)
	go func() {
		defer q.wg.Done()
		f()
		if q.roles.Add(-1) == 0 {
			q.conn.Close()
		}
	}()
}

// ConnLocked is the wire's connection, nil before Start; the caller holds
// Mu.
func (q *QP) ConnLocked() net.Conn { return q.conn }

// CloseConn closes the wire's connection, if it has one, which ends its
// goroutines.
func (q *QP) CloseConn() {
	q.Mu.Lock()
	conn := q.conn
	q.Mu.Unlock()
	if conn != nil {
		conn.Close()
	}
}

// InError reports, without Mu, whether the queue pair is in ERR (Errored
// is closed).
func (q *QP) InError() bool {
	select {
	case <-q.Errored:
		return true
	default:
		return false
	}
}

// Closing reports, without Mu, whether Close has begun: a wire's goroutine
// that its peer could keep busy looks at it so as not to hold Close.
func (q *QP) Closing() bool { return q.closing.Load() }

// Errorf is an error of the queue pair: "provider: queue pair id: " and
// the formatted text.
func (q *QP) Errorf(format string, args ...any) error {
	return QPErrorf(q.Domain.Name, q.ID, format, args...)
}

// Wire is the queue pair's wire.
func (q *QP) Wire() Wire { return q.wire }

// LocalInfo returns the queue pair's connection information.
func (q *QP) LocalInfo() []byte { return bytes.Clone(q.Info) }

// State returns the queue pair's state.
func (q *QP) State() verbs.QPState {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.state
}

// StateLocked is State for a caller holding Mu.
func (q *QP) StateLocked() verbs.QPState { return q.state }

// ClosedLocked reports whether Close was called; the caller holds Mu.
func (q *QP) ClosedLocked() bool { return q.closed }

// Closed reports whether Close was called.
func (q *QP) Closed() bool {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.closed
}

// FailureLocked is the status and cause of the request outstanding when
// the queue pair entered ERR; the caller holds Mu.
func (q *QP) FailureLocked() (verbs.Status, error) { return q.flushStatus, q.cause }

// Failure is FailureLocked for a caller not holding Mu.
func (q *QP) Failure() (verbs.Status, error) {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.flushStatus, q.cause
}

// PostSend checks every request (see CheckSends) and the queue pair's
// state and room, then hands them to the wire: all or none.
func (q *QP) PostSend(wrs ...verbs.SendRequest) error {
	if len(wrs) == 0 {
		return nil
	}
	ws, err := CheckSends(q.Domain, q.Domain.Limits, wrs, func(w *SendWR) Vec { return w.seg[:0] }, func(w *SendWR, wr *verbs.SendRequest, vec Vec) {
		w.ID, w.Op, w.Imm, w.HasImm = wr.ID, wr.Op, wr.Imm, wr.HasImm || wr.Op == verbs.OpWriteImm
		w.Unsignaled, w.Lazy, w.Fence, w.Remote, w.Vec, w.N = wr.Unsignaled, wr.LazyCompletion, wr.Fence, wr.Remote, vec, vec.Len()
		w.Compress, w.Packed, w.Wire, w.Sampled = wr.Compress, verbs.CodecNone, 0, 0
	})
	if err != nil {
		return q.Errorf("%w", err)
	}
	q.Mu.Lock()
	if err := q.postErrorLocked(true); err != nil {
		q.Mu.Unlock()
		return err
	}
	if err := q.SendQ.Take(len(ws)); err != nil {
		q.Mu.Unlock()
		return q.Errorf("PostSend of %w", err)
	}
	q.wire.PostSendUnlock(ws)
	return nil
}

// PostRecv posts receives, all or none, as PostSend. Receives may be
// posted before Connect.
func (q *QP) PostRecv(wrs ...verbs.RecvRequest) error {
	if len(wrs) == 0 {
		return nil
	}
	rs, err := CheckRecvs(q.Domain, q.Domain.Limits, wrs, func(r *RecvWR) Vec { return r.seg[:0] }, func(r *RecvWR, wr *verbs.RecvRequest, vec Vec) {
		r.ID, r.Vec, r.N = wr.ID, vec, vec.Len()
	})
	if err != nil {
		return q.Errorf("%w", err)
	}
	q.Mu.Lock()
	if err := q.postErrorLocked(false); err != nil {
		q.Mu.Unlock()
		return err
	}
	if err := q.RecvQ.Take(len(rs)); err != nil {
		q.Mu.Unlock()
		return q.Errorf("PostRecv of %w", err)
	}
	for i := range rs {
		q.Recvq = append(q.Recvq, &rs[i])
	}
	signal(q.RecvPosted)
	q.wire.PostRecvUnlock()
	return nil
}

func (q *QP) postErrorLocked(send bool) error {
	if err := PostError(q.closed, q.state, q.cause, send); err != nil {
		return q.Errorf("%w", err)
	}
	return nil
}

// Grant is QueuePair.Grant: NewGrant on the queue pair, unless it is
// closed, with the wire's onRevoke and onStuck (either may be nil).
func (q *QP) Grant(region verbs.MemoryRegion, offset, length int, access verbs.Access, onRevoke func(*Grant), onStuck func()) (verbs.Grant, error) {
	if q.Closed() {
		return nil, q.Errorf("grant: %w", verbs.ErrClosed)
	}
	g, err := q.Domain.Table.NewGrant(q, region, offset, length, access, onRevoke, onStuck)
	if err != nil {
		return nil, q.Errorf("%w", err)
	}
	return g, nil
}

// Fail moves the queue pair to ERR (see FailLocked).
func (q *QP) Fail(status verbs.Status, cause error) bool {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.FailLocked(status, cause)
}

// FailLocked moves the queue pair to ERR once, for cause, and reports
// whether this call did. The oldest request outstanding then completes
// with status (StatusFlushed for none) and the cause, every later one and
// every receive with StatusFlushed: that is the contract's flush order,
// which the send WorkQueue applies to whatever completes after this (see
// WorkQueue.Fail). It closes Errored and calls the wire's FailedLocked.
// The caller holds Mu.
func (q *QP) FailLocked(status verbs.Status, cause error) bool {
	if q.state == verbs.QPError {
		return false
	}
	if status == verbs.StatusSuccess {
		status = verbs.StatusFlushed
	}
	q.state, q.cause, q.flushStatus = verbs.QPError, cause, status
	q.SendQ.Fail(status)
	close(q.Errored)
	q.wire.FailedLocked()
	return true
}

// CompleteSend appends the completion of w, with status st and, unless
// it succeeded, err, to es, unless it is an unsignaled success.
func (q *QP) CompleteSend(es []Entry, w *SendWR, st verbs.Status, err error) []Entry {
	if e, ok := q.SendQ.Complete(CompletionOf(w, st, err), w.Unsignaled); ok {
		es = append(es, e)
	}
	return es
}

// CompletionOf is the completion of w with status st and, unless it
// succeeded, err.
func CompletionOf(w *SendWR, st verbs.Status, err error) verbs.Completion {
	c := verbs.Completion{ID: w.ID, Op: w.Op, Status: st, Err: err}
	if st == verbs.StatusSuccess {
		c.Len, c.Err = w.N, nil
		c.Packed, c.Wire, c.Sampled = w.Packed, w.Wire, w.Sampled
		if w.Op == verbs.OpWriteImm || w.Op == verbs.OpSend && w.HasImm {
			c.Imm, c.HasImm = w.Imm, true
		}
	}
	return c
}

// AckLocked takes off Inflight the requests an acknowledgement of request
// seq covers, oldest first: with status StatusSuccess every one up to seq
// (acknowledgements are cumulative), into done; with any other status
// those before seq into done and seq itself as refused (see Refused). An
// acknowledgement that names no outstanding request, or covers a Read
// (which has a response of its own), is a protocol violation: err, and
// Inflight is left as it was. The caller holds Mu.
func (q *QP) AckLocked(seq uint64, status verbs.Status) (done []*SendWR, refused *SendWR, err error) {
	k := 0
	for k < len(q.Inflight) && q.Inflight[k].Seq < seq {
		k++
	}
	if k == len(q.Inflight) || q.Inflight[k].Seq != seq {
		return nil, nil, fmt.Errorf("acknowledgement of request %d, which is not outstanding", seq)
	}
	n := k
	if status == verbs.StatusSuccess {
		n = k + 1
	}
	for _, w := range q.Inflight[:n] {
		if w.Op == verbs.OpRead {
			return nil, nil, fmt.Errorf("acknowledgement %d covers read %d, which has no response", seq, w.Seq)
		}
	}
	done = append(q.ackDone[:0], q.Inflight[:n]...)
	if n == k {
		refused = q.Inflight[k]
	}
	q.Inflight = TakeFront(q.Inflight, k+1)
	return done, refused, nil
}

// TakeFront is ws without its first n entries, which it clears. When it
// takes them all it keeps ws's memory, from its start, for the next
// appends: a queue that empties after each exchange then never grows
// into new memory.
func TakeFront[W any](ws []*W, n int) []*W {
	clear(ws[:n])
	if n == len(ws) {
		return ws[:0]
	}
	return ws[n:]
}

// Ack applies the peer's acknowledgement of request seq, with the status
// it sent (see AckLocked): the requests it covers complete, oldest first,
// and one it refuses fails with what the refusal means (Refused) and
// moves the queue pair to ERR. took, when not nil, sees what it took off
// Inflight, with Mu held. Ack reports whether the queue pair failed, or a
// protocol violation. It is for the wire's receiver, which calls Deliver
// before it next blocks: the completions are Queued.
func (q *QP) Ack(seq uint64, status verbs.Status, took func(done []*SendWR, refused *SendWR)) (failed bool, err error) {
	q.Mu.Lock()
	done, refused, err := q.AckLocked(seq, status)
	if err != nil {
		q.Mu.Unlock()
		return false, err
	}
	if took != nil {
		took(done, refused)
	}
	var buf [4]Entry // on the stack: most acknowledgements cover a few requests
	es := buf[:0]
	for _, w := range done {
		es = q.CompleteSend(es, w, verbs.StatusSuccess, nil)
	}
	clear(done)
	q.ackDone = done[:0]
	if refused != nil {
		st, why := Refused(status)
		cause := fmt.Errorf("the peer refused %v %d: %w", refused.Op, refused.ID, why)
		q.FailLocked(verbs.StatusFlushed, q.Errorf("%w", cause))
		es = q.CompleteSend(es, refused, st, cause)
	}
	q.Mu.Unlock()
	q.SendCQ.Queue(es...)
	return refused != nil, nil
}

// Deliver hands what the calling goroutine Queued on the queue pair's
// completion queues to their Run handlers (see CQ.Deliver): the wire's
// receiver calls it, with no locks held, before it blocks to read again.
func (q *QP) Deliver() { q.DeliverFrom(nil) }

// DeliverFrom is Deliver for a receiver that can hand its role to a new
// goroutine: see CQ.DeliverFrom. When it reports true the caller is no
// longer the receiver: resume continues it.
func (q *QP) DeliverFrom(resume func()) (detached bool) {
	if q.RecvCQ.DeliverFrom(resume) {
		return true
	}
	if q.SendCQ != q.RecvCQ {
		return q.SendCQ.DeliverFrom(resume)
	}
	return false
}

// CompleteRecv is the completion entry of r with c's outcome.
func (q *QP) CompleteRecv(r *RecvWR, c verbs.Completion) Entry {
	c.ID = r.ID
	if c.Op == 0 {
		c.Op = verbs.OpRecv
	}
	e, _ := q.RecvQ.Complete(c, false)
	return e
}

// TakeRecvLocked takes the oldest posted receive, or returns nil; the
// caller holds Mu.
func (q *QP) TakeRecvLocked() *RecvWR {
	if len(q.Recvq) == 0 {
		return nil
	}
	r := q.Recvq[0]
	q.Recvq[0] = nil
	q.Recvq = q.Recvq[1:]
	return r
}

// WaitRecv takes the oldest posted receive, waiting up to rnr for one to
// be posted: ErrRNR when none is, ErrStopped when the queue pair enters
// ERR first.
func (q *QP) WaitRecv(rnr time.Duration) (*RecvWR, error) {
	var timer *time.Timer
	for {
		q.Mu.Lock()
		r := q.TakeRecvLocked()
		q.Mu.Unlock()
		if r != nil {
			if timer != nil {
				timer.Stop()
			}
			return r, nil
		}
		if timer == nil {
			timer = time.NewTimer(rnr)
			defer timer.Stop()
		}
		select {
		case <-q.RecvPosted:
		case <-timer.C:
			return nil, ErrRNR
		case <-q.Errored:
			return nil, ErrStopped
		}
	}
}

// FlushRecvsLocked completes every posted receive with StatusFlushed and
// the cause; the caller holds Mu.
func (q *QP) FlushRecvsLocked() {
	if len(q.Recvq) == 0 {
		return
	}
	es := make([]Entry, 0, len(q.Recvq))
	for _, r := range q.Recvq {
		es = append(es, q.CompleteRecv(r, verbs.Completion{Status: verbs.StatusFlushed, Err: q.cause}))
	}
	q.Recvq = nil
	q.RecvCQ.Push(es...)
}

// FlushSendsLocked completes every send request still started or queued,
// oldest first, in ERR: the oldest outstanding one with the flush status,
// one whose region was deregistered with StatusLocalProtection, the rest
// with StatusFlushed, all with the cause. The caller holds Mu.
func (q *QP) FlushSendsLocked() {
	if len(q.Inflight)+len(q.Sendq) == 0 {
		return
	}
	es := make([]Entry, 0, len(q.Inflight)+len(q.Sendq))
	for _, list := range [][]*SendWR{q.Inflight, q.Sendq} {
		for _, w := range list {
			st := verbs.StatusFlushed
			if w.LocalErr {
				st = verbs.StatusLocalProtection
			}
			es = q.CompleteSend(es, w, st, q.cause)
		}
	}
	q.Inflight, q.Sendq = nil, nil
	q.SendCQ.Push(es...)
}

// Flush completes every request left on the queues (see FlushSendsLocked
// and FlushRecvsLocked).
func (q *QP) Flush() {
	q.Mu.Lock()
	q.FlushSendsLocked()
	q.FlushRecvsLocked()
	q.Mu.Unlock()
}

// Close moves the queue pair to ERR (StatusFlushed), shuts its wire down,
// closes the offers nobody took, completes every outstanding request with
// StatusFlushed, revokes its grants, gives back its completion queue room
// and leaves its domain. It is idempotent.
func (q *QP) Close() error {
	q.Mu.Lock()
	if q.closed {
		q.Mu.Unlock()
		return nil
	}
	q.closed, q.accepting = true, false
	q.closing.Store(true)
	q.FailLocked(verbs.StatusFlushed, fmt.Errorf("%s: queue pair %d closed", q.Domain.Name, q.ID))
	q.Mu.Unlock()
	q.CloseConn()
	q.wg.Wait()
	q.wire.Shutdown()
	q.DrainOffers()
	q.Flush()
	q.Domain.Table.RevokeAll(q)
	q.SendCQ.Unreserve(q.SendQ.Max())
	q.RecvCQ.Unreserve(q.RecvQ.Max())
	q.Domain.remove(q)
	return nil
}

// Offer hands a data connection to the queue pair; it fails when the
// queue pair takes none now or has too many waiting.
func (q *QP) Offer(o Offer) bool {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	if q.closed || !q.accepting {
		return false
	}
	select {
	case q.incoming <- o:
		return true
	default:
		return false
	}
}

// Incoming delivers the offers, for the accepting side's Connect.
func (q *QP) Incoming() <-chan Offer { return q.incoming }

// AcceptOffer waits for the data connection offered by the peer whose
// secret is peer (its hello's Dialer), closes any other, and once it has
// the peer's takes no more offers. It ends with ctx.
func (q *QP) AcceptOffer(ctx context.Context, peer Secret) (Offer, error) {
	for {
		select {
		case o := <-q.incoming:
			if dialer := o.Hello().Dialer; !dialer.Equal(peer) {
				o.Close()
				continue
			}
			q.StopAccepting()
			return o, nil
		case <-ctx.Done():
			return nil, q.Errorf("waiting for the peer to connect: %w", context.Cause(ctx))
		}
	}
}

// StopAccepting refuses further offers and closes those waiting.
func (q *QP) StopAccepting() {
	q.Mu.Lock()
	q.accepting = false
	q.Mu.Unlock()
	q.DrainOffers()
}

// DrainOffers closes the offers waiting.
func (q *QP) DrainOffers() {
	for {
		select {
		case o := <-q.incoming:
			o.Close()
		default:
			return
		}
	}
}

// Connect is the skeleton of QueuePair.Connect, given the peer's secret
// and role from its connection info: it refuses the queue pair's own
// info, decides who dials (ShouldDial), moves the queue pair from RESET
// to INIT and runs link, which ends when ctx does or the queue pair
// enters ERR. link sets up the data connection and returns start, which
// runs with Mu held as the queue pair enters RTS (it starts the wire's
// goroutines), and abort, which runs instead when the queue pair was
// closed meanwhile. On failure the queue pair goes back to RESET, and
// takes offers again unless it dials.
func (q *QP) Connect(ctx context.Context, peerSecret Secret, mine, peer verbs.ConnectRole, link func(ctx context.Context, dial bool) (start, abort func(), err error)) error {
	if peerSecret == q.Secret {
		return q.Errorf("connection info is the queue pair's own: %w", verbs.ErrInvalidInfo)
	}
	dial, err := ShouldDial(mine, peer, q.Secret, peerSecret)
	if err != nil {
		return q.Errorf("%w", err)
	}
	q.Mu.Lock()
	switch {
	case q.closed:
		q.Mu.Unlock()
		return q.Errorf("connect: %w", verbs.ErrClosed)
	case q.state != verbs.QPReset || q.connecting:
		st := q.state
		q.Mu.Unlock()
		return q.Errorf("connect in state %v, want RESET", st)
	}
	q.connecting, q.state = true, verbs.QPInit
	q.Mu.Unlock()
	if dial {
		// A dialer takes no connections; an acceptor has been taking them
		// since it was made, because its peer may dial before we get here.
		q.StopAccepting()
	}

	// Close (or any failure) ends a Connect in progress.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-q.Errored:
			cancel()
		case <-ctx.Done():
		}
	}()
	start, abort, err := link(ctx, dial)

	q.Mu.Lock()
	defer q.Mu.Unlock()
	q.connecting = false
	if q.closed {
		if err == nil {
			abort()
		}
		return q.Errorf("closed while connecting: %w", verbs.ErrClosed)
	}
	if err != nil {
		if q.state == verbs.QPInit {
			q.state = verbs.QPReset
			q.accepting = q.takesOffers
		}
		return err
	}
	q.state, q.accepting = verbs.QPReadyToSend, false
	start()
	return nil
}

// AcceptingLocked reports whether offers are welcome; the caller holds Mu.
func (q *QP) AcceptingLocked() bool { return q.accepting }

// signal wakes whoever waits on a one-slot channel.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Signal wakes whoever waits on a one-slot channel.
func Signal(c chan struct{}) { signal(c) }
