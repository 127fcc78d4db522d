package rpc

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rendezvous"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// ProtocolVersion is the version of the tensorrpc session protocol: 3,
// in which every data-plane session carries its calls as frames. A server
// also accepts 1 and 2 from a client that offers no data plane.
const ProtocolVersion = 3

// MaxChunkBytes is the most data one Chunk of a streaming method may carry,
// as tensorrpc.proto states; MaxRecvMsgBytes, the receive limit of the
// grpc.Server that NewServer makes, is that plus room for the Chunk's other
// fields. (A grpc.Server of the application's, see Register, keeps its own
// limit: 4 MiB unless it says otherwise.)
const (
	MaxChunkBytes   = 16 << 20
	MaxRecvMsgBytes = MaxChunkBytes + 64<<10
)

// Handler serves a method. The request's tensors belong to tensorrpc and
// are released when the handler returns; publish or copy a tensor to keep
// it. The reply's tensors pass to tensorrpc, which releases them once the
// client has them.
type Handler func(ctx context.Context, req *Message) (*Message, error)

// Server serves tensors to clients: a rendezvous of published tensors that
// clients fetch and send to, and methods they call. It is safe for
// concurrent use.
type Server struct {
	opts options
	log  *slog.Logger
	// sendPace is where small Sends run (see sendMode).
	sendPace handlerPace
	// readsFirst counts the Sends and Calls read first (postReadFirst),
	// for tests.
	readsFirst atomic.Int64
	pool       *mempool.Pool
	ownPool    bool
	ctl        *mempool.Pool // the links' own buffers
	grpc       *grpc.Server
	rv         *rendezvous.Rendezvous
	domains    map[string]*engine.Domain
	missing    map[string]string // transport → why its device did not open

	mu sync.Mutex
	// handlers has its own lock: every call looks its method up, and must
	// not wait on s.mu, which sessions take as they open and close.
	hmu      sync.RWMutex
	handlers map[string]registered
	sessions map[string]*serverSession
	stopping bool
	drain    chan struct{} // closed when sessions must end
	// graceful is set by GracefulStop before drain closes: sessions then
	// let the calls that arrived as frames finish (engine.Session.FinishCalls).
	graceful atomic.Bool
	active   sync.WaitGroup // running Session handlers
	streams  sync.WaitGroup // running fallback stream handlers
	total    counters       // of ended sessions, and of calls without a session

	adm     *admission
	refused counters // what adm refused (the Refused fields)

	stopTrim func()         // ends the pool's trimmer
	health   *healthService // nil with WithoutHealth
	stage    *stager

	ipc ipcServer // tensors published on a device (rpc/ipc_server.go)
}

// NewServer makes a Server: its pool (unless WithPool), its grpc.Server and
// the opened transport of every enabled data plane. A transport that cannot
// open is left out and reported to clients during negotiation.
func NewServer(opts ...ServerOption) (*Server, error) {
	o := buildServerOptions(opts)
	if o.envErr != nil {
		return nil, status.Error(codes.InvalidArgument, o.envErr.Error())
	}
	if _, err := o.compressionMode(); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	o.withCallLog()
	s := &Server{
		opts: o, log: o.logger, rv: rendezvous.New(),
		domains: map[string]*engine.Domain{}, missing: map[string]string{},
		handlers: map[string]registered{}, sessions: map[string]*serverSession{},
		drain: make(chan struct{}), adm: newAdmission(o.admission),
	}
	s.sendPace.leftBehind = &s.total.leftBehind
	if err := s.openPool(); err != nil {
		return nil, err
	}
	s.stage = newStager(s.pool, &o)
	s.stopTrim = func() {}
	if s.ownPool {
		s.stopTrim = trimmer(s.pool, o.trimInterval, s.log)
	}
	ctl, err := engine.NewControlPool()
	if err != nil {
		s.stopTrim()
		if s.ownPool {
			s.pool.Close()
		}
		return nil, fmt.Errorf("tensorrpc: making the control pool: %w", err)
	}
	s.ctl = ctl
	s.domains, s.missing = openDomains(&s.opts, s.pool, s.ctl, s.log)
	// The receive limit first, so that WithGRPCServerOptions can change
	// it: tensorrpc.proto promises Chunks of up to MaxChunkBytes.
	gopts := append([]grpc.ServerOption{grpc.MaxRecvMsgSize(MaxRecvMsgBytes)}, o.grpcServerOpts...)
	if o.creds != nil {
		gopts = append([]grpc.ServerOption{grpc.Creds(o.creds)}, gopts...)
	}
	s.grpc = grpc.NewServer(gopts...)
	pb.RegisterTensorRPCServer(s.grpc, service{Server: s})
	if !o.noHealth {
		s.health = newHealthService()
		s.health.register(s.grpc)
	}
	return s, nil
}

