package rpc

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// serverSession is the server's side of one client session.
type serverSession struct {
	id        string
	client    string
	transport string
	link      *link // nil for the grpc transport
	stats     counters

	mu        sync.Mutex
	transfers map[uint64]*transfer
	byImm     map[uint32]*transfer
	byRef     map[uint64][]uint64 // client_ref → transfer ids
	released  map[uint64]bool     // client_refs released before (or after) their call
	order     []uint64            // released refs, oldest first, to bound the set
	next      uint64
	closed    bool
}

// maxReleasedRefs bounds how many released client_refs a session
// remembers; a release that overtakes its call by more than this many
// releases is missed, and the session's end frees the transfer.
const maxReleasedRefs = 4096

// transfer is a buffer the server holds for a client: a tensor the client
// reads (fetch, call reply) until it releases it, or a destination the
// client writes into (send) until the immediate value completes it.
type transfer struct {
	id   uint64
	imm  uint32
	ref  uint64 // the client's name for the call that made it, or 0
	buf  *mempool.Buffer
	meta *pb.TensorMeta // for destinations
	hold bool           // a destination for a Call, not the rendezvous
	done chan struct{}  // closed when a destination is complete
	dest bool
}

// add registers a transfer made by the call the client named ref. It fails
// when the session has ended or the client has already released ref (the
// call was cancelled); the caller then still owns t.buf.
func (ss *serverSession) add(ctx context.Context, t *transfer, ref uint64) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return status.Error(codes.Unavailable, "tensorrpc: session ended")
	}
	if ss.released[ref] {
		return status.Error(codes.Canceled, "tensorrpc: the client released the call")
	}
	if err := ctx.Err(); err != nil {
		return status.FromContextError(err).Err()
	}
	ss.next++
	t.id = ss.next
	t.imm = uint32(t.id)
	t.ref = ref
	ss.transfers[t.id] = t
	if t.dest {
		ss.byImm[t.imm] = t
	}
	if ref != 0 {
		ss.byRef[ref] = append(ss.byRef[ref], t.id)
	}
	return nil
}

// remove takes a transfer out of the session; the caller owns its buffer.
func (ss *serverSession) remove(id uint64) *transfer {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.removeLocked(id)
}

func (ss *serverSession) removeLocked(id uint64) *transfer {
	t, ok := ss.transfers[id]
	if !ok {
		return nil
	}
	delete(ss.transfers, id)
	if t.dest {
		delete(ss.byImm, t.imm)
	}
	if t.ref != 0 {
		ids := ss.byRef[t.ref]
		for i, x := range ids {
			if x == id {
				ids = append(ids[:i], ids[i+1:]...)
				break
			}
		}
		if len(ids) == 0 {
			delete(ss.byRef, t.ref)
		} else {
			ss.byRef[t.ref] = ids
		}
	}
	return t
}

