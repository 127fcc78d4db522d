package rpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Client is a channel to a Server: a gRPC connection for control and, at
// any time, at most one session over it with the best data plane both sides
// could connect. When a session ends (the server restarted, the connection
// was lost), calls under way fail with Unavailable and the next call opens
// a new session, renegotiating the data plane, with gRPC's backoff between
// failed attempts. It is safe for concurrent use.
type Client struct {
	opts    options
	log     *slog.Logger
	pool    *mempool.Pool
	ownPool bool
	ctl     *mempool.Pool // the links' own buffers
	cc      *grpc.ClientConn
	ownConn bool
	api     pb.TensorRPCClient
	domains map[string]*engine.Domain
	// noInPlace makes caller memory go through pool copies (tests of
	// the pool path).
	noInPlace bool
	// registered is what Register registered.
	regMu      sync.Mutex
	registered map[memRange]struct{}
	missing    []Rejection // data planes this side could not open
	stats      counters
	topo       topology
	// planFor, when set (by tests), decides device transfers instead of
	// gpudirect.Plan, so the direct path runs without a GPU or RDMA NIC.
	planFor func(gpudirect.DeviceBuffer) gpudirect.Decision

	stopTrim func() // ends the pool's trimmer
	stage    *stager

	// closing ends when Close begins, which ends a session attempt under
	// way.
	closing    context.Context
	startClose context.CancelFunc

	mu     sync.Mutex
	closed bool
	// calls counts the calls under way (enter, leave); Close waits for
	// them, so that the pool buffers they hold are back before it closes
	// the pool. callsDone, when set, is closed as calls reaches 0.
	calls     int
	callsDone chan struct{}
	sess      *clientSession // the current session; nil before the first and after one ended
	// ending are sessions that ended but whose stream reader has not
	// stopped yet (it may keep their lanes open for late answers): Close
	// closes them too.
	ending     map[*clientSession]struct{}
	last       *clientSession // the latest session that opened, for Transport and Rejections
	state      connectivity.State
	stateCh    chan struct{} // closed and replaced on every state change
	connecting chan struct{} // non-nil while a session is being opened
	lastErr    error         // why the latest attempt failed or the latest session ended
	failures   int           // consecutive failed attempts
	retryAt    time.Time     // no new attempt before this
}

// Dial connects to the tensorrpc server at target (a gRPC target such as
// "host:port") and opens a session. Transport credentials are required, as
// grpc.NewClient requires them: WithTransportCredentials(creds), or
// WithTransportCredentials(insecure.NewCredentials()) for plaintext.
//
// Dial returns once the session is open, or fails when ctx ends or the
// connection cannot be made. An address that refuses connections fails at
// once (Unavailable); one that silently drops them (a firewall, a host that
// is down) waits for gRPC's connect timeout, 20 s, unless ctx ends first:
// give ctx a deadline to bound it, or change gRPC's MinConnectTimeout with
// WithGRPCDialOptions(grpc.WithConnectParams(...)). (WithConnectTimeout
// bounds connecting each data plane once the session is being opened.)
func Dial(ctx context.Context, target string, opts ...DialOption) (*Client, error) {
	o := buildDialOptions(opts)
	if o.envErr != nil {
		return nil, status.Error(codes.InvalidArgument, o.envErr.Error())
	}
	dialOpts := slices.Clone(o.grpcDialOpts)
	if o.creds != nil {
		dialOpts = append([]grpc.DialOption{grpc.WithTransportCredentials(o.creds)}, dialOpts...)
	}
	cc, err := grpc.NewClient(target, dialOpts...)
	if err != nil {
		if o.creds == nil && strings.Contains(err.Error(), "no transport security set") {
			// gRPC's own advice names its DialOption, which rpc.Dial does
			// not take: say it in rpc's terms.
			return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: dialing %s: no transport security set: pass rpc.WithTransportCredentials(creds) with TLS credentials, or rpc.WithTransportCredentials(insecure.NewCredentials()) for plaintext (package google.golang.org/grpc/credentials/insecure)", target)
		}
		if o.creds == nil {
			return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: dialing %s: %v", target, err)
		}
		return nil, fmt.Errorf("tensorrpc: dialing %s: %w", target, err)
	}
	c, err := newClient(ctx, cc, o)
	if err != nil {
		cc.Close()
		return nil, err
	}
	c.ownConn = true
	return c, nil
}

