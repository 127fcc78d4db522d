package rpc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// serverSession is the server's side of one client session: its policy
// (who the client is, its admission, quota and statistics) over the
// engine's session, which holds its transfers, pulls and frame calls.
type serverSession struct {
	*engine.Session

	id        string
	client    string
	owner     string // connectionIdentity of the Session stream
	peer      string // peerIdentity: whose budgets the session counts against
	addr      string // the client's address, for interceptors
	lanesHeld int    // lanes admitted (admission.lanes) for the session's plane
	transport string
	// streamZ is the compression of the fallback streams the server sends
	// the session's client (FetchStream's answers; nil: none).
	streamZ *engine.Compression
	link    *engine.Link   // lane 0; nil for the grpc transport
	lanes   []*engine.Link // every lane, link first
	stats   counters
	ipc     *ipcServerSession // nil unless the session negotiated CUDA IPC

	// activity counts the calls that named the session (reapIdle);
	// unary, those of them on gRPC methods still under way.
	activity atomic.Uint64
	unary    atomic.Int64
	// answeredNow counts the Fetches fetchNow answered in the polling
	// goroutine.
	answeredNow atomic.Int64

	mu       sync.Mutex
	reserved int64 // bytes charged to the session while they come in
}

// busy reports whether the session has a call under way or holds
// anything: then it is not idle, however long since its last call.
func (ss *serverSession) busy() bool {
	if ss.unary.Load() > 0 || ss.Holding().Busy() {
		return true
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.reserved > 0
}

// charge counts n bytes coming into the server's pool for the session
// (pulled, or a call's inline tensors) against the session's quota.
func (ss *serverSession) charge(n, quota int64) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.reserved+n > quota {
		return status.Errorf(codes.ResourceExhausted, "tensorrpc: session quota: %d bytes reserved, %d more would pass the session's quota of %d (the server's rpc.WithSessionQuota raises it)", ss.reserved, n, quota)
	}
	ss.reserved += n
	return nil
}

func (ss *serverSession) refund(n int64) {
	ss.mu.Lock()
	ss.reserved -= n
	ss.mu.Unlock()
}

