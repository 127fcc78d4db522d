package rpc

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// serveFrame handles a request frame that arrived on the session's link l.
// It runs where the link's completions are handled, usually the provider's
// receiver (see engine.Link.poll), so it never blocks, nor waits for the
// peer: calls run in their own goroutines, and what revokes grants
// (releases, a failed answer) is finished aside (FinishAside).
func (s *Server) serveFrame(ss *serverSession, l *engine.Link, h wire.FrameHeader, body []byte) {
	switch h.Type {
	case wire.FrameRelease:
		// Cancel at once, in order with the requests before it; freeing
		// (revoking grants may wait for the peer) happens aside.
		var done []*engine.Transfer
		for _, ref := range engine.ReadU64s(body) {
			ss.CancelCall(ref)
			done = append(done, ss.ReleaseRef(ref)...)
		}
		ss.FinishAside(done)
		return
	case wire.FrameFetchReq, wire.FrameSendReq, wire.FrameCallReq:
	default:
		return
	}
	// The caller's metadata and deadline, when it sent any.
	var hdr headers
	var bad error
	if h.Flags&wire.FlagHeaders != 0 {
		// Its metadata is decoded where a call looks at it (a Fetch
		// answered at once: when something asks for it).
		if hdr, body, bad = cutHeaders(body); bad != nil {
			bad = status.Error(codes.InvalidArgument, bad.Error())
		}
	}
	switch h.Type {
	case wire.FrameFetchReq:
		// fetchNow answers where completions are handled. With
		// interceptors, all of them inline ones (WithInlineInterceptors),
		// the call runs there too, wrapped by them (runFrameCall's
		// inline); with any other, where every other call's work runs.
		key, land, landOK := body, (*pb.FetchRequest)(nil), true
		if h.Flags&wire.FlagLanding != 0 {
			// The key and the landing, decoded here when the frame holds
			// them; else serveFetchFrame decodes or refuses it.
			key, land, landOK = nil, nil, false
			if req, err := landingRequest(h, body); bad == nil && err == nil {
				key, land, landOK = []byte(req.Key), req, true
			}
		}
		direct := bad == nil && landOK && h.Flags&(wire.FlagWait|wire.FlagIndirect|wire.FlagRows) == 0 && len(key) <= wire.MaxKeyLen
		if direct && len(s.opts.interceptors) == 0 && s.fetchNow(ss, l, h, string(key), land) {
			return
		}
		inline := direct && len(s.opts.interceptors) > 0 && s.opts.inlineOK() && !s.opts.checksums
		if inline && s.fetchNowIntercepted(ss, l, h, hdr, string(key), land) {
			return
		}
		hdr.decode()
		s.serveFetchFrame(ss, l, h, hdr, body, bad, inline)
	case wire.FrameSendReq:
		hdr.decode()
		req := &pb.SendRequest{}
		load := s.takeRequest(ss, l, h, body, bad, MaxRecvMsgBytes, func(b []byte) error { return unmarshalFrame(b, req) })
		if s.sendReadFirst(ss, l, h, hdr, bad, req, load) {
			return
		}
		mode, pace := s.sendMode(h, bad, req)
		s.runFrameCall(ss, l, h.Ref, wire.FrameSendResp, hdr, OpSend, mode, pace, load, func() (string, int64) { return req.GetMeta().GetKey(), int64(req.GetMeta().GetByteLength()) }, func(ctx context.Context, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
			resp, err := s.sendRequest(ctx, ss, l, h.Ref, req)
			recycleInline(req.InlineData) // copied into the pool, or refused
			req.InlineData = nil
			if resp == nil || err != nil {
				return 0, nil, err
			}
			return 0, resp, nil
		}, nil)
	case wire.FrameCallReq:
		hdr.decode()
		req := &pb.CallRequest{}
		load := s.takeRequest(ss, l, h, body, bad, MaxRecvMsgBytes, func(b []byte) error { return unmarshalFrame(b, req) })
		if s.callReadFirst(ss, l, h, hdr, bad, req, load) {
			return
		}
		mode, pace := s.callMode(h, bad, req)
		s.runFrameCall(ss, l, h.Ref, wire.FrameCallResp, hdr, OpCall, mode, pace, load, func() (string, int64) { return req.Method, metaBytes(req.Tensors) }, func(ctx context.Context, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
			return s.callForFrame(ctx, ss, l, h.Ref, req, held)
		}, nil)
	}
}