// NewClient opens a session over an existing gRPC connection. Close does
// not close cc. As with Dial, a data-plane session's calls travel as
// frames, which cc's interceptors do not see.
func NewClient(ctx context.Context, cc *grpc.ClientConn, opts ...DialOption) (*Client, error) {
	return newClient(ctx, cc, buildDialOptions(opts))
}

func newClient(ctx context.Context, cc *grpc.ClientConn, o options) (*Client, error) {
	if o.envErr != nil {
		return nil, status.Error(codes.InvalidArgument, o.envErr.Error())
	}
	if _, err := o.compressionMode(); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	o.withCallLog()
	c := &Client{
		opts: o, log: o.logger, cc: cc, api: pb.NewTensorRPCClient(cc),
		state: connectivity.Idle, stateCh: make(chan struct{}),
	}
	c.closing, c.startClose = context.WithCancel(context.Background())
	if o.pool != nil {
		c.pool = o.pool
	} else {
		p, err := mempool.NewPool(o.poolOptions...)
		if err != nil {
			return nil, fmt.Errorf("tensorrpc: making the pool: %w", err)
		}
		c.pool, c.ownPool = p, true
	}
	c.stage = newStager(c.pool, &o)
	c.stopTrim = func() {}
	if c.ownPool {
		c.stopTrim = trimmer(c.pool, o.trimInterval, c.log)
	}
	ctl, err := engine.NewControlPool()
	if err != nil {
		c.stopTrim()
		if c.ownPool {
			c.pool.Close()
		}
		return nil, fmt.Errorf("tensorrpc: making the control pool: %w", err)
	}
	c.ctl = ctl
	var missing map[string]string
	c.domains, missing = openDomains(&c.opts, c.pool, c.ctl, c.log)
	for _, name := range o.transports {
		if reason, ok := missing[name]; ok {
			c.missing = append(c.missing, newRejection(name, "client", reason))
		}
	}
	if _, err := c.session(ctx); err != nil {
		c.mu.Lock()
		c.closed = true
		c.mu.Unlock()
		c.teardown()
		return nil, err
	}
	return c, nil
}

// Transport is the data plane of the current session (or of the latest,
// while none is open): TransportIBV, TransportSHM, TransportTCP or
// TransportGRPC.
func (c *Client) Transport() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last == nil {
		return ""
	}
	return c.last.transport
}

// Rejections says why each enabled data plane other than the one in use was
// not used, on either side, for the current (or latest) session.
func (c *Client) Rejections() []Rejection {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last == nil {
		return append([]Rejection(nil), c.missing...)
	}
	return append([]Rejection(nil), c.last.rejections...)
}

// SessionID is the server's name for the current (or latest) session.
func (c *Client) SessionID() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last == nil {
		return ""
	}
	return c.last.id
}

// State is the Client's connectivity state, in gRPC's terms: Ready while a
// session is open, Connecting while one is being opened, Idle after a
// session ended (the next call opens one), TransientFailure after an
// attempt failed (calls fail with Unavailable until the backoff allows the
// next attempt), Shutdown after Close.
func (c *Client) State() connectivity.State {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.state
}

// WaitForStateChange waits until the state differs from source or ctx
// ends; it reports whether the state changed.
func (c *Client) WaitForStateChange(ctx context.Context, source connectivity.State) bool {
	for {
		c.mu.Lock()
		st, ch := c.state, c.stateCh
		c.mu.Unlock()
		if st != source {
			return true
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		}
	}
}

// Connect opens a session now, if none is open, instead of on the next
// call; it returns the error of that attempt.
func (c *Client) Connect(ctx context.Context) error {
	_, err := c.session(ctx)
	return err
}

// setStateLocked changes the state and wakes WaitForStateChange.
func (c *Client) setStateLocked(st connectivity.State) {
	if c.state == st {
		return
	}
	c.state = st
	close(c.stateCh)
	c.stateCh = make(chan struct{})
}

// Pool is the pool received tensors come from.
func (c *Client) Pool() *mempool.Pool { return c.pool }

