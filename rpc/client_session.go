package rpc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// clientSession is one session of a Client: the Session stream that keeps
// it alive, and its data plane.
type clientSession struct {
	id         string
	transport  string
	link       *engine.Link   // lane 0; nil for the grpc transport
	lanes      []*engine.Link // every lane, link first
	eager      int
	calls      callPlane
	rejections []Rejection
	ipc        *ipcClientSession // nil unless the session negotiated CUDA IPC
	// reservations: the server takes reserved Sends
	// (HandshakeResponse.send_reservations), which SendDevice pipelines.
	reservations bool
	// compression: the codecs both sides compress with
	// (HandshakeResponse.compression); none when either is off.
	compression []string
	// landing is the largest tensor a Fetch of the session lands (the
	// smaller of HandshakeResponse.fetch_landing and this side's
	// WithFetchLanding; 0: none), and hints the sizes its keys had.
	landing    int
	hints      landingHints
	replyHints replyHints
	// streamZ is the compression of the fallback streams this side sends
	// (nil: none).
	streamZ *engine.Compression

	cancel   context.CancelFunc // ends the Session stream
	done     <-chan struct{}    // closed when the stream's reader has stopped
	watchers sync.WaitGroup     // of the lanes (open)

	mu     sync.Mutex
	broken error // why the session ended, once it has
}

// path is how the session's calls travel (CallInfo.Path).
func (s *clientSession) path() string {
	if s.link == nil {
		return PathStream
	}
	return PathFrame
}

// err is nil while the session is open.
func (s *clientSession) err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.broken
}

// end marks the session ended and closes its data plane, so that calls
// under way on it fail with Unavailable.
func (s *clientSession) end(err error) {
	s.mu.Lock()
	if s.broken == nil {
		s.broken = endReason(err)
	}
	broken, lanes := s.broken, s.lanes
	s.mu.Unlock()
	engine.CloseLanes(lanes, broken)
}

// endReason is why a session ended, as calls report it. When the server
// went away (its connection closed: Stop, a restart, a crash) it says so in
// those words; the chain of the provider's errors that saw it stays
// reachable with errors.Is and errors.As.
func endReason(err error) error {
	if peerClosed(err) {
		return &sessionEnd{cause: err}
	}
	return fmt.Errorf("session ended: %w", err)
}

// peerClosed reports whether err says the server closed the connection: an
// end of file or reset on a data-plane link, or gRPC's Unavailable on the
// Session stream other than the server's "unknown or ended session".
func peerClosed(err error) bool {
	if engine.PeerClosed(err) {
		return true
	}
	st, ok := status.FromError(err)
	return ok && st.Code() == codes.Unavailable && !strings.Contains(st.Message(), errSessionGone)
}

type sessionEnd struct{ cause error }

func (e *sessionEnd) Error() string {
	return "session ended: the server closed the connection (it stopped, restarted or failed)"
}

func (e *sessionEnd) Unwrap() error { return e.cause }

// endByServer is end for a Session stream the server ended, after which
// onEnded runs (calls from then on open a new session). Calls already
// answered on the data plane must still get those answers, which travel
// on other connections than the stream's end and may arrive after it, so
// the lanes stay open until the server closes them (it does right after
// the stream) or, at most, answerLinger.
func (s *clientSession) endByServer(err error, onEnded func()) {
	s.mu.Lock()
	if s.broken == nil {
		s.broken = endReason(err)
	}
	broken, lanes := s.broken, s.lanes
	s.mu.Unlock()
	onEnded()
	engine.AwaitDead(lanes, answerLinger)
	engine.CloseLanes(lanes, broken)
}

// closeFlushTimeout bounds how long closing a session waits to send the
// releases still queued (and Client.Close for calls under way to return):
// a live server takes them in milliseconds, and the session's end frees
// the rest on the server anyway.
const closeFlushTimeout = 2 * time.Second

// answerLinger bounds how long a client keeps the lanes of a session the
// server ended.
const answerLinger = time.Second