// sendReadFirst serves a SEND_REQ whose tensor the server reads from the
// client's memory by reading it first, without waiting (postReadFirst):
// the call is registered with the session (Session.Run, RunLater), the
// Read posted here, and the call runs as the Read's completion is
// handled (where it was delivered, as RunRescued), which saves the
// goroutine of its own a call that reads runs in (sendMode) and the
// wake-up of that goroutine when its Read completes: on 2 CPUs a 64 KiB
// Send's hand-offs 7.3 -> 5.0 on tcp, 1.1 -> 0.1 on shm, and under
// GOMAXPROCS=16 its idle-P starts 4.2-4.5 -> 0.1 on tcp. Only
// a plain Send (framePlain, readable) qualifies; one whose memory the
// pool has not at once, or for whose Read the send queue has no room at
// once, is read as usual by its call, in a goroutine of its own. It
// reports false, having done nothing, for a Send that is not plain.
func (s *Server) sendReadFirst(ss *serverSession, l *engine.Link, h wire.FrameHeader, hdr headers, bad error, req *pb.SendRequest, load func(context.Context) error) bool {
	if !s.framePlain(l, h, hdr, bad, load) || !s.sendPace.here() {
		return false
	}
	m := req.Meta
	if m == nil || m.Location == nil || req.Rows != nil || req.Reserve || req.Commit != 0 || len(req.InlineData) > 0 || !s.readable(ss, l, m) {
		return false
	}
	read := &readFirst{m: m}
	start := s.runFrameCall(ss, l, h.Ref, wire.FrameSendResp, hdr, OpSend, engine.RunLater, &s.sendPace, load, func() (string, int64) { return m.Key, int64(m.ByteLength) }, func(ctx context.Context, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
		if !read.posted {
			_, err := s.sendRequest(ctx, ss, l, h.Ref, req)
			return 0, nil, err
		}
		t, err := read.result()
		if err != nil {
			return 0, nil, err
		}
		return 0, nil, s.send(m.Key, t, read.seq)
	}, read.drop)
	if start != nil {
		// Its place among key's Sends, taken before the Read, as
		// sentTensor's (which takes its own when this one is not read).
		read.seq = s.rv.NextSeq()
		s.postReadFirst(ss, l, read, start)
	}
	return true
}

// callReadFirst is sendReadFirst for a CALL_REQ of one tensor to read (the
// others inline) whose handler may run where its frame was read
// (callMode's RunRescued): its handler's call waits for no Read.
func (s *Server) callReadFirst(ss *serverSession, l *engine.Link, h wire.FrameHeader, hdr headers, bad error, req *pb.CallRequest, load func(context.Context) error) bool {
	if !s.framePlain(l, h, hdr, bad, load) {
		return false
	}
	r := s.handlerOf(req.Method)
	if r.pace == nil || !r.pace.here() {
		return false // no such method, or its calls run in goroutines of their own
	}
	var m *pb.TensorMeta
	for _, t := range req.Tensors {
		if t.GetLocation() == nil {
			continue
		}
		if m != nil || t.TransferId != 0 {
			return false
		}
		m = t
	}
	if m == nil || !s.readable(ss, l, m) {
		return false
	}
	read := &readFirst{m: m}
	start := s.runFrameCall(ss, l, h.Ref, wire.FrameCallResp, hdr, OpCall, engine.RunLater, r.pace, load, func() (string, int64) { return req.Method, metaBytes(req.Tensors) }, func(ctx context.Context, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
		if read.posted {
			ctx = context.WithValue(ctx, readFirstKey{}, read) // pullTensor takes it
		}
		return s.callForFrame(ctx, ss, l, h.Ref, req, held)
	}, read.drop)
	if start != nil {
		s.postReadFirst(ss, l, read, start)
	}
	return true
}

// framePlain reports whether a request frame's call may be read first
// (sendReadFirst, callReadFirst) as far as the frame says: its body
// decoded, no deadline, nothing asked to compress, no interceptor (each
// must see a call before the server reads anything for it), the session
// open on the lane.
func (s *Server) framePlain(l *engine.Link, h wire.FrameHeader, hdr headers, bad error, load func(context.Context) error) bool {
	if bad != nil || h.Flags&wire.FlagIndirect != 0 || len(s.opts.interceptors) > 0 || s.opts.handlersInGoroutines ||
		hdr.timeout != 0 || len(hdr.md.Get(compressionKey)) > 0 || !l.Opened.Load() {
		return false
	}
	return load(context.Background()) == nil // a frame's body is decoded already: this is its error
}

// readable reports whether m, a tensor to read, may be read first: on one
// lane (not striped), well formed, and on shm (a verbs.Poller) at most
// shmReadFirstMax bytes. (On a link that compresses, postReadFirst's
// Read is planned as ReadLanes plans it, except that one that would
// probe first is not read first.)
func (s *Server) readable(ss *serverSession, l *engine.Link, m *pb.TensorMeta) bool {
	loc, n := m.Location, int(m.ByteLength)
	if _, polled := l.QP.(verbs.Poller); polled && n > shmReadFirstMax {
		return false
	}
	return n > 0 && checkMeta(m, s.opts.maxTensorBytes) == nil && loc.Length == m.ByteLength &&
		loc.Transport == transportOf(ss.transport) && len(loc.Lanes) == 0
}

// shmReadFirstMax bounds what shm reads first (readable): its Read is a
// copy by the poster, here the ring receiver, which meanwhile delivers
// nothing else of its lane (tcp's receiver reads a Read's bytes as they
// come either way). 256 KiB: a copy of 60 µs on the 2-core VM.
const shmReadFirstMax = 256 << 10