// Stats returns the Client's counters over all its sessions.
func (c *Client) Stats() Stats {
	st := c.stats.snapshot(c.Transport())
	st.PinnedArenas = c.stage.arenas()
	return st
}

// Register registers t's memory, memory the caller owns (a WrapTensor
// over its own bytes), with the Client's data planes until Deregister, so
// that Sends, Calls and Fetches Into of it reuse one registration instead
// of registering per transfer. On tcp and shm a registration is cheap and
// kept in a cache anyway (a stale entry is harmless there: the providers
// reach registered memory through its address); on an RDMA NIC a
// registration pins the pages it found, so there only Register keeps one
// past a transfer. Deregister before the memory is freed or reused. Pool
// tensors need no registration. Planes that cannot register such memory
// (shm where cross-memory attach is refused) keep copying it through the pool.
func (c *Client) Register(t *Tensor) error {
	if err := checkOutgoing(t, "Register's tensor"); err != nil {
		return err
	}
	if len(t.Bytes()) == 0 || c.ownPoolMemory(t) {
		return nil
	}
	c.regMu.Lock()
	if c.registered == nil {
		c.registered = map[memRange]struct{}{}
	}
	c.registered[rangeOf(t.Bytes())] = struct{}{}
	c.regMu.Unlock()
	for _, d := range c.domains {
		for _, a := range []verbs.Access{verbs.AccessLocalWrite, verbs.AccessRemoteRead} {
			d.Pin(t.Bytes(), a) // a plane that cannot keeps copying
		}
	}
	return nil
}

// Deregister ends Register's registration of t's memory (once transfers
// under way are done with it). It fails with NotFound when t was not
// registered.
func (c *Client) Deregister(t *Tensor) error {
	if t == nil || len(t.Bytes()) == 0 {
		return status.Error(codes.InvalidArgument, "tensorrpc: Deregister of a nil or empty tensor")
	}
	if c.ownPoolMemory(t) {
		return nil
	}
	r := rangeOf(t.Bytes())
	c.regMu.Lock()
	_, found := c.registered[r]
	delete(c.registered, r)
	c.regMu.Unlock()
	if !found {
		return status.Error(codes.NotFound, "tensorrpc: Deregister of memory that is not registered")
	}
	for _, d := range c.domains {
		for _, a := range []verbs.Access{verbs.AccessLocalWrite, verbs.AccessRemoteRead} {
			d.Unpin(t.Bytes(), a)
		}
	}
	return nil
}

// memRange is a range of memory Register registered.
type memRange struct {
	addr uintptr
	n    int
}

func rangeOf(b []byte) memRange {
	return memRange{uintptr(unsafe.Pointer(unsafe.SliceData(b))), len(b)}
}

// NewTensor allocates a tensor from the Client's pool, waiting while the
// pool is full until ctx ends. Sending it costs no copy. Its memory is not
// zeroed: pool memory is reused, so it may hold the bytes of an earlier
// tensor; write all of it (or clear(t.Bytes())) before use.
func (c *Client) NewTensor(ctx context.Context, dtype zerocopy.DType, shape []int64) (*Tensor, error) {
	return newTensor(ctx, c.pool, dtype, shape)
}