// Session implements the Session method: negotiation, then the session's
// life, which ends with the stream.
func (s service) Session(stream pb.TensorRPC_SessionServer) error {
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		return status.Error(codes.Unavailable, "tensorrpc: server stopping")
	}
	s.active.Add(1)
	s.mu.Unlock()
	defer s.active.Done()
	ctx := stream.Context()

	// The stream's end is the session's end.
	reader := engine.ReadStream(stream.Recv, s.drain, nil)
	// next reads the client's next message, until the stream, the server
	// or the caller's rctx (ctx or one under it) ends.
	next := func(rctx context.Context) (*pb.SessionRequest, error) {
		msg, err := reader.Next(rctx)
		switch {
		case err == io.EOF:
			return nil, status.Error(codes.Canceled, "tensorrpc: the client ended the session stream")
		case err == engine.ErrStopped:
			return nil, status.Error(codes.Unavailable, "tensorrpc: server stopping")
		}
		return msg, err
	}

	first, err := next(ctx)
	if err != nil {
		return err
	}
	hs := first.GetHandshake()
	if hs == nil {
		return status.Error(codes.InvalidArgument, "tensorrpc: a session starts with a handshake")
	}
	// Versions 1 and 2 differ only in how data planes connect and carry
	// calls, so a client that offers none speaks all three; it is answered
	// in its own version.
	version := uint32(ProtocolVersion)
	if hs.ProtocolVersion != ProtocolVersion {
		if hs.ProtocolVersion < 1 || hs.ProtocolVersion > ProtocolVersion || offersDataPlane(hs.Offers) {
			return status.Errorf(codes.FailedPrecondition, "tensorrpc: protocol version %d, server speaks %d (and 1 or 2 from a client that offers no data plane)", hs.ProtocolVersion, ProtocolVersion)
		}
		version = hs.ProtocolVersion
	}
	peerID := peerIdentity(ctx)
	endAdmission, err := s.adm.session(peerID)
	if err != nil {
		return s.refuse(&s.refused.refusedSessions, 1, peerID, err)
	}
	defer endAdmission()
	ss := &serverSession{
		id: newSessionID(), client: hs.ClientName, owner: connectionIdentity(ctx), peer: peerID, addr: peerAddr(ctx),
	}
	// A transfer refused over the session's budget is counted, and the
	// first one logged.
	ss.Session = engine.NewSession(ctx, s.adm.limits.TransfersPerSession, func(err error) {
		if ss.stats.refusedTransfers.Add(1) == 1 {
			s.log.Info("tensorrpc: refused over budget", "peer", peerID, "session", ss.id, "reason", status.Convert(err).Message())
		}
	})
	defer ss.End()

	// Make a queue pair for every offer the server can use, by priority;
	// reject the rest. The tcp plane listens on the address this session's
	// gRPC connection arrived on, which the client could reach.
	local := localAddress(ctx)
	var candidates []candidate
	var rejected []*pb.TransportRejection
	defer func() {
		for _, c := range candidates {
			if c.link != ss.link {
				c.link.Close(errors.New("not chosen"))
			}
		}
	}()
	for _, offer := range hs.Offers {
		name := transportName(offer.Transport)
		reason := ""
		switch {
		case name == TransportGRPC || slices.ContainsFunc(candidates, func(c candidate) bool { return c.offer.Transport == offer.Transport }):
			continue
		case !enabled(&s.opts, name):
			reason = "not enabled on the server"
		case s.domains[name] == nil:
			reason = s.missing[name]
			if reason == "" {
				reason = "unknown transport"
			}
		default:
			l, err := engine.NewLink(ctx, s.domains[name], s.ctl, local, verbs.RoleAccept)
			if err != nil {
				reason = err.Error()
				break
			}
			candidates = append(candidates, candidate{offer: offer, link: l})
		}
		if reason != "" {
			rejected = append(rejected, &pb.TransportRejection{Transport: offer.Transport, Reason: reason})
			r := newRejection(name, "server", reason)
			s.log.Info("tensorrpc: data plane not used", "session", ss.id, "transport", name, "reason", reason, "fix", r.Fix)
		}
	}
	slices.SortStableFunc(candidates, func(a, b candidate) int {
		return priority(transportName(a.offer.Transport)) - priority(transportName(b.offer.Transport))
	})
	cuda, ipc := s.cudaAnswer(hs.Cuda)
	if cuda != nil && !cuda.Ipc {
		s.log.Info("tensorrpc: CUDA IPC not used", "session", ss.id, "reason", cuda.Reason)
	}
	ss.ipc = ipc
	agreed := s.opts.compressionAgreed(hs.Compression)
	ss.streamZ = s.opts.newStreamSqueeze(agreed)
	if err := stream.Send(&pb.SessionResponse{Msg: &pb.SessionResponse_Handshake{Handshake: &pb.HandshakeResponse{
		ProtocolVersion: version, SessionId: ss.id, Rejected: rejected, EagerThreshold: uint64(s.opts.eagerThreshold), Cuda: cuda,
		SendReservations: !s.opts.noReservations, Compression: agreed, FetchLanding: uint64(s.opts.fetchLanding),
	}}}); err != nil {
		return err
	}

	// open registers the session once its data plane is settled and before
	// the client hears so: the client may call as soon as it does.
	open := func(lanes []*engine.Link, transport string) error {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.stopping {
			return status.Error(codes.Unavailable, "tensorrpc: server stopping")
		}
		if len(lanes) > 0 {
			ss.link, ss.lanes = lanes[0], lanes
		}
		ss.transport = transport
		s.opts.squeeze(lanes, transport, agreed, &ss.stats, s.log, ss.id)
		s.sessions[ss.id] = ss
		// Last: a frame call that sees its lane opened sees the fields
		// above (an atomic store orders the writes before it).
		for _, l := range lanes {
			l.Opened.Store(true)
		}
		return nil
	}
	opened := false
	defer func() {
		if !opened {
			s.mu.Lock()
			delete(s.sessions, ss.id)
			s.mu.Unlock()
			s.closeSession(ss)
		}
	}()
	for _, c := range candidates {
		reason, err := s.tryConnect(ctx, stream.Send, next, ss, c, open)
		if err != nil {
			return err
		}
		if reason == "" {
			opened = true
			break
		}
		r := newRejection(transportName(c.offer.Transport), "server", reason)
		s.log.Info("tensorrpc: data plane not used", "session", ss.id, "transport", r.Transport, "reason", reason, "fix", r.Fix)
	}
	if !opened {
		if !enabled(&s.opts, TransportGRPC) {
			var reasons []string
			for _, r := range rejected {
				reasons = append(reasons, fmt.Sprintf("%s: %s", transportName(r.Transport), r.Reason))
			}
			if len(candidates) > 0 {
				reasons = append(reasons, "no offered data plane connected")
			}
			return status.Errorf(codes.FailedPrecondition, "tensorrpc: no data plane connected and the server's grpc fallback is disabled: %s", strings.Join(reasons, "; "))
		}
		if err := open(nil, TransportGRPC); err != nil {
			return err
		}
		if err := stream.Send(&pb.SessionResponse{Msg: &pb.SessionResponse_Choice{Choice: &pb.TransportOffer{Transport: pb.Transport_TRANSPORT_GRPC}}}); err != nil {
			return err
		}
		opened = true
	}
	s.log.Info("tensorrpc: session open", "session", ss.id, "client", ss.client, "transport", ss.transport, "lanes", max(len(ss.lanes), 1))

	// The session lives until the client ends the stream (or dies), the
	// data plane fails, or the server stops.
	var dead <-chan struct{}
	var failure func() error
	if ss.link != nil {
		dead, failure = ss.Watch(ss.lanes)
	}
	var result error
	var idle <-chan time.Time
	lastActivity, lastActive := ss.activity.Load(), time.Now()
	if d := s.adm.limits.IdleSession; d > 0 {
		tick := time.NewTicker(max(d/4, time.Millisecond))
		defer tick.Stop()
		idle = tick.C
	}
	var stale <-chan time.Time
	if s.opts.reserveTimeout > 0 {
		tick := time.NewTicker(max(s.opts.reserveTimeout/4, time.Millisecond))
		defer tick.Stop()
		stale = tick.C
	}