// postReadFirst reads read.m from the client's memory, charged to the
// session's quota meanwhile, and starts the registered call (start) as
// the Read completes; when the pool has no memory at once, the send
// queue no room, or the Read would probe the plane first
// (engine.ReadPlanned), it starts the call at once in a goroutine of its
// own, which reads as usual (read.posted false).
func (s *Server) postReadFirst(ss *serverSession, l *engine.Link, read *readFirst, start func(here bool)) {
	m := read.m
	n := int(m.ByteLength)
	if ss.charge(int64(n), s.opts.sessionQuota) != nil {
		start(false) // refused by the usual read
		return
	}
	buf, err := s.pool.TryAlloc(n)
	if err != nil {
		ss.refund(int64(n))
		start(false) // the usual read waits for memory
		return
	}
	local, err := l.Domain.Reg.Local(buf)
	if err != nil {
		buf.Release()
		ss.refund(int64(n))
		start(false)
		return
	}
	pulled := ss.Pulling()
	read.posted = true
	s.readsFirst.Add(1)
	if !engine.ReadPlanned(context.Background(), l, local, verbs.Remote{Addr: m.Location.Address, Key: m.Location.RemoteKey}, func(err error) {
		pulled()
		ss.refund(int64(n))
		if err == nil {
			err = verifySum(m, buf.Bytes())
		}
		if err != nil {
			ss.stats.errors.Add(1)
			buf.Release()
		} else {
			ss.stats.transfers.Add(1)
			ss.stats.dataPlaneBytes.Add(int64(n))
			var t *Tensor
			if t, err = tensorOf(m, buf); err == nil && !read.put(t) {
				t.Release() // the call ended meanwhile (cancelled)
			}
		}
		read.err = err
		start(true)
	}) {
		read.posted = false
		s.readsFirst.Add(-1)
		pulled()
		buf.Release()
		ss.refund(int64(n))
		start(false)
	}
}

// readFirst is what postReadFirst read for its call: the tensor's meta,
// whether the Read was posted (else the call reads as usual), its error,
// and the tensor, held until the call takes it (result) or ends without
// (drop).
type readFirst struct {
	m       *pb.TensorMeta
	posted  bool
	seq     uint64
	err     error
	mu      sync.Mutex
	t       *Tensor
	dropped bool
}

// put holds t for the call, unless the call has ended: then it reports
// false, and t is the caller's.
func (r *readFirst) put(t *Tensor) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dropped {
		return false
	}
	r.t = t
	return true
}

// readFirstKey is the context key of a Call's readFirst: pullTensor
// takes the tensor it read.
type readFirstKey struct{}

// result is the tensor read, or the Read's error, or Canceled when the
// call ended before it came.
func (r *readFirst) result() (*Tensor, error) {
	if r.err != nil {
		return nil, r.err
	}
	if t := r.take(); t != nil {
		return t, nil
	}
	return nil, status.Error(codes.Canceled, "tensorrpc: the call was cancelled")
}

func (r *readFirst) take() *Tensor {
	r.mu.Lock()
	defer r.mu.Unlock()
	t := r.t
	r.t = nil
	return t
}

func (r *readFirst) drop() {
	r.mu.Lock()
	t := r.t
	r.t, r.dropped = nil, true
	r.mu.Unlock()
	if t != nil {
		t.Release()
	}
}

// callMode is where a CALL_REQ runs (runFrameCall's mode), and the pace
// of its handler when that is where its frame was read, rescued
// (engine.RunRescued). It runs where its frame was read when its
// request and its tensors came in the frame (nothing to pull, which waits
// for completions) and no interceptor that may wait wraps it (only
// WithInlineInterceptors' ones): as it is (RunInline) when its method's
// handler was registered Inline, rescued when not, unless the handler's
// recent calls took long (handlerPace): those run in goroutines of their
// own. req was decoded already: takeRequest decodes a frame that is not
// indirect at once.
func (s *Server) callMode(h wire.FrameHeader, bad error, req *pb.CallRequest) (engine.RunMode, engine.Pacer) {
	if bad != nil || h.Flags&wire.FlagIndirect != 0 || !s.opts.inlineOK() {
		return engine.RunGoroutine, nil
	}
	for _, m := range req.Tensors {
		if m.GetLocation() != nil {
			return engine.RunGoroutine, nil
		}
	}
	r := s.handlerOf(req.Method)
	switch {
	case r.inline:
		return engine.RunInline, nil
	case r.pace == nil:
		// No such method: its Unimplemented answer goes at once.
		return engine.RunInline, nil
	case s.opts.handlersInGoroutines || !r.pace.here():
		return engine.RunGoroutine, nil
	}
	return engine.RunRescued, r.pace
}

// sendMode is where a SEND_REQ runs (runFrameCall's mode), and its pace:
// where its frame was read, rescued (engine.RunRescued), when its tensor
// came in the frame (nothing to pull: no location, no rows to read, no
// reservation to grant) and no interceptor that may wait wraps it, as a
// small Call's handler does; in a goroutine of its own otherwise, with
// WithHandlerGoroutines, and while recent Sends were left behind (a full
// pool they waited on). req was decoded already (not indirect).
func (s *Server) sendMode(h wire.FrameHeader, bad error, req *pb.SendRequest) (engine.RunMode, engine.Pacer) {
	if bad != nil || h.Flags&wire.FlagIndirect != 0 || !s.opts.inlineOK() || s.opts.handlersInGoroutines {
		return engine.RunGoroutine, nil
	}
	if req.Meta == nil || req.Meta.Location != nil || req.Rows != nil || req.Reserve || req.Commit != 0 {
		return engine.RunGoroutine, nil
	}
	if !s.sendPace.here() {
		return engine.RunGoroutine, nil
	}
	return engine.RunRescued, &s.sendPace
}