// session returns the open session, opening one when there is none. While
// the backoff after a failed attempt lasts it fails at once with
// Unavailable, as a gRPC channel in TRANSIENT_FAILURE fails fast calls.
func (c *Client) session(ctx context.Context) (*clientSession, error) {
	for {
		c.mu.Lock()
		switch {
		case c.closed && c.state == connectivity.Shutdown:
			c.mu.Unlock()
			return nil, status.Error(codes.Canceled, "tensorrpc: client closed")
		case c.sess != nil && c.sess.err() == nil:
			s := c.sess
			c.mu.Unlock()
			return s, nil
		case c.connecting != nil:
			ch := c.connecting
			c.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, status.FromContextError(ctx.Err()).Err()
			}
		case time.Now().Before(c.retryAt):
			err := status.Errorf(codes.Unavailable, "tensorrpc: no session (next attempt in %v): %v", time.Until(c.retryAt).Round(time.Millisecond), c.lastErr)
			c.mu.Unlock()
			return nil, err
		}
		ch := make(chan struct{})
		c.connecting = ch
		c.setStateLocked(connectivity.Connecting)
		c.mu.Unlock()

		// Close ends the attempt too: a server that never answers the
		// handshake must not hold Close.
		octx, ocancel := context.WithCancel(ctx)
		stopClose := context.AfterFunc(c.closing, ocancel)
		s, err := c.openSession(octx)
		stopClose()
		ocancel()

		c.mu.Lock()
		c.connecting = nil
		close(ch)
		if c.closed {
			if err == nil {
				c.mu.Unlock()
				s.close(errors.New("client closed"))
			} else {
				c.mu.Unlock()
			}
			return nil, status.Error(codes.Canceled, "tensorrpc: client closed")
		}
		if err != nil {
			if ctx.Err() == nil { // the caller's deadline is no failure of the server's
				c.failures++
				c.retryAt = time.Now().Add(backoffDelay(c.opts.backoff, c.failures))
				c.lastErr = err
				c.setStateLocked(connectivity.TransientFailure)
			} else {
				c.setStateLocked(connectivity.Idle)
			}
			c.mu.Unlock()
			return nil, err
		}
		c.failures, c.retryAt = 0, time.Time{}
		if old := c.sess; old != nil {
			c.endingLocked(old) // ended, and perhaps still closing its lanes
		}
		c.sess, c.last = s, s
		c.setStateLocked(connectivity.Ready)
		c.mu.Unlock()
		c.log.Info("tensorrpc: session open", "session", s.id, "transport", s.transport)
		return s, nil
	}
}

// sessionEnded is called by a session's watcher when its stream ends.
// The session stays in c.ending until its reader stops (ended).
func (c *Client) sessionEnded(s *clientSession, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sess != s {
		return
	}
	c.endingLocked(s)
	c.sess = nil
	c.lastErr = err
	if !c.closed {
		c.setStateLocked(connectivity.Idle)
		c.log.Info("tensorrpc: session ended; the next call opens a new one", "session", s.id, "err", err)
	}
}

// endingLocked keeps the ended session s in c.ending, for Close to wait
// for, until its reader stops (ended), unless it already has.
func (c *Client) endingLocked(s *clientSession) {
	select {
	case <-s.done: // its reader ran ended before it closed done
		return
	default:
	}
	if c.ending == nil {
		c.ending = map[*clientSession]struct{}{}
	}
	c.ending[s] = struct{}{}
}

// ended is called by a session's stream reader as it stops.
func (c *Client) ended(s *clientSession) {
	c.mu.Lock()
	delete(c.ending, s)
	c.mu.Unlock()
}

// backoffDelay is gRPC's connection backoff: base·multiplier^(n-1), capped
// at max, with ±jitter. The first retry after a session ends is at once
// (failures is 0 then); each failed attempt waits longer.
func backoffDelay(cfg backoff.Config, failures int) time.Duration {
	if failures <= 0 {
		return 0
	}
	d := float64(cfg.BaseDelay)
	for i := 1; i < failures && d < float64(cfg.MaxDelay); i++ {
		d *= cfg.Multiplier
	}
	d = min(d, float64(cfg.MaxDelay))
	d *= 1 + cfg.Jitter*(2*rand.Float64()-1)
	return time.Duration(max(d, 0))
}

// release names server-side buffers the client no longer needs: a transfer
// by id, or every transfer of a call by the call's ref.
type release struct {
	sess    *clientSession
	id, ref uint64
}

// newRef names a call (a frame's ref) and the transfers it makes. Refs are
// random (math/rand/v2's generator is ChaCha8 seeded by the system), so
// they cannot be guessed.
func (c *Client) newRef() uint64 { return rand.Uint64() | 1 }

// releaseTransfer tells the server, in the background, that a transfer's
// buffer is no longer needed.
func (c *Client) releaseTransfer(s *clientSession, id uint64) {
	if id != 0 {
		c.queueRelease(release{sess: s, id: id})
	}
}

// releaseRef tells the server, in the background, to drop whatever a
// failed or cancelled call created.
func (c *Client) releaseRef(s *clientSession, ref uint64) {
	c.queueRelease(release{sess: s, ref: ref})
}