// releaseRef removes every transfer of the call named ref, and remembers
// ref so that transfers the call adds later are refused.
func (ss *serverSession) releaseRef(ref uint64) []*transfer {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	var out []*transfer
	for _, id := range append([]uint64(nil), ss.byRef[ref]...) {
		if t := ss.removeLocked(id); t != nil {
			out = append(out, t)
		}
	}
	if !ss.released[ref] {
		ss.released[ref] = true
		ss.order = append(ss.order, ref)
		if len(ss.order) > maxReleasedRefs {
			delete(ss.released, ss.order[0])
			ss.order = ss.order[1:]
		}
	}
	return out
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
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hs := first.GetHandshake()
	if hs == nil {
		return status.Error(codes.InvalidArgument, "tensorrpc: a session starts with a handshake")
	}
	if hs.ProtocolVersion != ProtocolVersion {
		return status.Errorf(codes.FailedPrecondition, "tensorrpc: protocol version %d, server speaks %d", hs.ProtocolVersion, ProtocolVersion)
	}
	ss := &serverSession{
		id: newSessionID(), client: hs.ClientName,
		transfers: map[uint64]*transfer{}, byImm: map[uint32]*transfer{}, byRef: map[uint64][]uint64{}, released: map[uint64]bool{},
	}

	// Sort the offers the server can use by priority; reject the rest.
	var candidates []*pb.TransportOffer
	var rejected []*pb.TransportRejection
	for _, offer := range hs.Offers {
		name := transportName(offer.Transport)
		switch {
		case name == TransportGRPC:
			continue
		case !enabled(&s.opts, name):
			rejected = append(rejected, &pb.TransportRejection{Transport: offer.Transport, Reason: "not enabled on the server"})
		case s.devices[name] == nil:
			reason := s.missing[name]
			if reason == "" {
				reason = "unknown transport"
			}
			rejected = append(rejected, &pb.TransportRejection{Transport: offer.Transport, Reason: reason})
		default:
			candidates = append(candidates, offer)
		}
	}
	slices.SortStableFunc(candidates, func(a, b *pb.TransportOffer) int {
		return priority(transportName(a.Transport)) - priority(transportName(b.Transport))
	})
	if err := stream.Send(&pb.SessionResponse{Msg: &pb.SessionResponse_Handshake{Handshake: &pb.HandshakeResponse{
		ProtocolVersion: ProtocolVersion, SessionId: ss.id, Rejected: rejected, EagerThreshold: uint64(s.opts.eagerThreshold),
	}}}); err != nil {
		return err
	}

	// open registers the session once its data plane is settled and before
	// the client hears so: the client may call as soon as it does.
	open := func(l *link, transport string) error {
		ss.link, ss.transport = l, transport
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.stopping {
			return status.Error(codes.Unavailable, "tensorrpc: server stopping")
		}
		s.sessions[ss.id] = ss
		return nil
	}
	unregister := func() {
		s.mu.Lock()
		delete(s.sessions, ss.id)
		s.mu.Unlock()
	}
	opened := false
	defer func() {
		if !opened {
			unregister()
			s.closeSession(ss)
		}
	}()
	for _, offer := range candidates {
		_, err := s.tryConnect(ctx, stream, ss, offer, open)
		if err == nil {
			opened = true
			break
		}
		if ss.link != nil {
			return err // opened, but the client did not hear of it
		}
		if ctx.Err() != nil {
			return status.FromContextError(ctx.Err()).Err()
		}
		s.log.Info("tensorrpc: data plane did not connect", "session", ss.id, "transport", transportName(offer.Transport), "err", err)
	}
	if ss.link == nil {
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
	s.log.Info("tensorrpc: session open", "session", ss.id, "client", ss.client, "transport", ss.transport)

	// The session lives until the client ends the stream (or dies), the
	// data plane fails, or the server stops.
	ended := make(chan error, 1)
	go func() {
		for {
			if _, err := stream.Recv(); err != nil {
				ended <- err
				return
			}
		}
	}()
	var dead <-chan struct{}
	if ss.link != nil {
		dead = ss.link.dead
	}
	var result error
	select {
	case <-ended:
	case <-dead:
		result = unavailable(ss.link.failure)
	case <-s.drain:
		result = status.Error(codes.Unavailable, "tensorrpc: server stopping")
	case <-ctx.Done():
	}
	s.closeSession(ss) // before it leaves Sessions, so its buffers are back by then
	s.mu.Lock()
	delete(s.sessions, ss.id)
	s.total.add(ss.stats.snapshot(""))
	s.mu.Unlock()
	s.log.Info("tensorrpc: session closed", "session", ss.id, "reason", result)
	return result
}

// tryConnect offers one data plane to the client and connects it. Both
// sides report their outcome; the data plane is used only when both
// connected.
func (s *Server) tryConnect(ctx context.Context, stream pb.TensorRPC_SessionServer, ss *serverSession, offer *pb.TransportOffer, open func(*link, string) error) (*link, error) {
	dev := s.devices[transportName(offer.Transport)]
	l, err := newLink(ctx, dev, s.pool)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&pb.SessionResponse{Msg: &pb.SessionResponse_Choice{Choice: &pb.TransportOffer{
		Transport: offer.Transport, Info: l.qp.LocalInfo(), Description: dev.name,
	}}}); err != nil {
		l.close(err)
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, s.opts.connectTimeout)
	defer cancel()
	mine := make(chan error, 1)
	go func() { mine <- l.connect(cctx, offer.Info, func(c verbs.Completion) { s.completeDestination(ss, c) }) }()
	msg, err := stream.Recv()
	if err != nil {
		cancel()
		<-mine
		l.close(err)
		return nil, err
	}
	theirs := msg.GetConnectResult()
	myErr := <-mine
	switch {
	case theirs == nil || theirs.Transport != offer.Transport:
		err = status.Error(codes.InvalidArgument, "tensorrpc: expected the client's connect result")
	case !theirs.Ok:
		err = fmt.Errorf("client: %s", theirs.Error)
	case myErr != nil:
		err = myErr
	default:
		err = open(l, transportName(offer.Transport)) // before the client hears
	}
	result := &pb.ConnectResult{Transport: offer.Transport, Ok: myErr == nil && err == nil}
	if myErr != nil {
		result.Error = myErr.Error()
	} else if err != nil && theirs != nil && theirs.Ok {
		result.Error = err.Error()
	}
	if err != nil {
		l.close(err)
	}
	if serr := stream.Send(&pb.SessionResponse{Msg: &pb.SessionResponse_ConnectResult{ConnectResult: result}}); serr != nil {
		if err == nil {
			err = serr // the session is open; the handler's cleanup closes it
		}
		return nil, err
	}
	if err != nil {
		return nil, err
	}
	return l, nil
}

// completeDestination handles a received WriteImm: the immediate value
// names the destination that is now complete.
func (s *Server) completeDestination(ss *serverSession, c verbs.Completion) {
	if c.Op != verbs.OpRecvImm || !c.HasImm {
		return
	}
	ss.mu.Lock()
	t, ok := ss.byImm[c.Imm]
	if ok {
		delete(ss.byImm, c.Imm)
		if !t.hold {
			ss.removeLocked(t.id)
		}
	}
	ss.mu.Unlock()
	if !ok {
		s.log.Warn("tensorrpc: write with an unknown immediate value", "session", ss.id, "imm", c.Imm)
		return
	}
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(int64(t.buf.Len()))
	if t.hold {
		close(t.done)
		return
	}
	dtype, shape := shapeOf(t.meta)
	zt, _ := zerocopy.New(dtype, shape, t.buf.Bytes())
	s.rv.publish(t.meta.Key, entry{tensor: zt, buf: t.buf})
}

// closeSession closes the data plane first, so nothing writes into the
// session's buffers any more, then releases them.
func (s *Server) closeSession(ss *serverSession) {
	if ss.link != nil {
		ss.link.close(errors.New("session ended"))
	}
	ss.mu.Lock()
	ss.closed = true
	transfers := ss.transfers
	ss.transfers, ss.byImm = map[uint64]*transfer{}, map[uint32]*transfer{}
	ss.mu.Unlock()
	for _, t := range transfers {
		t.buf.Release()
	}
}