// handlerPace keeps a handler's calls off the frame path while they are
// long there (engine.Pacer): left behind (such a call held its lane 1-2
// ms, engine.RescueAfter, until the lane's receiving moved on without
// it), or longer than engine.LongCall (the calls behind it on its lane
// waited, where goroutines would have run them side by side). After one,
// the method's next calls run on goroutines of their own: 1, 2, 4 ... up
// to 1,024 of them after consecutive long ones; a short call on the frame
// path ends the penalty.
type handlerPace struct {
	skip, penalty atomic.Int32
	leftBehind    *atomic.Int64 // the Server's count (Stats.LeftBehind)
}

// here reports whether a call may run where its frame was read.
func (p *handlerPace) here() bool {
	if p.skip.Load() <= 0 {
		return true
	}
	p.skip.Add(-1)
	return false
}

// Ran implements engine.Pacer.
func (p *handlerPace) Ran(took time.Duration, leftBehind bool) {
	if leftBehind {
		p.leftBehind.Add(1)
	} else if took <= engine.LongCall {
		p.penalty.Store(0)
		return
	}
	n := min(max(2*p.penalty.Load(), 1), 1024)
	p.penalty.Store(n)
	p.skip.Store(n)
}

// takeRequest decodes a request frame's body with decode: at once, in the
// goroutine that handles completions (decode copies what it keeps: the slot is reposted
// when serveFrame returns), or for an INDIRECT frame, whose body is a
// TensorMeta naming where the client holds the body (at most limit
// bytes), once the call's goroutine has pulled it. The call runs the
// returned func first; its error is the call's. bad, when not nil, is the
// error of the frame's headers: the call fails with it.
func (s *Server) takeRequest(ss *serverSession, l *engine.Link, h wire.FrameHeader, body []byte, bad error, limit int, decode func([]byte) error) func(context.Context) error {
	if bad != nil {
		return func(context.Context) error { return bad }
	}
	if h.Flags&wire.FlagIndirect == 0 {
		err := decode(body)
		return func(context.Context) error { return err }
	}
	m := &pb.TensorMeta{}
	err := unmarshalFrame(body, m)
	return func(ctx context.Context) error {
		switch {
		case err != nil:
			return err
		case m.Dtype != pb.DType(zerocopy.Uint8) || m.Location == nil || len(m.Shape) != 1:
			return status.Error(codes.InvalidArgument, "tensorrpc: an indirect request names no byte tensor in the client's memory")
		}
		if err := checkMeta(m, int64(limit)); err != nil {
			return err
		}
		buf, err := s.pull(ctx, ss, l, m, false)
		if err != nil {
			return err
		}
		defer buf.Release()
		return decode(buf.Bytes())
	}
}

// serveFetchFrame runs a FETCH_REQ that fetchNow did not answer at once
// (runFrameCall: where it was read when inline, else in a goroutine of
// its own). Apart from serveFrame, so that the frames fetchNow answers do
// not allocate what these calls' closures share.
func (s *Server) serveFetchFrame(ss *serverSession, l *engine.Link, h wire.FrameHeader, hdr headers, body []byte, bad error, inline bool) {
	var key string
	var rows []int64
	var land *pb.FetchRequest
	// An indirect key is pulled up to one byte past the longest, so
	// that one too long fails as one inline does.
	limit := wire.MaxKeyLen + 1
	if h.Flags&(wire.FlagRows|wire.FlagLanding) != 0 {
		limit = MaxRecvMsgBytes
	}
	load := s.takeRequest(ss, l, h, body, bad, limit, func(b []byte) error {
		switch {
		case h.Flags&wire.FlagLanding != 0:
			req, err := landingRequest(h, b)
			if err != nil {
				return err
			}
			b, land = []byte(req.Key), req
		case h.Flags&wire.FlagRows != 0:
			req := &pb.FetchRequest{}
			if err := unmarshalFrame(b, req); err != nil {
				return err
			}
			if req.Rows == nil {
				return status.Error(codes.InvalidArgument, "tensorrpc: a FETCH_REQ with the ROWS flag names no row")
			}
			b, rows = []byte(req.Key), req.Rows
		}
		if len(b) > wire.MaxKeyLen {
			return status.Errorf(codes.InvalidArgument, "tensorrpc: a key of %d bytes, longer than %d", len(b), wire.MaxKeyLen)
		}
		key = string(b)
		return nil
	})
	mode := engine.RunGoroutine
	if inline {
		mode = engine.RunInline
	}
	s.runFrameCall(ss, l, h.Ref, wire.FrameFetchResp, hdr, OpFetch, mode, nil, load, func() (string, int64) { return key, 0 }, func(ctx context.Context, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
		return s.fetchForFrame(ctx, ss, l, h, key, rows, land, held)
	}, nil)
}