// lane picks the lane for the next frame call: the least busy.
func (s *clientSession) lane() *engine.Link {
	return engine.LeastBusy(s.lanes)
}

// close ends the session from this side and waits for its reader and
// lane watchers.
func (s *clientSession) close(reason error) {
	if s.err() == nil && s.link != nil && s.link.Frames != nil {
		// Releases still queued go first: the server frees those
		// transfers now rather than when it notices the session's end.
		ctx, cancel := context.WithTimeout(context.Background(), closeFlushTimeout)
		engine.FlushLanes(ctx, s.lanes)
		cancel()
	}
	s.end(reason)
	s.cancel()
	<-s.done
	s.watchers.Wait()
}

// open records the data plane the session opened on. If the session's
// stream ended meanwhile, its lanes are closed at once. A lane that fails
// later (a broken frame, a lost connection) ends the session, and with it
// the stream, so that the next call opens a new one; ended runs then.
func (s *clientSession) open(lanes []*engine.Link, transport string, calls callPlane, ended func(error)) {
	s.mu.Lock()
	if len(lanes) > 0 {
		s.link, s.lanes = lanes[0], lanes
	}
	s.transport, s.calls = transport, calls
	broken := s.broken
	s.mu.Unlock()
	if broken != nil {
		engine.CloseLanes(lanes, broken)
		return
	}
	if len(lanes) == 0 {
		return
	}
	engine.OnDead(lanes, &s.watchers, func(err error) {
		s.mu.Lock()
		if s.broken != nil {
			s.mu.Unlock()
			return
		}
		s.broken = endReason(err)
		broken := s.broken
		s.mu.Unlock()
		s.cancel()
		ended(err)
		// Answers the server sent on the other lanes before this one died
		// (a server that answers and exits closes its connections in no
		// particular order) still arrive: those lanes stay open until
		// they die too or answerLinger, as after endByServer.
		engine.AwaitDead(lanes, answerLinger)
		engine.CloseLanes(lanes, broken)
	})
}

// check returns the Unavailable error of an ended session, else nil.
func (s *clientSession) check() error {
	if err := s.err(); err != nil {
		return status.Errorf(codes.Unavailable, "tensorrpc: %v", err)
	}
	return nil
}