func (s *Server) openPool() error {
	if s.opts.pool != nil {
		s.pool = s.opts.pool
		return nil
	}
	p, err := mempool.NewPool(s.opts.poolOptions...)
	if err != nil {
		return fmt.Errorf("tensorrpc: making the pool: %w", err)
	}
	s.pool, s.ownPool = p, true
	return nil
}

// Register registers the tensorrpc service on gs, for a server that also
// serves other services. Serve, Stop and GracefulStop then belong to gs's
// owner; call Close after gs has stopped to release the Server. As with
// NewServer's own grpc.Server, gs's interceptors see the gRPC methods
// only; a data-plane session's calls travel as frames.
func (s *Server) Register(gs *grpc.Server) { pb.RegisterTensorRPCServer(gs, service{Server: s}) }

// service implements the gRPC service; it is separate from Server so that
// the service's methods do not clash with the Server's API.
type service struct {
	pb.UnimplementedTensorRPCServer
	*Server
}

// Serve accepts connections on lis until Stop or GracefulStop.
func (s *Server) Serve(lis net.Listener) error { return s.grpc.Serve(lis) }

// Pool is the pool the Server carves tensors from.
func (s *Server) Pool() *mempool.Pool { return s.pool }

// Handle registers h for method, replacing any handler it had. A small
// call of h (its request in the frame) runs where its frame is read; if it
// takes longer than a millisecond or two, the lane moves on without it
// and the method's next calls run on goroutines of their own for a while:
// h may block. See WithHandlerGoroutines and Inline.
func (s *Server) Handle(method string, h Handler, opts ...HandlerOption) {
	r := registered{h: h, pace: &handlerPace{leftBehind: &s.total.leftBehind}}
	for _, o := range opts {
		o(&r)
	}
	s.hmu.Lock()
	defer s.hmu.Unlock()
	s.handlers[method] = r
}

// registered is a handler with its options.
type registered struct {
	h      Handler
	inline bool
	pace   *handlerPace // where its calls run (not Inline ones)
}

// HandlerOption configures a handler (Handle).
type HandlerOption func(*registered)

// Inline says that the handler is short and never blocks: no network
// calls, no tensorrpc calls, no locks held for long, no waiting on
// channels. A call of it that arrives as a frame with its request tensors
// in the frame (the eager path: each at most the eager threshold), on a
// Server without interceptors that may block (WithInlineInterceptors'
// ones do not), then runs on the data plane's receiving
// goroutine as the frame is read, like a Fetch of a published tensor,
// instead of on a goroutine of its own: the call costs one goroutine and
// one wake-up fewer (eRPC's handlers that run in the dispatch thread).
// Other calls of the method run as any handler's do. A handler not Inline
// runs so too, watched: one that runs long is left behind (see
// WithHandlerGoroutines). An Inline one is not watched, and runs so even
// on a Server given WithHandlerGoroutines.
//
// While it runs, nothing else of its lane is read: a handler that blocks
// holds up every call of the lane, and one that waits for an answer from
// the same client can wait forever. Pool memory is not waited for in an
// inline call: its request tensors, and tensors it makes with the ctx it
// is given, take only what the pool has at hand (ResourceExhausted when
// full, where another call would wait).
func Inline() HandlerOption { return func(r *registered) { r.inline = true } }

// NewTensor allocates a tensor from the Server's pool, waiting while the
// pool is full until ctx ends. Publishing or returning it costs no copy.
// Its memory is not zeroed: pool memory is reused, so it may hold the bytes
// of an earlier tensor; write all of it (or clear(t.Bytes())) before use.
func (s *Server) NewTensor(ctx context.Context, dtype zerocopy.DType, shape []int64) (*Tensor, error) {
	return newTensor(ctx, s.pool, dtype, shape)
}

// PublishOption changes how Publish publishes a tensor.
type PublishOption func(*publishOptions)

type publishOptions struct {
	writable bool
	released func()
}

// Released gives PublishDeviceInPlace a function it calls once, from any
// goroutine, when the publish has ended (the key replaced, unpublished or
// taken, or the Server closed) and no client copies the tensor any more:
// the buffer is then the caller's again. It lets a caller hand a buffer
// over for as long as it is published, e.g. a reference to the tensor
// that owns it. It is called also when PublishDeviceInPlace fails.
// Publish refuses it.
func Released(fn func()) PublishOption { return func(o *publishOptions) { o.released = fn } }

// Writable lets clients write rows of the published tensor in place
// (Client.SendRows), each write visible to Fetches that start after it
// returns. Without it, SendRows of the key fails with PermissionDenied. A
// Server interceptor sees each write (OpSend, CallInfo.Name the key) and
// may refuse it per session or peer. A tensor from NewTensor is published
// without a copy, so its owner sees the writes in it.
func Writable() PublishOption { return func(o *publishOptions) { o.writable = true } }