// fetchNow answers a FETCH_REQ at once, where the link's completions are
// handled (usually the provider's receiver, see serveFrame), when
// that needs no waiting: the session is open and not draining, the key is
// published (or is not published at all, without WaitForKey), the answer
// fits a slot, and a credit and a buffer are at hand. It reports whether it answered; if
// not, the call runs as any other. It saves a Fetch the hop to a goroutine
// of its own.
func (s *Server) fetchNow(ss *serverSession, l *engine.Link, h wire.FrameHeader, key string, land *pb.FetchRequest) bool {
	if !l.Opened.Load() || !ss.Accepts(h.Ref) {
		return false
	}
	var st [4]byte
	e, err := s.fetch(ss.Context(), key, false)
	switch {
	case status.Code(err) == codes.NotFound:
		raw := engine.AppendStatus(st[:0], err, l.Frames.SlotSize-wire.FrameHeaderLen)
		// Counted before the answer goes, so that a client holding its
		// answer sees it counted; taken back if the answer cannot go.
		ss.answeredNow.Add(1)
		if !l.TrySendFrame(wire.FrameFetchResp, 0, h.Ref, raw, nil, nil) {
			ss.answeredNow.Add(-1)
			return false
		}
		return true
	case err != nil:
		return false
	}
	n := len(e.Tensor.Bytes())
	if n > engine.FrameInline(s.opts.eagerThreshold) {
		if s.opts.checksums {
			e.Buf.Release()
			return false // its CRC takes the call path, off the completion path
		}
		// A transfer: granted here (on tcp a local table entry, on shm a
		// message the peer's receiver takes), offered as the call path
		// does; withdrawn if the answer cannot go at once.
		resp, err := s.fetchAnswer(ss.Context(), ss, l, h.Ref, key, e, -1, nil, land)
		if err != nil {
			return false
		}
		ss.answeredNow.Add(1)
		if !l.TrySendFrame(wire.FrameFetchResp, 0, h.Ref, engine.AppendStatus(st[:0], nil, 0), resp, nil) {
			ss.answeredNow.Add(-1)
			if t := ss.Remove(resp.TransferId); t != nil {
				ss.FinishAside([]*engine.Transfer{t})
			}
			return false
		}
		return true
	}
	// Inline: the answer views the published buffer, counted only once
	// it has gone (if it cannot, the call path answers and counts it).
	defer e.Buf.Release()
	resp := &inlineReply{pb.FetchResponse{Meta: metaOf(key, e.Tensor, s.opts.checksums), InlineData: e.Tensor.Bytes()[:n:n]}}
	ss.answeredNow.Add(1)
	if !l.TrySendFrame(wire.FrameFetchResp, 0, h.Ref, engine.AppendStatus(st[:0], nil, 0), resp, nil) {
		ss.answeredNow.Add(-1)
		return false
	}
	s.countInline(ss, n)
	return true
}

// fetchNowIntercepted is fetchNow for a Server whose interceptors are all
// inline ones (WithInlineInterceptors): the Fetch is looked up and
// answered where its frame was read, wrapped by the interceptors, when
// the call has no deadline of its own and the session takes it. It
// reports whether it took the call (it then answers it exactly once);
// if not, the call runs as any other. Unlike fetchNow it cannot hand a
// call it could not answer at once back to the call path (the
// interceptors have seen it): an answer that finds no credit or buffer
// goes from a goroutine of its own, the call counted as under way until
// it has gone.
func (s *Server) fetchNowIntercepted(ss *serverSession, l *engine.Link, h wire.FrameHeader, hdr headers, key string, land *pb.FetchRequest) bool {
	if hdr.timeout != 0 || !l.Opened.Load() || !ss.Accepts(h.Ref) {
		return false
	}
	f := &fetchNowCall{s: s, ss: ss, l: l, ref: h.Ref, key: key, land: land, hdr: hdr}
	ctx := ss.Context()
	var src lazyMetadata
	if incomingMDKey == nil {
		// The metadata goes in the context as gRPC puts it there.
		if md := f.hdr.decode(); md != nil {
			ctx = metadata.NewIncomingContext(ctx, md)
		}
	} else {
		src = f // decoded when asked for, by IncomingMetadata or through ctx
	}
	err := s.interceptCall(ctx, ss, &f.icall, OpFetch, key, PathFrame, 0, f.hdr.md, true, src, f)
	if err == nil && f.resp == nil {
		err = errSkipped(OpFetch)
	}
	var inline int
	if err != nil {
		// An interceptor failed a call whose work was done: what it made
		// for the client goes now.
		s.withdraw(ss, f.resp, f.view)
		f.resp, f.view = nil, nil
	} else if f.view != nil {
		inline = len(f.resp.InlineData)
	}
	var st [4]byte
	raw := engine.AppendStatus(st[:0], err, l.Frames.SlotSize-wire.FrameHeaderLen)
	var body proto.Message
	switch {
	case f.resp == &f.reply.FetchResponse:
		body = &f.reply
	case f.resp != nil:
		body = f.resp
	}
	ss.answeredNow.Add(1)
	// What the interceptors deferred runs once the answer has gone: as
	// its Send completes (on tcp as it is written, which, answering a
	// burst of requests, is after the burst was delivered).
	var sent func()
	if len(f.info.after) > 0 {
		sent = f.info.answered
	}
	if !answerAsideForTest.Load() && l.TrySendFrame(wire.FrameFetchResp, 0, h.Ref, raw, body, sent) {
		if f.view != nil {
			s.countInline(ss, inline)
			f.view.Release()
		}
		return true
	}
	ss.answeredNow.Add(-1)
	s.answerAside(ss, l, h.Ref, append([]byte(nil), raw...), body, f.resp, f.view, inline)
	f.info.answered() // once the answer is on its way aside
	return true
}