wait:
	for {
		select {
		case <-idle:
			if n := ss.activity.Load(); n != lastActivity || ss.busy() {
				lastActivity, lastActive = n, time.Now()
			} else if d := s.adm.limits.IdleSession; time.Since(lastActive) > d {
				result = status.Errorf(codes.Unavailable, "tensorrpc: the session made no call and held nothing for %v (the server's Admission.IdleSession) and was ended; the next call opens a new one", d)
				s.log.Info("tensorrpc: ending an idle session", "peer", ss.peer, "session", ss.id, "idle", d)
				break wait
			}
		case <-stale:
			if ss.StaleReservation(s.opts.reserveTimeout) {
				result = status.Errorf(codes.ResourceExhausted, "tensorrpc: a read of the client's memory stayed unanswered for over %v; the session is ended and its memory freed", s.opts.reserveTimeout)
				s.log.Info("tensorrpc: ending a session whose client leaves a read unanswered", "session", ss.id, "timeout", s.opts.reserveTimeout)
				break wait
			}
		case <-reader.Ended():
			break wait
		case <-dead:
			// Let the error reach the peer over the data plane first (its
			// request fails with the precise status, e.g. a remote access
			// error, rather than with the session's end).
			time.Sleep(deadPlaneLinger)
			result = engine.Unavailable(failure())
			break wait
		case <-s.drain:
			result = status.Error(codes.Unavailable, "tensorrpc: server stopping")
			if s.graceful.Load() {
				ss.FinishCalls(ctx, s.opts.gracefulStop)
			}
			break wait
		case <-ctx.Done():
			break wait
		}
	}
	s.closeSession(ss) // before it leaves Sessions, so its buffers are back by then
	s.adm.freeLanes(ss.peer, ss.lanesHeld)
	s.mu.Lock()
	delete(s.sessions, ss.id)
	s.total.merge(&ss.stats)
	s.mu.Unlock()
	s.log.Info("tensorrpc: session closed", "session", ss.id, "reason", result)
	return result
}

// offersDataPlane reports whether offers name a data plane (an offer of
// TRANSPORT_GRPC names none).
func offersDataPlane(offers []*pb.TransportOffer) bool {
	return slices.ContainsFunc(offers, func(o *pb.TransportOffer) bool { return o.Transport != pb.Transport_TRANSPORT_GRPC })
}

// deadPlaneLinger is how long a session outlives its dead data plane.
const deadPlaneLinger = 100 * time.Millisecond

// candidate is a data plane the client offered and the server can use,
// with the server's queue pair for it.
type candidate struct {
	offer *pb.TransportOffer
	link  *engine.Link
}

// localAddress is this host's address on the gRPC connection of ctx's
// call, or the zero Addr when it is not an IP connection.
func localAddress(ctx context.Context) netip.Addr {
	p, ok := peer.FromContext(ctx)
	if !ok || p.LocalAddr == nil {
		return netip.Addr{}
	}
	if ta, ok := p.LocalAddr.(*net.TCPAddr); ok {
		if a, ok := netip.AddrFromSlice(ta.IP); ok {
			return a.Unmap()
		}
	}
	return netip.Addr{}
}