// Publish makes t available under key to Fetch, replacing what key held.
// The Server keeps its own reference to t's memory (or a copy, for a
// wrapped tensor), so the caller may Release t after Publish returns.
//
// Publishing a wrapped tensor copies it into the pool, waiting for pool
// memory while the pool is full until ctx ends; tensors from NewTensor need
// neither.
func (s *Server) Publish(ctx context.Context, key string, t *Tensor, opts ...PublishOption) error {
	var po publishOptions
	for _, o := range opts {
		o(&po)
	}
	if t == nil || !t.Valid() {
		return status.Error(codes.InvalidArgument, "tensorrpc: Publish of a nil or invalid tensor")
	}
	if po.released != nil {
		return status.Error(codes.InvalidArgument, "tensorrpc: Released is an option of PublishDeviceInPlace, not Publish")
	}
	if po.writable {
		if _, _, err := rowBytesOf(t.DType(), t.Shape()); err != nil {
			return err
		}
	}
	buf, err := poolBuffer(ctx, s.pool, t, &s.total)
	if err != nil {
		return err
	}
	own, err := newPoolTensor(t.DType(), t.Shape(), buf)
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	seq := s.rv.NextSeq()
	if err := s.rv.Publish(key, rendezvous.Entry{Tensor: own.Tensor, Buf: own.buf, Writable: po.writable, Seq: seq}); err != nil {
		return rendezvousError(key, err)
	}
	s.ipc.unref(s.ipc.supersede(key, seq))
	return nil
}

// Unpublish removes key. It reports whether key was published. Transfers
// of the tensor already under way finish.
func (s *Server) Unpublish(key string) bool {
	removed := s.rv.Remove(key)
	if e := s.ipc.remove(key); e != nil {
		s.ipc.unref(e)
		removed = true
	}
	return removed
}

// Fetch returns the tensor published (locally or by a client's Send) under
// key. A key that is not published fails with NotFound, unless WaitForKey
// is given: then Fetch waits until it is or ctx ends. The tensor stays
// published; the caller releases the returned reference.
func (s *Server) Fetch(ctx context.Context, key string, opts ...FetchOption) (*Tensor, error) {
	return s.take(ctx, key, false, opts)
}

// Take is Fetch that also unpublishes the tensor: the caller gets the only
// reference.
func (s *Server) Take(ctx context.Context, key string, opts ...FetchOption) (*Tensor, error) {
	return s.take(ctx, key, true, opts)
}

func (s *Server) take(ctx context.Context, key string, remove bool, opts []FetchOption) (*Tensor, error) {
	var fo fetchOptions
	for _, o := range opts {
		o(&fo)
	}
	if e, ok, err := s.stagedDevice(ctx, key); ok {
		if err != nil {
			return nil, err
		}
		if remove {
			s.Unpublish(key)
		}
		return &Tensor{Tensor: e.Tensor, buf: e.Buf}, nil
	}
	e, err := s.rv.Fetch(ctx, key, remove, fo.wait)
	if err != nil {
		return nil, rendezvousError(key, err)
	}
	return &Tensor{Tensor: e.Tensor, buf: e.Buf}, nil
}

func rendezvousError(key string, err error) error {
	switch err {
	case rendezvous.ErrClosed:
		return status.Error(codes.Unavailable, "tensorrpc: server stopped")
	case rendezvous.ErrNotPublished:
		return status.Errorf(codes.NotFound, "tensorrpc: no tensor is published under key %q "+WaitHint, key)
	}
	return status.FromContextError(err).Err()
}

// Stats returns the totals over every session, ended or live.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	var all counters
	all.merge(&s.total)
	all.merge(&s.refused)
	for _, ss := range s.sessions {
		all.merge(&ss.stats)
	}
	st := all.snapshot("")
	st.PinnedArenas = s.stage.arenas()
	return st
}

// SessionInfo describes a live session.
type SessionInfo struct {
	ID     string
	Client string
	Stats  Stats
}

// Sessions lists the live sessions.
func (s *Server) Sessions() []SessionInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []SessionInfo
	for _, ss := range s.sessions {
		out = append(out, SessionInfo{ID: ss.id, Client: ss.client, Stats: ss.stats.snapshot(ss.transport)})
	}
	slices.SortFunc(out, func(a, b SessionInfo) int { return cmpString(a.ID, b.ID) })
	return out
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Stop closes every session and connection at once; calls under way fail.
// It then releases the Server's memory and opened transports.
func (s *Server) Stop() {
	s.endSessions()
	s.grpc.Stop()
	s.Close()
}