// fetchNowCall is a Fetch that fetchNowIntercepted answers, in one
// allocation: what its interceptors wrap, and its answer.
type fetchNowCall struct {
	icall
	s    *Server
	ss   *serverSession
	l    *engine.Link
	ref  uint64
	key  string
	land *pb.FetchRequest  // the request, when it grants a landing
	resp *pb.FetchResponse // the answer: &reply.FetchResponse when inline
	view *mempool.Buffer   // what an inline resp views
	// reply is an inline answer, which encodes itself.
	reply inlineReply
	// hdr is the call's headers, its metadata decoded once (mdOnce) when
	// asked for (metadata).
	hdr    headers
	mdOnce sync.Once
}

func (f *fetchNowCall) metadata() metadata.MD {
	f.mdOnce.Do(func() { f.hdr.decode() })
	return f.hdr.md
}

func (f *fetchNowCall) work(ctx context.Context, info *CallInfo) error {
	// An interceptor that runs the work again (a retry) gets a new
	// answer; the first one's goes.
	f.s.withdraw(f.ss, f.resp, f.view)
	f.resp, f.view = nil, nil
	e, err := f.s.fetch(ctx, f.key, false)
	if err != nil {
		return err
	}
	n := len(e.Tensor.Bytes())
	if n > engine.FrameInline(f.s.opts.eagerThreshold) {
		// A transfer, granted and offered as fetchNow does.
		if f.resp, err = f.s.fetchAnswer(ctx, f.ss, f.l, f.ref, f.key, e, -1, nil, f.land); err != nil {
			return err
		}
	} else {
		f.view = e.Buf
		f.reply.Meta, f.reply.InlineData = metaOf(f.key, e.Tensor, false), e.Tensor.Bytes()[:n:n]
		f.resp = &f.reply.FetchResponse
	}
	info.setResponse(int64(n))
	return nil
}

// answerAside sends a Fetch's answer (raw, then body; resp, the answer
// body is or holds, view what an inline one views, inline its bytes)
// that found no credit or buffer at hand: it waits for them aside, as a
// call under way (Session.Run), so that a graceful stop lets it go.
func (s *Server) answerAside(ss *serverSession, l *engine.Link, ref uint64, raw []byte, body proto.Message, resp *pb.FetchResponse, view *mempool.Buffer, inline int) {
	ran := false
	ss.Run(l, ref, func() {}, engine.RunInline, nil, func(_ error, over func()) bool {
		// A goroutine of the session, which the session's Close waits
		// for: the Send can complete (and the call end) before this
		// goroutine has freed what the answer held.
		ran = ss.Go(func() {
			posted, err := l.PostFrame(ss.Context(), wire.FrameFetchResp, 0, ref, raw, body, over)
			if err != nil {
				s.withdraw(ss, resp, nil)
			} else if view != nil {
				s.countInline(ss, inline)
			}
			if view != nil {
				view.Release()
			}
			if !posted {
				over()
			}
		})
		return ran
	})
	if !ran { // the session closed
		s.withdraw(ss, resp, view)
	}
}

// errSkipped is the error of a call whose interceptors returned neither
// an error nor ran it: there is no answer to give.
func errSkipped(op Operation) error {
	return status.Errorf(codes.Internal, "tensorrpc: an interceptor ended a %s without an error and without running it", op)
}

// answerAsideForTest makes fetchNowIntercepted, and calls answered where
// their frames were read (runFrameCall), answer as when no credit or
// buffer is at hand (tests).
var answerAsideForTest atomic.Bool

// withdraw frees what a Fetch's answer that will not go made for the
// client: the transfer it offers, or the buffer its inline bytes view.
func (s *Server) withdraw(ss *serverSession, resp *pb.FetchResponse, view *mempool.Buffer) {
	if view != nil {
		view.Release()
	}
	if resp != nil && resp.TransferId != 0 {
		if t := ss.Remove(resp.TransferId); t != nil {
			ss.FinishAside([]*engine.Transfer{t})
		}
	}
}

// responseBytes is the tensor bytes a frame call's answer offers.
func responseBytes(body proto.Message) int64 {
	switch m := body.(type) {
	case *pb.FetchResponse:
		return int64(m.GetMeta().GetByteLength())
	case *inlineReply:
		return int64(m.GetMeta().GetByteLength())
	case *pb.CallResponse:
		return metaBytes(m.Tensors)
	case callReplyBody:
		return metaBytes(m.Tensors)
	}
	return 0
}

// unmarshalFrame decodes a request frame's body.
func unmarshalFrame(body []byte, m proto.Message) error {
	switch r := m.(type) {
	case *pb.CallRequest:
		if fastCallRequest(body, r) {
			return nil
		}
	case *pb.SendRequest:
		if fastSendRequest(body, r) {
			return nil
		}
	}
	if err := proto.Unmarshal(body, m); err != nil {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: a request frame's body: %v", err)
	}
	return nil
}