// tryConnect offers one data plane to the client, connects it and verifies
// it with a round trip (see the Session method in the .proto). It returns
// why the plane is not used ("" when the session is open on it), or an
// error when the session itself failed.
func (s *Server) tryConnect(ctx context.Context, send func(*pb.SessionResponse) error, next func(context.Context) (*pb.SessionRequest, error), ss *serverSession, c candidate, open func([]*engine.Link, string) error) (_ string, err error) {
	l, offer := c.link, c.offer
	name := transportName(offer.Transport)
	// Lanes: as many as the client offered and this side wants; fewer when
	// making one fails (the first failure is logged, not fatal).
	lanes := []*engine.Link{l}
	opened := false
	defer func() {
		if !opened {
			engine.CloseLanes(lanes[1:], errors.New("not chosen"))
		}
	}()
	want := min(1+len(offer.Lanes), s.opts.lanesFor(name))
	granted, err := s.adm.lanes(ss.peer, want)
	if err != nil {
		return "", s.refuse(&s.refused.refusedLanes, want, ss.peer, err)
	}
	defer func() {
		if opened {
			ss.lanesHeld = granted
		} else {
			s.adm.freeLanes(ss.peer, granted)
		}
	}()
	// Slots are allocated without waiting (postSlots): a session gets only
	// the lanes whose slots the control pool holds now.
	if n := engine.LanesAllowed(s.ctl, granted, engine.SlotSizeFor(s.opts.eagerThreshold)); n < granted {
		s.adm.freeLanes(ss.peer, granted-n)
		granted = n
	}
	if granted == 0 {
		return "", s.refuse(&s.refused.refusedLanes, want, ss.peer, status.Errorf(codes.ResourceExhausted,
			"tensorrpc: data plane lane refused: the control pool has no room for another lane's receive slots (%d lanes held in all; the server's rpc.WithAdmission Admission.Lanes should be set below what the pool holds)", s.adm.heldLanes()))
	}
	if granted < want {
		s.refused.refusedLanes.Add(int64(want - granted))
		s.log.Info("tensorrpc: fewer lanes than asked, over budget", "peer", ss.peer, "session", ss.id, "transport", name, "lanes", granted, "want", want)
	}
	more, err := engine.NewLanes(ctx, s.domains[name], s.ctl, localAddress(ctx), verbs.RoleAccept, granted-1)
	if err != nil {
		s.log.Info("tensorrpc: fewer lanes", "session", ss.id, "transport", name, "lanes", 1+len(more), "want", want, "err", err)
	}
	lanes = append(lanes, more...)
	if len(lanes) < granted {
		s.adm.freeLanes(ss.peer, granted-len(lanes))
		granted = len(lanes)
	}
	if err := send(&pb.SessionResponse{Msg: &pb.SessionResponse_Choice{Choice: &pb.TransportOffer{
		Transport: offer.Transport, Info: l.QP.LocalInfo(), Description: s.domains[name].Name, Lanes: engine.LaneInfos(lanes[1:]),
	}}}); err != nil {
		return "", err
	}

	for i, x := range lanes {
		serve := func(h wire.FrameHeader, body []byte) {
			ss.activity.Add(1)
			s.serveFrame(ss, x, h, body)
		}
		if s.opts.frameServe != nil {
			serve = s.opts.frameServe(ss, i, serve)
		}
		// The transfers a client's frame releases come off the session's
		// books at once; the link frees them when it sees fit
		// (Framing.releases).
		x.EnableFrames(engine.SlotSizeFor(s.opts.eagerThreshold), serve, ss.RemoveForLater)
	}

	o, err := engine.Negotiate(ctx, engine.Negotiation{
		Role: verbs.RoleAccept, Session: ss.id, Transport: offer.Transport,
		Lanes: lanes, Remotes: append([][]byte{offer.Info}, offer.Lanes[:len(lanes)-1]...), Timeout: s.opts.connectTimeout,
		Send: func(r *pb.ConnectResult) error {
			return send(&pb.SessionResponse{Msg: &pb.SessionResponse_ConnectResult{ConnectResult: r}})
		},
		Recv: func(ctx context.Context) (*pb.ConnectResult, error) {
			msg, err := next(ctx)
			return msg.GetConnectResult(), err
		},
		Open: func() error {
			err := open(lanes, name)
			opened = err == nil
			return err
		},
	})
	if err != nil {
		return "", err // if the session opened, the handler's cleanup closes it
	}
	return o.String(), nil
}

// closeSession closes the data plane first, so nothing writes into the
// session's buffers any more, then releases them (engine.Session.Close).
func (s *Server) closeSession(ss *serverSession) {
	ss.Close(ss.lanes, errors.New("session ended"))
	s.endIPC(ss)
}