// openSession opens the Session stream, offers every opened data plane and
// uses the first the server chooses that both sides connect and verify.
// ctx bounds the negotiation only; the stream lives until the session ends.
func (c *Client) openSession(ctx context.Context) (*clientSession, error) {
	sctx, cancel := context.WithCancel(context.Background())
	s := &clientSession{cancel: cancel, rejections: append([]Rejection(nil), c.missing...)}
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	stream, err := c.api.Session(sctx)
	if err != nil {
		cancel()
		return nil, negotiationError(ctx, err)
	}
	// The stream's end is the session's end.
	reader := engine.ReadStream(stream.Recv, nil, func(err error) {
		s.endByServer(err, func() { c.sessionEnded(s, err) })
		s.mu.Lock() // the stream may end while the handshake is still read
		ipc := s.ipc
		s.mu.Unlock()
		ipc.close()
		c.ended(s)
	})
	s.done = reader.Ended()
	// next reads the server's next message, until ctx or the caller's
	// rctx (ctx or one under it) ends.
	next := func(rctx context.Context) (*pb.SessionResponse, error) {
		msg, err := reader.Next(rctx)
		if err != nil {
			return nil, negotiationError(ctx, err)
		}
		return msg, nil
	}
	fail := func(err error) (*clientSession, error) {
		s.close(err)
		return nil, err
	}

	links := map[pb.Transport][]*engine.Link{} // each offer's lanes
	defer func() {
		for _, lanes := range links {
			if lanes[0] != s.link {
				engine.CloseLanes(lanes, errors.New("not chosen"))
			}
		}
	}()
	hs := &pb.HandshakeRequest{ProtocolVersion: ProtocolVersion, ClientName: c.opts.name, Compression: c.opts.compressionOffer()}
	for _, name := range c.opts.transports {
		dom := c.domains[name]
		if name == TransportGRPC || dom == nil {
			continue
		}
		lanes, err := engine.NewLanes(ctx, dom, c.ctl, netip.Addr{}, verbs.RoleDial, max(1, c.opts.lanesFor(name)))
		if len(lanes) == 0 {
			s.rejections = append(s.rejections, newRejection(name, "client", err.Error()))
			continue
		}
		if err != nil {
			c.log.Info("tensorrpc: fewer lanes", "transport", name, "lanes", len(lanes), "err", err)
		}
		links[transportOf(name)] = lanes
		hs.Offers = append(hs.Offers, &pb.TransportOffer{Transport: transportOf(name), Info: lanes[0].QP.LocalInfo(), Description: dom.Name, Lanes: engine.LaneInfos(lanes[1:])})
	}
	cudaOffer, rej := c.opts.cudaOffer()
	if rej != nil {
		s.rejections = append(s.rejections, *rej)
	}
	hs.Cuda = cudaOffer
	if err := stream.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: hs}}); err != nil {
		return fail(negotiationError(ctx, err))
	}
	msg, err := next(ctx)
	if err != nil {
		return fail(err)
	}
	resp := msg.GetHandshake()
	if resp == nil {
		return fail(status.Error(codes.Internal, "tensorrpc: server did not answer the handshake"))
	}
	s.id = resp.SessionId
	s.eager = int(resp.EagerThreshold)
	s.reservations = resp.SendReservations
	s.landing = int(min(resp.FetchLanding, uint64(c.opts.fetchLanding)))
	s.compression = resp.Compression
	s.streamZ = c.opts.newStreamSqueeze(resp.Compression)
	for _, r := range resp.Rejected {
		s.rejections = append(s.rejections, newRejection(transportName(r.Transport), "server", r.Reason))
	}
	ipc, rejs := c.cudaAccept(cudaOffer != nil, resp.Cuda)
	s.mu.Lock()
	s.ipc = ipc
	s.mu.Unlock()
	s.rejections = append(s.rejections, rejs...)
	for {
		msg, err := next(ctx)
		if err != nil {
			return fail(err)
		}
		choice := msg.GetChoice()
		if choice == nil {
			return fail(status.Error(codes.Internal, "tensorrpc: expected the server's choice of data plane"))
		}
		if choice.Transport == pb.Transport_TRANSPORT_GRPC {
			if !enabled(&c.opts, TransportGRPC) {
				return fail(status.Errorf(codes.FailedPrecondition, "tensorrpc: no data plane connected and the grpc fallback is disabled: %s", rejectionText(s.rejections)))
			}
			if err := c.probeStreams(ctx); err != nil {
				return fail(err)
			}
			s.open(nil, TransportGRPC, streams{c: c, s: s}, nil)
			break
		}
		lanes := links[choice.Transport]
		if lanes == nil {
			return fail(status.Errorf(codes.Internal, "tensorrpc: server chose %s, which was not offered", choice.Transport))
		}
		if n := 1 + len(choice.Lanes); n > len(lanes) {
			return fail(status.Errorf(codes.Internal, "tensorrpc: server chose %d lanes of %s, %d were offered", n, choice.Transport, len(lanes)))
		} else {
			engine.CloseLanes(lanes[n:], errors.New("not chosen"))
			lanes = lanes[:n]
			links[choice.Transport] = lanes
		}
		name := transportName(choice.Transport)
		for _, l := range lanes {
			l.EnableFrames(engine.SlotSizeFor(s.eager), nil, nil)
		}
		rej, err := c.tryConnect(ctx, stream.Send, next, s, lanes, choice)
		if err != nil {
			return fail(err)
		}
		if rej == nil {
			c.opts.squeeze(lanes, name, s.compression, &c.stats, c.log, s.id)
			s.open(lanes, name, framePlane{c: c, s: s}, func(err error) { c.sessionEnded(s, err) })
			break
		}
		s.rejections = append(s.rejections, *rej)
		delete(links, choice.Transport)
		engine.CloseLanes(lanes, errors.New("did not connect"))
	}
	for _, r := range s.rejections {
		c.log.Info("tensorrpc: data plane not used", "transport", r.Transport, "side", r.Side, "reason", r.Reason, "fix", r.Fix)
	}
	return s, nil
}