// runFrameCall runs one request frame's work in its own goroutine (the
// engine's Session.Run, which counts, bounds or refuses it), under a
// context with the caller's metadata and deadline (hdr) that a RELEASE of
// ref or the session's end also cancels: load reads the request, desc
// names it for the interceptors, which then wrap work. It answers
// it with exactly one response frame of type resp: the work's status (a
// refusal's, if refused) and, on success, its flags and body (which may
// view the pool buffers the work adds to held until it is sent). A
// response that cannot be sent frees what the call made for the client.
//
// mode is where it runs (engine.Session.Run). With RunInline (an Inline
// handler's call, a Fetch, see callMode) it runs in the calling
// goroutine, where the link's frames are read, and never waits for pool
// memory or for a credit; with RunInline or RunRescued an answer that
// cannot go at once goes from a goroutine of its own.
func (s *Server) runFrameCall(ss *serverSession, l *engine.Link, ref uint64, resp uint8, hdr headers, op Operation, mode engine.RunMode, pace engine.Pacer, load func(context.Context) error, desc func() (name string, reqBytes int64), work func(ctx context.Context, held *[]*mempool.Buffer) (uint16, proto.Message, error), ended func()) (start func(here bool)) {
	var ctx context.Context
	var cancel context.CancelFunc
	inline := mode == engine.RunInline
	if inline && op == OpFetch && hdr.timeout == 0 {
		// A Fetch served inline runs no handler, only interceptors, and
		// ends before anything else of its lane is read: the session's
		// context is its own (its end ends the call), with the caller's
		// metadata; a cancel of its own would cost a registration with
		// the session's context and nothing else.
		ctx, cancel = ss.Context(), func() {}
		if hdr.md != nil {
			ctx = metadata.NewIncomingContext(ctx, hdr.md)
		}
	} else {
		ctx, cancel = withHeaders(ss.Context(), hdr)
	}
	if inline {
		ctx = context.WithValue(ctx, noPoolWait{}, true)
	}
	if ended != nil {
		// The call's context is cancelled once it ends, or was never
		// run (refused, the session closed), and earlier when the client
		// cancels it: ended runs at the first of these.
		cancelCtx, once := cancel, new(sync.Once)
		cancel = func() {
			cancelCtx()
			once.Do(ended)
		}
	}
	return ss.Run(l, ref, cancel, mode, pace, func(refusal error, over func()) (handedOver bool) {
		// The session is open on l once open (Session) has set its lanes;
		// a client that sends before it heard so is refused.
		opened := l.Opened.Load()
		var flags uint16
		var body proto.Message
		var held []*mempool.Buffer // what body views, until it is sent
		defer func() {
			for _, b := range held {
				b.Release()
			}
		}()
		var info *CallInfo
		defer func() { info.answered() }() // once the answer went (or could not)
		var err error
		switch {
		case !opened:
			err = status.Error(codes.FailedPrecondition, "tensorrpc: a call before the session opened")
		case refusal != nil:
			err = refusal
		default:
			// The request is read first (an indirect one is pulled): a
			// request that cannot be read fails before interceptors see it.
			if err = load(ctx); err != nil {
				break
			}
			name, reqBytes := desc()
			worked, ran := false, false
			info, err = s.interceptAnswer(ctx, ss, op, name, PathFrame, reqBytes, hdr.md, true, func(ctx context.Context, info *CallInfo) error {
				var err error
				ran = true
				flags, body, err = work(ctx, &held)
				worked = err == nil
				info.setResponse(responseBytes(body))
				return err
			})
			if err == nil && !ran {
				err = errSkipped(op)
			}
			if err != nil && worked {
				// An interceptor failed a call whose work was done: what
				// it made for the client goes now, aside (revoking a
				// grant may wait for the peer, whose answer an inline
				// call's goroutine is the one to read).
				ss.FinishAside(ss.ReleaseRef(ref))
			}
			if err != nil && ctx.Err() == context.DeadlineExceeded {
				err = status.Error(codes.DeadlineExceeded, "tensorrpc: the call's deadline passed")
			}
		}
		if ss.Context().Err() != nil {
			// The session is ending (the server stops, the client left):
			// the link closes next, and the caller hears Unavailable from
			// that rather than the handler's cancellation.
			engine.FinishAll(ss.ReleaseRef(ref))
			return false
		}
		var st [4]byte
		raw := engine.AppendStatus(st[:0], err, l.Frames.SlotSize-wire.FrameHeaderLen)
		if err != nil {
			body = nil
		}
		// The answer is copied into its frame as it is posted, and a Send
		// that fails ends the session, which frees what the call made:
		// the call need not wait for the answer's acknowledgement. It
		// stays under way (over) until that Send completes, so that a
		// graceful stop closes the session only after the answers left.
		if mode != engine.RunGoroutine {
			// What the interceptors deferred runs once the answer has
			// gone, as its Send completes (see fetchNowIntercepted).
			sent, after := over, info
			if after != nil && len(after.after) > 0 {
				sent = func() {
					after.answered()
					over()
				}
				info = nil // (the deferred answered: nothing to run)
			}
			if !answerAsideForTest.Load() && l.TrySendFrame(resp, flags, ref, raw, body, sent) {
				return true
			}
			info = after // the answer goes aside: they run as it does
			// No credit or buffer at hand: the answer waits for them
			// aside, with what it views.
			// A goroutine of the session, which the session's Close
			// waits for, so that what it holds is back in the pool
			// when Close returns (the Send can complete first).
			own := held
			held = nil
			aside := ss.Go(func() {
				defer func() {
					for _, b := range own {
						b.Release()
					}
				}()
				posted, err := l.PostFrame(ss.Context(), resp, flags, ref, raw, body, over)
				if err != nil {
					engine.FinishAll(ss.ReleaseRef(ref))
				}
				if !posted {
					over()
				}
			})
			if !aside { // the session closed
				for _, b := range own {
					b.Release()
				}
				engine.FinishAll(ss.ReleaseRef(ref))
			}
			return aside
		}
		posted, err := l.PostFrame(ss.Context(), resp, flags, ref, raw, body, over)
		if err != nil {
			engine.FinishAll(ss.ReleaseRef(ref))
		}
		return posted
	})
}