// GracefulStop stops accepting sessions, ends the open ones (clients see
// Unavailable on their next call) and those still negotiating, fails calls
// that wait for a key with Unavailable, and waits for calls under way to
// finish — at most WithGracefulStopTimeout, after which it ends them as
// Stop does. It then releases the Server like Stop.
func (s *Server) GracefulStop() {
	s.graceful.Store(true)
	s.endSessions()
	done := make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(done) }()
	timer := time.NewTimer(s.opts.gracefulStop)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		s.log.Info("tensorrpc: graceful stop timed out; stopping", "timeout", s.opts.gracefulStop)
		s.grpc.Stop()
		<-done
	}
	s.Close()
}

func (s *Server) endSessions() {
	if s.health != nil {
		s.health.shutdown()
	}
	s.mu.Lock()
	if !s.stopping {
		s.stopping = true
		close(s.drain)
	}
	s.mu.Unlock()
	s.rv.Stop()
}

// Close releases what the Server holds: sessions, published tensors,
// opened transports and its own pool. Stop and GracefulStop call it; call
// it yourself only for a Server put on a grpc.Server of your own
// (Register), after stopping that grpc.Server. Of the three ways to shut
// down, GracefulStop is the one a service uses on SIGTERM, Stop the one
// that does not wait. It
// returns the pool's error when buffers are still outstanding (tensors the
// application did not release).
func (s *Server) Close() error {
	s.endSessions()
	s.active.Wait()  // handlers release their sessions on the way out
	s.streams.Wait() // stream handlers take back their chunks on the way out
	s.mu.Lock()
	sessions := s.sessions
	s.sessions = map[string]*serverSession{}
	s.mu.Unlock()
	for _, ss := range sessions {
		s.closeSession(ss)
	}
	for _, e := range s.ipc.removeAll() {
		s.ipc.unref(e)
	}
	s.rv.Close()
	s.mu.Lock()
	domains := s.domains
	s.domains = map[string]*engine.Domain{}
	s.mu.Unlock()
	for _, d := range domains {
		d.Close()
	}
	if s.ctl != nil {
		s.ctl.Close()
	}
	s.stage.close()
	s.stopTrim()
	if s.ownPool {
		s.ownPool = false
		return s.pool.Close()
	}
	return nil
}

// WaitHint ends the NotFound of a Fetch of a key not published: how to
// wait for it. It names Go's API and the protocol's field; the C ABI and
// the Python package replace it with theirs.
const WaitHint = "(to wait for it, fetch with rpc.WaitForKey, or set FetchRequest.wait)"

// errSessionGone starts the message of calls naming a session the server
// does not have; clients recognise it to open a new session.
const errSessionGone = "unknown or ended session"

func newSessionID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// session returns the live session id names, or an error for an unknown
// one. An empty id is allowed (nil session): it is how plain gRPC clients
// that never opened a session call. A session belongs to the gRPC
// connection (and TLS identity) that opened it: a call naming it from any
// other connection fails with PermissionDenied, so a session id is no
// bearer token.
func (s *Server) session(ctx context.Context, id string) (*serverSession, error) {
	if id == "" {
		return nil, nil
	}
	s.mu.Lock()
	ss, ok := s.sessions[id]
	s.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.Unavailable, "tensorrpc: %s %q (the server restarted or ended it; open a new session)", errSessionGone, id)
	}
	if ss.owner != "" && connectionIdentity(ctx) != ss.owner {
		return nil, status.Errorf(codes.PermissionDenied, "tensorrpc: session %q belongs to another connection", id)
	}
	// The call keeps the session from being idle until it returns (gRPC
	// ends its context then).
	ss.activity.Add(1)
	ss.unary.Add(1)
	context.AfterFunc(ctx, func() { ss.unary.Add(-1) })
	return ss, nil
}

// connectionIdentity names the gRPC connection of ctx's call: the peer's
// address (one per connection) and, under TLS, the peer's certificate.
func connectionIdentity(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	id := p.Addr.Network() + "|" + p.Addr.String()
	if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
		sum := sha256.Sum256(ti.State.PeerCertificates[0].Raw)
		id += "|" + hex.EncodeToString(sum[:])
	}
	return id
}

// peerAddr is the address of the peer of ctx's call, "" when unknown.
func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

func (s *Server) handler(method string) (Handler, error) {
	s.hmu.RLock()
	defer s.hmu.RUnlock()
	r, ok := s.handlers[method]
	if !ok {
		return nil, status.Errorf(codes.Unimplemented, "tensorrpc: no handler for method %q", method)
	}
	return r.h, nil
}

// handlerOf is method's registration (zero if none).
func (s *Server) handlerOf(method string) registered {
	s.hmu.RLock()
	defer s.hmu.RUnlock()
	return s.handlers[method]
}
