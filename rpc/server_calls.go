package rpc

import (
	"context"
	"errors"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rendezvous"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Fetch implements the Fetch method: inline only (see offer).
func (s service) Fetch(ctx context.Context, req *pb.FetchRequest) (*pb.FetchResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	var resp *pb.FetchResponse
	err = s.intercept(ctx, ss, OpFetch, req.Key, PathUnary, 0, func(ctx context.Context, info *CallInfo) error {
		e, err := s.fetch(ctx, req.Key, req.Wait)
		if err != nil {
			return err
		}
		if req.Rows != nil {
			if e, err = s.gatherRows(ctx, ss, req.Key, e, req.Rows); err != nil {
				return err
			}
		}
		resp, err = s.fetchAnswer(ctx, ss, nil, 0, req.Key, e, s.opts.eagerThreshold, nil, nil)
		info.setResponse(int64(resp.GetMeta().GetByteLength()))
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

// fetch is the work of every Fetch, whatever path it came by (a frame,
// the Fetch method, FetchStream): the entry published under key, waited
// for with wait. Without wait it never blocks, which lets the polling
// goroutine's fetchNow use it too. The caller delivers the entry and
// releases its reference.
func (s *Server) fetch(ctx context.Context, key string, wait bool) (rendezvous.Entry, error) {
	if e, ok, err := s.stagedDevice(ctx, key); ok {
		return e, err
	}
	e, err := s.rv.Fetch(ctx, key, false, wait)
	if err != nil {
		return rendezvous.Entry{}, rendezvousError(key, err)
	}
	return e, nil
}

// fetchAnswer is a fetched entry offered to a session's client (l nil:
// the Fetch method's) as a FetchResponse; it takes over e's reference,
// offered and held as in offer.
//
// With land (a FETCH_REQ with a landing) a tensor above inlineMax is
// Written there, and the answer says it landed, where it fits
// (Server.land).
func (s *Server) fetchAnswer(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, key string, e rendezvous.Entry, inlineMax int, held *[]*mempool.Buffer, land *pb.FetchRequest) (*pb.FetchResponse, error) {
	if land != nil && len(e.Tensor.Bytes()) > inlineMax {
		if resp, ok := s.land(ss, l, key, e, land.Landing, land.LandingInto); ok {
			return resp, nil
		}
	}
	meta, inline, id, err := s.offer(ctx, ss, l, ref, key, e.Tensor, e.Buf, inlineMax, held)
	if err != nil {
		return nil, err
	}
	return &pb.FetchResponse{Meta: meta, InlineData: inline, TransferId: id}, nil
}

// offer hands a tensor to a client: inline when it is at most inlineMax
// bytes (or when it goes in an answer of a method, l nil), else as a
// transfer the client reads on the lane l. It takes over buf's
// reference. Inline bytes are a copy,
// or with held a view of buf, whose reference is added to *held for the
// caller to release once the bytes are sent.
func (s *Server) offer(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, key string, t zerocopy.Tensor, buf *mempool.Buffer, inlineMax int, held *[]*mempool.Buffer) (*pb.TensorMeta, []byte, uint64, error) {
	meta := metaOf(key, t, s.opts.checksums)
	n := len(t.Bytes())
	if n <= inlineMax || l == nil {
		if n > s.opts.eagerThreshold {
			buf.Release()
			return nil, nil, 0, status.Errorf(codes.FailedPrecondition,
				"tensorrpc: tensor %q of %d bytes is above the eager threshold (%d), the most the unary methods carry: use FetchStream (or CallStream for a call's reply)", key, n, s.opts.eagerThreshold)
		}
		var inline []byte
		if held != nil {
			inline = t.Bytes()[:n:n]
			*held = append(*held, buf)
		} else {
			inline = append([]byte(nil), t.Bytes()...)
			buf.Release()
		}
		s.countInline(ss, n)
		return meta, inline, 0, nil
	}
	g, err := l.Grant(buf, n, verbs.AccessRemoteRead)
	if err != nil {
		buf.Release()
		return nil, nil, 0, engine.Unavailable(err)
	}
	// Revoking may wait for the peer (on shm, until it unmapped the
	// grant): a failure is undone aside (finishAside), since offer also
	// runs where completions are handled (fetchNow).
	extra, striped, err := engine.GrantLanes(ss.lanes, l, g, n, func(x *engine.Link) (verbs.Grant, error) { return x.Grant(buf, n, verbs.AccessRemoteRead) })
	if err != nil {
		ss.FinishAside([]*engine.Transfer{{Buf: buf, Grant: g}})
		return nil, nil, 0, engine.Unavailable(err)
	}
	remote := g.Remote()
	tr := &engine.Transfer{Buf: buf, Grant: g, Stripes: extra}
	if err := ss.Add(ctx, tr, ref); err != nil {
		ss.FinishAside([]*engine.Transfer{tr})
		return nil, nil, 0, err
	}
	meta.Location = &pb.Location{
		Transport: transportOf(ss.transport), RegionId: buf.Arena().ID(), RemoteKey: remote.Key,
		Address: remote.Addr, Offset: uint64(buf.Offset()), Length: uint64(n), Lanes: striped,
	}
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(int64(n))
	return meta, nil, tr.ID, nil
}

// count applies f to the session's counters, or to the server's totals for
// calls without a session.
func (s *Server) count(ss *serverSession, f func(*counters)) {
	f(s.countersOf(ss))
}

// countersOf is where ss's counts go: its own, or the server's total
// without a session.
func (s *Server) countersOf(ss *serverSession) *counters {
	if ss != nil {
		return &ss.stats
	}
	return &s.total
}

// countInline counts a tensor of n bytes that went inline, in a control
// message, either way: its bytes were copied into or out of it.
func (s *Server) countInline(ss *serverSession, n int) {
	s.count(ss, func(c *counters) {
		c.transfers.Add(1)
		c.inlineBytes.Add(int64(n))
		if n > 0 {
			c.copied(n)
		}
	})
}

// Send implements the Send method: inline only.
func (s service) Send(ctx context.Context, req *pb.SendRequest) (*pb.SendResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	err = s.intercept(ctx, ss, OpSend, req.GetMeta().GetKey(), PathUnary, int64(req.GetMeta().GetByteLength()), func(ctx context.Context, _ *CallInfo) error {
		_, err := s.sendRequest(ctx, ss, nil, 0, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &pb.SendResponse{}, nil
}

// sendRequest is a SendRequest however it arrived (the Send method, l
// nil; a SEND_REQ on lane l, of the call the client named ref): its
// tensor is taken in and sent. It is published before the answer goes,
// so the sender's next Fetch sees it. A reserve's answer is the
// reservation (see send_reserve.go); every other answer is nil.
func (s *Server) sendRequest(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, req *pb.SendRequest) (*pb.SendResponse, error) {
	if (req.Reserve || req.Commit != 0) && !s.opts.noReservations {
		switch {
		case l == nil:
			return nil, status.Error(codes.FailedPrecondition, "tensorrpc: a reserve or commit needs a data-plane session: the Send method carries tensors inline")
		case req.Reserve && req.Commit != 0:
			return nil, status.Error(codes.InvalidArgument, "tensorrpc: a SendRequest both reserves and commits")
		case req.Reserve:
			return s.reserveSend(ctx, ss, l, ref, req)
		}
		return nil, s.commitSend(ss, req)
	}
	if req.Rows != nil {
		return nil, s.writeRows(ctx, ss, l, req)
	}
	t, seq, err := s.sentTensor(ctx, ss, l, req)
	if err != nil {
		return nil, err
	}
	return nil, s.send(req.Meta.Key, t, seq)
}

// send is the work of every Send, whatever path it came by (a frame, the
// Send method, SendStream), and of Publish: t, which the path brought
// into the pool, is published under key, ordered by seq (0: now) among
// the Sends and Publishes of key. It takes over t.
func (s *Server) send(key string, t *Tensor, seq uint64) error {
	if seq == 0 {
		seq = s.rv.NextSeq()
	}
	if err := s.rv.Publish(key, rendezvous.Entry{Tensor: t.Tensor, Buf: t.buf, Seq: seq}); err != nil {
		return rendezvousError(key, err)
	}
	s.ipc.unref(s.ipc.supersede(key, seq))
	return nil
}

// sentTensor takes a SendRequest's tensor into the pool: its inline
// bytes, or on a frame (l not nil) the bytes read from where its location
// names, with seq, the place in key's order of its arrival, taken before
// the read. The Send method carries tensors inline only.
func (s *Server) sentTensor(ctx context.Context, ss *serverSession, l *engine.Link, req *pb.SendRequest) (*Tensor, uint64, error) {
	m := req.Meta
	if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
		return nil, 0, err
	}
	n := int(m.ByteLength)
	switch {
	case m.Location == nil && l == nil && len(req.InlineData) == 0 && n > 0:
		return nil, 0, status.Errorf(codes.FailedPrecondition, "tensorrpc: tensor %q of %d bytes without inline data: the Send method carries tensors inline; use SendStream", m.Key, n)
	case m.Location == nil:
		if len(req.InlineData) != n {
			return nil, 0, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %d inline bytes for a %d-byte tensor", m.Key, len(req.InlineData), n)
		}
		t, err := s.inlineTensor(ctx, ss, m, req.InlineData)
		return t, 0, err
	case l == nil:
		return nil, 0, status.Error(codes.InvalidArgument, "tensorrpc: a sent tensor has no location")
	case len(req.InlineData) > 0:
		return nil, 0, status.Error(codes.InvalidArgument, "tensorrpc: a sent tensor with both inline data and a location")
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, status.FromContextError(err).Err() // released before it started
	}
	seq := s.rv.NextSeq()
	buf, err := s.pull(ctx, ss, l, m, false)
	if err != nil {
		return nil, 0, err
	}
	t, err := tensorOf(m, buf)
	return t, seq, err
}

// inlineTensor copies a request tensor's inline bytes into the pool.
func (s *Server) inlineTensor(ctx context.Context, ss *serverSession, m *pb.TensorMeta, inline []byte) (*Tensor, error) {
	if err := verifySum(m, inline); err != nil {
		return nil, err
	}
	buf, err := allocBuffer(ctx, s.pool, len(inline))
	if err != nil {
		return nil, err
	}
	copy(buf.Bytes(), inline)
	s.countInline(ss, len(inline))
	return tensorOf(m, buf)
}

// tensorOf is the tensor m describes over buf, which it takes over.
func tensorOf(m *pb.TensorMeta, buf *mempool.Buffer) (*Tensor, error) {
	dtype, shape := shapeOf(m)
	t, err := newPoolTensor(dtype, shape, buf)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return t, nil
}

// Release implements the Release method.
func (s service) Release(ctx context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	if ss == nil {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: Release needs a session")
	}
	engine.FinishAll(ss.RemoveAll(req.TransferIds))
	for _, ref := range req.ClientRefs {
		ss.CancelCall(ref) // a Fetch frame still waiting for its key
		engine.FinishAll(ss.ReleaseRef(ref))
	}
	return &pb.ReleaseResponse{}, nil
}

// Call implements the Call method.
func (s service) Call(ctx context.Context, req *pb.CallRequest) (*pb.CallResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	var resp *pb.CallResponse
	err = s.intercept(ctx, ss, OpCall, req.Method, PathUnary, metaBytes(req.Tensors), func(ctx context.Context, info *CallInfo) error {
		var err error
		resp, err = s.callRequest(ctx, ss, nil, 0, req, s.opts.eagerThreshold, nil)
		info.setResponse(metaBytes(resp.GetTensors()))
		return err
	})
	if err != nil {
		return nil, err // the unary methods make no transfers: nothing to take back
	}
	return resp, nil
}

// callRequest is a CallRequest however it arrived (the Call method, l
// nil; a CALL_REQ named ref on lane l): its tensors are taken in, and the
// reply offered as a CallResponse, as in reply.
func (s *Server) callRequest(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, req *pb.CallRequest, inlineMax int, held *[]*mempool.Buffer) (*pb.CallResponse, error) {
	var resp *pb.CallResponse
	err := s.call(ctx, ss, req.Method, req.Metadata, req.Tensors, func(ctx context.Context) ([]*Tensor, error) {
		ts, err := s.requestTensors(ctx, ss, l, req)
		if l != nil {
			recycleInlines(req.InlineData) // a frame's, decoded by fastCallRequest: copied into the pool now
		}
		return ts, err
	}, func(out *Message) error {
		var err error
		resp, err = s.reply(ctx, ss, l, ref, out, inlineMax, held, req.ReplyLandings)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

// call is the work of every Call, whatever path it came by (a frame, the
// Call method, CallStream): method's handler is looked up, the request's
// tensors (metas) are charged to the session's quota until the call ends
// (see chargeCall), load takes them in as the path carries them, the
// handler runs on them, and deliver gives its reply to the client. The
// request and the reply are released once deliver returns. A handler's
// error that is not a gRPC status becomes Unknown; a nil reply an empty
// one.
func (s *Server) call(ctx context.Context, ss *serverSession, method string, metadata []byte, metas []*pb.TensorMeta, load func(context.Context) ([]*Tensor, error), deliver func(*Message) error) error {
	h, err := s.handler(method)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return status.FromContextError(err).Err() // released before it started
	}
	charged, err := s.chargeCall(ss, metas)
	if err != nil {
		return err
	}
	if charged > 0 {
		defer ss.refund(charged)
	}
	ts, err := load(ctx)
	in := &Message{Metadata: metadata, Tensors: ts}
	defer in.Release()
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return status.FromContextError(err).Err() // cancelled while its tensors came
	}
	out, err := h(ctx, in)
	if err != nil {
		s.count(ss, func(c *counters) { c.errors.Add(1) })
		if out != nil {
			out.Release()
		}
		if _, ok := status.FromError(err); ok {
			return err
		}
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			return status.FromContextError(err).Err() // as gRPC reports a handler's context error
		}
		return status.Error(codes.Unknown, err.Error())
	}
	if out == nil {
		out = &Message{}
	}
	defer out.Release()
	return deliver(out)
}

// chargeCall counts the request tensors a call brings into the server's
// pool, inline and located ones, against the session's quota until the call ends, and
// returns the bytes charged, for the caller to refund (ss.refund) then. Several tensors may name the same inline
// bytes, each copied into a buffer of its own: without the charge, a few
// kilobytes of request could hold the pool's whole limit.
func (s *Server) chargeCall(ss *serverSession, metas []*pb.TensorMeta) (int64, error) {
	if ss == nil {
		return 0, nil
	}
	var n int64
	for _, m := range metas {
		if m == nil || (m.InlineIndex == nil && m.Location == nil) {
			continue
		}
		// A length past the limit fails checkMeta later; capped here so
		// that the sum cannot overflow.
		n += int64(min(m.ByteLength, uint64(s.opts.maxTensorBytes)+1))
	}
	if n == 0 {
		return 0, nil
	}
	if err := ss.charge(n, s.opts.sessionQuota); err != nil {
		return 0, err
	}
	return n, nil
}

// reply offers a handler's reply tensors to the client of the call named
// ref: inline up to inlineMax bytes, else written into the client's
// landings where they fit (the k-th tensor that does not go inline into
// landings[k]), else as transfers it reads; held as in offer.
func (s *Server) reply(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, out *Message, inlineMax int, held *[]*mempool.Buffer, landings []*pb.Location) (*pb.CallResponse, error) {
	resp := &pb.CallResponse{Metadata: out.Metadata}
	k := 0 // the tensors that did not go inline so far
	for i, t := range out.Tensors {
		buf, err := poolBuffer(ctx, s.pool, t, s.countersOf(ss))
		if err != nil {
			s.releaseTransfers(ss, resp.TransferIds)
			return nil, status.Errorf(codes.Internal, "tensorrpc: reply tensor %d: %v", i, err)
		}
		zt, _ := zerocopy.New(t.DType(), t.Shape(), buf.Bytes())
		if n := len(zt.Bytes()); n > inlineMax && l != nil {
			k++
			if k <= len(landings) && s.mayLand(ss, l, n, landings[k-1]) {
				meta := metaOf("", zt, s.opts.checksums) // before the Write, which may release buf at once
				if s.writeLanding(ss, l, buf, n, landings[k-1]) {
					idx := uint32(k - 1)
					meta.LandingIndex = &idx
					resp.Tensors = append(resp.Tensors, meta)
					continue
				}
			}
		}
		meta, inline, id, err := s.offer(ctx, ss, l, ref, "", zt, buf, inlineMax, held)
		if err != nil {
			s.releaseTransfers(ss, resp.TransferIds)
			return nil, err
		}
		if inline != nil || id == 0 {
			idx := uint32(len(resp.InlineData))
			meta.InlineIndex = &idx
			resp.InlineData = append(resp.InlineData, inline)
		} else {
			resp.TransferIds = append(resp.TransferIds, id)
		}
		resp.Tensors = append(resp.Tensors, meta)
	}
	return resp, nil
}

func (s *Server) releaseTransfers(ss *serverSession, ids []uint64) {
	engine.FinishAll(ss.RemoveAll(ids))
}

// requestTensors takes a CallRequest's tensors into the pool: inline
// ones, and on a frame (l not nil) located ones, read all at once from
// the client's memory. It stops at the first tensor it cannot take; the
// tensors returned, taken or nil, are the caller's to release, on error
// too.
func (s *Server) requestTensors(ctx context.Context, ss *serverSession, l *engine.Link, req *pb.CallRequest) ([]*Tensor, error) {
	ts := make([]*Tensor, len(req.Tensors))
	// Every tensor is checked, and the inline ones taken, before anything
	// is read.
	located, last := 0, -1
	for i, m := range req.Tensors {
		var err error
		if !toRead(l, m) {
			ts[i], err = s.callTensor(ctx, ss, m, req.InlineData)
		} else if err = checkMeta(m, s.opts.maxTensorBytes); err == nil {
			located++
			last = i
		}
		if err != nil {
			return ts, err
		}
	}
	switch {
	case located == 1:
		// Read here: a Call of one tensor to read starts no goroutine
		// and allocates nothing for the reading.
		var err error
		ts[last], err = s.pullTensor(ctx, ss, l, req.Tensors[last])
		return ts, err
	case located > 1:
		return ts, s.pullTensors(ctx, ss, l, req.Tensors, ts)
	}
	return ts, nil
}

// toRead reports whether the request tensor m is read from the client's
// memory: located, on a frame's lane l.
func toRead(l *engine.Link, m *pb.TensorMeta) bool {
	return l != nil && m.GetLocation() != nil && m.TransferId == 0
}

// pullTensor reads the located request tensor m from the client's memory
// (or takes it, when callReadFirst read it already).
func (s *Server) pullTensor(ctx context.Context, ss *serverSession, l *engine.Link, m *pb.TensorMeta) (*Tensor, error) {
	if read, ok := ctx.Value(readFirstKey{}).(*readFirst); ok && read.m == m {
		return read.result()
	}
	buf, err := s.pull(ctx, ss, l, m, true)
	if err != nil {
		return nil, err
	}
	return tensorOf(m, buf)
}

// pullTensors reads the tensors of metas to read (toRead) at once, each in a goroutine but the last, which is read here; the
// first error, in the tensors' order, is returned once all reads ended.
func (s *Server) pullTensors(ctx context.Context, ss *serverSession, l *engine.Link, metas []*pb.TensorMeta, ts []*Tensor) error {
	errs := make([]error, len(metas))
	var wg sync.WaitGroup
	last := -1
	for i, m := range metas {
		if !toRead(l, m) {
			continue
		}
		if last >= 0 {
			j := last
			wg.Go(func() { ts[j], errs[j] = s.pullTensor(ctx, ss, l, metas[j]) })
		}
		last = i
	}
	ts[last], errs[last] = s.pullTensor(ctx, ss, l, metas[last])
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// callTensor takes in one inline request tensor of a Call.
func (s *Server) callTensor(ctx context.Context, ss *serverSession, m *pb.TensorMeta, inline [][]byte) (*Tensor, error) {
	if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
		return nil, err
	}
	if m.TransferId != 0 {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q names a transfer, which only an indirect answer does", m.Key)
	}
	if m.InlineIndex == nil {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q has no inline data", m.Key)
	}
	i := int(*m.InlineIndex)
	if i >= len(inline) || len(inline[i]) != int(m.ByteLength) {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: bad inline index %d", m.Key, i)
	}
	return s.inlineTensor(ctx, ss, m, inline[i])
}