// fetchForFrame is a FETCH_REQ: a FetchResponse, indirect when it does not
// fit a slot (a long key, a large shape).
func (s *Server) fetchForFrame(ctx context.Context, ss *serverSession, l *engine.Link, h wire.FrameHeader, key string, rows []int64, land *pb.FetchRequest, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
	e, err := s.fetch(ctx, key, h.Flags&wire.FlagWait != 0)
	if err != nil {
		return 0, nil, err
	}
	var resp *pb.FetchResponse
	if rows != nil {
		resp, err = s.offerRows(ctx, ss, l, h.Ref, key, e, rows, engine.FrameInline(s.opts.eagerThreshold), held)
	} else {
		resp, err = s.fetchAnswer(ctx, ss, l, h.Ref, key, e, engine.FrameInline(s.opts.eagerThreshold), held, land)
	}
	if err != nil {
		return 0, nil, err
	}
	var ids []uint64
	if resp.TransferId != 0 {
		ids = append(ids, resp.TransferId)
	}
	return s.answer(ctx, ss, l, h.Ref, resp, ids)
}

// answer is a response frame's flags and body for resp: resp itself when
// it fits a slot, else with frameIndirect a TensorMeta naming a transfer
// that holds it, which the client reads like a tensor. ids are the
// transfers resp names, released if the answer cannot be made.
func (s *Server) answer(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, resp proto.Message, ids []uint64) (uint16, proto.Message, error) {
	if wire.FrameHeaderLen+4+engine.MessageSize(resp) <= l.Frames.SlotSize {
		return 0, resp, nil
	}
	body, err := engine.AppendMessage(nil, resp)
	if err != nil {
		s.releaseTransfers(ss, ids)
		return 0, nil, status.Errorf(codes.Internal, "tensorrpc: answer: %v", err)
	}
	buf, err := allocBuffer(ctx, s.pool, len(body))
	if err != nil {
		s.releaseTransfers(ss, ids)
		return 0, nil, err
	}
	copy(buf.Bytes(), body)
	zt, _ := zerocopy.New(zerocopy.Uint8, []int64{int64(len(body))}, buf.Bytes())
	meta, _, id, err := s.offer(ctx, ss, l, ref, "", zt, buf, -1, nil)
	if err != nil {
		s.releaseTransfers(ss, ids)
		return 0, nil, err
	}
	meta.TransferId = id
	return wire.FlagIndirect, meta, nil
}

// pull reads a tensor the client granted the server (m.Location) into a
// new pool buffer, counted against the session's quota while it is read
// (unless charged: a call's tensors are counted for the whole call).
// The Reads (striped over the lanes when the location names a grant on
// each) are not abandoned when ctx ends (the client keeps its grants until
// the answer), only when a lane dies; a client that never answers them
// has its session ended after WithReservationTimeout.
func (s *Server) pull(ctx context.Context, ss *serverSession, l *engine.Link, m *pb.TensorMeta, charged bool) (*mempool.Buffer, error) {
	loc, n := m.Location, int(m.ByteLength)
	if loc.Length != m.ByteLength || loc.Transport != transportOf(ss.transport) {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: a location of %d bytes on %s for a %d-byte tensor on %s",
			m.Key, loc.Length, transportName(loc.Transport), n, ss.transport)
	}
	if !charged {
		if err := ss.charge(int64(n), s.opts.sessionQuota); err != nil {
			return nil, err
		}
		defer ss.refund(int64(n))
	}
	buf, err := allocBuffer(ctx, s.pool, n)
	if err != nil {
		return nil, err
	}
	if n > 0 {
		local, err := l.Domain.Reg.Local(buf)
		if err != nil {
			buf.Release()
			return nil, status.Error(codes.Internal, err.Error())
		}
		remote := verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}
		done := ss.Pulling() // WithReservationTimeout bounds it
		var rctx context.Context
		if rctx, err = serverCodec(context.WithoutCancel(ctx)); err == nil {
			err = engine.ReadLanes(rctx, l, ss.lanes, local, remote, loc.Lanes, func() { buf.Release() })
		} else {
			buf.Release()
		}
		done()
		if err != nil {
			ss.stats.errors.Add(1)
			return nil, err
		}
	}
	if err := verifySum(m, buf.Bytes()); err != nil {
		buf.Release()
		return nil, err
	}
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(int64(n))
	return buf, nil
}

// callForFrame is a CALL_REQ: a CallResponse (see callRequest), indirect
// when it does not fit a slot.
func (s *Server) callForFrame(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, req *pb.CallRequest, held *[]*mempool.Buffer) (uint16, proto.Message, error) {
	resp, err := s.callRequest(ctx, ss, l, ref, req, engine.FrameInline(s.opts.eagerThreshold), held)
	if err != nil {
		return 0, nil, err
	}
	return s.answer(ctx, ss, l, ref, callReplyBody{resp}, resp.TransferIds)
}