// tryConnect connects and verifies the data plane the server chose. It
// returns the rejection when the plane is not usable, or an error when the
// session itself failed.
func (c *Client) tryConnect(ctx context.Context, send func(*pb.SessionRequest) error, next func(context.Context) (*pb.SessionResponse, error), s *clientSession, lanes []*engine.Link, choice *pb.TransportOffer) (*Rejection, error) {
	o, err := engine.Negotiate(ctx, engine.Negotiation{
		Role: verbs.RoleDial, Session: s.id, Transport: choice.Transport,
		Lanes: lanes, Remotes: append([][]byte{choice.Info}, choice.Lanes...), Timeout: c.opts.connectTimeout,
		Send: func(r *pb.ConnectResult) error {
			return send(&pb.SessionRequest{Msg: &pb.SessionRequest_ConnectResult{ConnectResult: r}})
		},
		Recv: func(ctx context.Context) (*pb.ConnectResult, error) {
			msg, err := next(ctx)
			return msg.GetConnectResult(), err
		},
	})
	switch {
	case err != nil:
		return nil, negotiationError(ctx, err)
	case o.Reason == "":
		return nil, nil
	case o.Theirs:
		return rejectionPtr(transportName(choice.Transport), "server", o.Reason), nil
	}
	return rejectionPtr(transportName(choice.Transport), "client", o.Reason), nil
}

func rejectionPtr(transport, side, reason string) *Rejection {
	r := newRejection(transport, side, reason)
	return &r
}

// rejectionText lists rejections for error messages.
func rejectionText(rs []Rejection) string {
	if len(rs) == 0 {
		return "no data plane was offered"
	}
	var parts []string
	for _, r := range rs {
		parts = append(parts, r.String())
	}
	return strings.Join(parts, "; ")
}

// probeStreams checks, for a session on the gRPC plane, that the gRPC
// connection takes a stream beside the session's: each of that plane's
// calls is a stream of its own, and a server that allows one stream per
// connection (grpc.MaxConcurrentStreams(1)) would leave every call waiting
// for its deadline. The check is local, as the client knows the server's
// limit from the connection's HTTP/2 settings: it opens a FetchStream, as
// the plane's Fetch does, and cancels it before it carries a message (the
// server's FetchStream method never runs; interceptors on both sides see a
// cancelled stream). It waits up to the
// connect timeout (WithConnectTimeout) or Dial's deadline, whichever is
// sooner, as a stream on a connection another user of a shared ClientConn
// (NewClient) fills may take a while. Errors other than that wait's end
// are the calls' to meet: they pass.
func (c *Client) probeStreams(ctx context.Context) error {
	start := time.Now()
	pctx, cancel := context.WithTimeout(ctx, c.opts.connectTimeout)
	defer cancel()
	_, err := c.cc.NewStream(pctx, &grpc.StreamDesc{StreamName: "FetchStream", ServerStreams: true}, pb.TensorRPC_FetchStream_FullMethodName, chunkcodec.CallOptions()...)
	switch {
	case err == nil:
		return nil // the deferred cancel ends the stream
	case errors.Is(pctx.Err(), context.DeadlineExceeded):
		return status.Errorf(codes.FailedPrecondition, "tensorrpc: the gRPC plane was chosen, but the connection to the server opened no stream beside the session's in %v: each of that plane's calls needs one, and a server with grpc.MaxConcurrentStreams(1) leaves none; allow the server at least 2 streams per connection, or connect a data plane", time.Since(start).Round(time.Millisecond))
	case ctx.Err() != nil:
		return negotiationError(ctx, err)
	}
	c.log.Debug("tensorrpc: the gRPC plane's stream check failed", "err", err)
	return nil
}

func negotiationError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if err == nil {
		err = errors.New("session stream ended")
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(codes.Unavailable, "tensorrpc: session: %v", err)
}