// maxQueuedReleases bounds the releases a lane may have queued, unsent:
// they wait only for the server's credits, and a server that withholds
// them would otherwise make the queue grow without end. Past it the
// session ends, which frees everything it held on the server.
const maxQueuedReleases = 1 << 14

// queueRelease queues a release on the session's frames: it rides the
// next frame on the lane the next call takes (the least busy), so that
// releases ride the calls' frames (the server takes a session's
// releases on any of its lanes). Only frames make transfers, so a session
// without a data plane has nothing to release.
func (c *Client) queueRelease(r release) {
	if r.sess.err() != nil {
		return // the session's end released it on the server
	}
	l := r.sess.lane()
	if l == nil || l.Frames == nil {
		return
	}
	select {
	case <-l.Dead:
		return // the session ends with its lane, and that releases it
	default:
	}
	l.Frames.QueueRelease(r.id, r.ref)
	if n := l.Frames.QueuedReleases(); n > maxQueuedReleases {
		l.Fail(status.Errorf(codes.Unavailable, "tensorrpc: %d releases wait for credits the server does not return; the session is ended, which frees what they name", n))
	}
}

// enter counts a call under way; it fails once Close has begun.
func (c *Client) enter() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return status.Error(codes.Canceled, "tensorrpc: client closed")
	}
	c.calls++
	return nil
}

// start begins a call: counted by enter (the caller defers leave when
// start succeeds), on the open session.
func (c *Client) start(ctx context.Context) (*clientSession, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	s, err := c.session(ctx)
	if err != nil {
		c.leave()
		return nil, err
	}
	return s, nil
}

// leave ends a call counted by enter.
func (c *Client) leave() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls--
	if c.calls == 0 && c.callsDone != nil {
		close(c.callsDone)
		c.callsDone = nil
	}
}

// untilClose is ctx, also cancelled when Close begins; stop releases it.
func (c *Client) untilClose(ctx context.Context) (_ context.Context, stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	unhook := context.AfterFunc(c.closing, cancel)
	return ctx, func() {
		unhook()
		cancel()
	}
}

// waitCalls waits up to d for the calls under way to return.
func (c *Client) waitCalls(d time.Duration) {
	c.mu.Lock()
	if c.calls == 0 {
		c.mu.Unlock()
		return
	}
	done := make(chan struct{})
	c.callsDone = done
	c.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// Close ends the session: the server releases what it holds for it, and
// the Client releases its data plane, its pool (unless WithPool) and its
// connection (when Dial made it). Tensors received from the Client must be
// released before Close; Close reports the pool's error when some are not.
// Close is idempotent.
//
// Close does not wait on the server for long: a session being opened is
// abandoned (its caller gets Canceled), and the releases still queued get
// about 2 s to reach the server (the session's end frees the rest there).
// Calls under way fail (Unavailable or Canceled), and Close waits up to
// about 2 s for them to return, so that the pool buffers they hold are
// back before it closes the pool; calls made after Close fail with
// Canceled.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	c.startClose()
	return c.teardown()
}

func (c *Client) teardown() error {
	c.mu.Lock()
	for c.connecting != nil { // an attempt under way sees closed and closes its session
		ch := c.connecting
		c.mu.Unlock()
		<-ch
		c.mu.Lock()
	}
	s := c.sess
	c.sess = nil
	ending := c.ending
	c.ending = nil
	c.setStateLocked(connectivity.Shutdown)
	c.mu.Unlock()
	if s != nil {
		s.close(errors.New("client closed"))
	}
	for e := range ending {
		e.close(errors.New("client closed"))
	}
	// Calls under way fail now that their session is closed (those on the
	// fallback's streams when Close began: untilClose); they give back the
	// pool buffers they hold as they return. Only then do the data planes'
	// opened transports and the connection go, which those calls may still be using.
	c.waitCalls(closeFlushTimeout)
	for _, d := range c.domains {
		d.Close()
	}
	if c.ownConn {
		c.cc.Close()
	}
	c.ctl.Close()
	var err error
	c.stage.close()
	c.stopTrim()
	if c.ownPool {
		err = c.pool.Close()
	}
	return err
}
