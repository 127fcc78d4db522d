package rpc

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rendezvous"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// A Fetch's landing (FetchRequest.landing in tensorrpc.proto): a client
// that fetched a key before, at a size the server may land, grants a
// pool buffer of that size writable with its next request for it; the
// server Writes the tensor's bytes there, then answers on the same lane,
// whose queue pair delivers in order. The client's Read of the bytes, a
// round trip, and the transfer's grant and release on the server are
// saved: a tcp Fetch of 64 KiB takes one round trip instead of two.

// maxLandingHints bounds the keys whose sizes a session remembers
// (landingHints); past it the memory starts over.
const maxLandingHints = 4096

// landingHints is a session's size of the tensor each key had when last
// fetched, for the landing of its next Fetch.
type landingHints struct {
	sizes sync.Map // string -> int
	n     atomic.Int32
}

// get is the size key had when last fetched (0: unknown).
func (h *landingHints) get(key string) int {
	if v, ok := h.sizes.Load(key); ok {
		return v.(int)
	}
	return 0
}

// put remembers that key's tensor had n bytes.
func (h *landingHints) put(key string, n int) {
	if v, ok := h.sizes.Load(key); ok {
		if v.(int) != n {
			h.sizes.Store(key, n)
		}
		return
	}
	if h.n.Add(1) > maxLandingHints {
		h.sizes.Clear()
		h.n.Store(1)
	}
	h.sizes.Store(key, n)
}

// landing is a Fetch's landing on the client: its memory (a pool buffer
// of the Fetch's own, or the tensor of an Into) and the grant that opens
// it to the server. Of the call's two ends, the revoke (the call's hold:
// its answer came, or the link ended) and the caller's (done, or keep),
// the second frees what the landing holds: its buffer, unless keep took
// it, and an Into's registration of caller memory.
type landing struct {
	buf     *mempool.Buffer // nil for an Into's
	into    *Tensor         // an Into's tensor, nil otherwise
	release func()          // drops an Into's registration, or nil
	g       verbs.Grant
	loc     *pb.Location
	ends    atomic.Int32
	revoked chan struct{} // closed once the grant is revoked
	kept    bool          // a Call's reply tensor took it (landedReply)
}

// revoke ends the grant: no Write of the server lands after it.
func (d *landing) revoke() {
	d.g.Revoke()
	close(d.revoked)
	d.end()
}

// done is the caller's end when nothing landed: the buffer goes once
// the grant is revoked.
func (d *landing) done() { d.end() }

func (d *landing) end() {
	if d.ends.Add(1) == 2 {
		d.free()
	}
}

func (d *landing) free() {
	if d.buf != nil {
		d.buf.Release()
	}
	if d.release != nil {
		d.release()
	}
}

// keep is the caller's end when the bytes landed: the buffer (or the
// Into's tensor) is the caller's; an Into's registration goes. It
// reports false (and the buffer goes with the revoke) when the grant was
// not revoked yet, which an answer that came never leaves.
func (d *landing) keep() bool {
	if d.ends.Add(1) != 2 {
		return false
	}
	if d.release != nil {
		d.release()
	}
	return true
}

// landingFor is a landing for a Fetch of key on lane l, or nil when the
// Fetch does not land: the session's plane takes none, the Fetch is of
// rows or a lease, its size (Into's tensor's, or the size the key had
// when last fetched) is unknown or not one that lands, or the session
// would compress the bytes. An Into lands in the caller's tensor where
// the provider can register it. Failing to grant one is not an error:
// the Fetch goes as any other.
func (c *Client) landingFor(ctx context.Context, s *clientSession, l *engine.Link, key string, fo fetchOptions) *landing {
	if s.landing == 0 || fo.rows != nil || fo.lease || s.transport != TransportTCP {
		return nil
	}
	if fo.into != nil {
		return c.landingInto(ctx, s, l, fo.into)
	}
	n := s.hints.get(key)
	if n <= engine.FrameInline(s.eager) || n > s.landing || !l.Squeeze.Plain(ctx, n) {
		return nil
	}
	// Only memory at hand: a Fetch that lands no more than the size it
	// had waits for pool memory after the answer, as any other.
	buf, err := c.pool.TryAlloc(n)
	if err != nil {
		return nil
	}
	g, err := l.Grant(buf, n, verbs.AccessRemoteWrite)
	if err != nil {
		buf.Release()
		return nil
	}
	return newLanding(s, g, buf.Arena().ID(), n, &landing{buf: buf})
}

// landingInto is the landing of a Fetch into dst: dst's own memory,
// granted writable (a pool buffer of this client's, or caller memory the
// provider registers), with the dtype and shape the tensor must have.
func (c *Client) landingInto(ctx context.Context, s *clientSession, l *engine.Link, dst *Tensor) *landing {
	n := len(dst.Bytes())
	if n <= engine.FrameInline(s.eager) || n > s.landing || !l.Squeeze.Plain(ctx, n) {
		return nil
	}
	var g verbs.Grant
	var err error
	var release func()
	region := uint32(0)
	if dst.buf != nil && c.ownPoolMemory(dst) {
		g, err = l.Grant(dst.buf, n, verbs.AccessRemoteWrite)
		region = dst.buf.Arena().ID()
	} else {
		var local verbs.Local
		if local, release, err = l.Domain.CallerLocal(dst.Bytes(), verbs.AccessLocalWrite|verbs.AccessRemoteWrite); err == nil {
			if g, err = l.QP.Grant(local.Region, local.Offset, n, verbs.AccessRemoteWrite); err != nil {
				release()
			}
		}
	}
	if err != nil {
		return nil
	}
	d := newLanding(s, g, region, n, &landing{into: dst, release: release})
	d.loc.Offset = 0
	return d
}

// newLanding completes d with g, a grant of n bytes in region, and the
// Location that names it.
func newLanding(s *clientSession, g verbs.Grant, region uint32, n int, d *landing) *landing {
	r := g.Remote()
	d.g, d.revoked = g, make(chan struct{})
	d.loc = &pb.Location{Transport: transportOf(s.transport), RegionId: region, RemoteKey: r.Key, Address: r.Addr, Length: uint64(n)}
	if d.buf != nil {
		d.loc.Offset = uint64(d.buf.Offset())
	}
	return d
}

// request is the FetchRequest that grants d.
func (d *landing) request(key string) *pb.FetchRequest {
	req := &pb.FetchRequest{Key: key, Landing: d.loc}
	if d.into != nil {
		req.LandingInto = &pb.TensorMeta{Dtype: pb.DType(d.into.DType()), Shape: d.into.Shape(), ByteLength: uint64(len(d.into.Bytes()))}
	}
	return req
}

// landed is the tensor of an answer that says its bytes landed in d.
func (c *Client) landed(ctx context.Context, d *landing, meta *pb.TensorMeta, resp *pb.FetchResponse) (*Tensor, error) {
	if err := checkMeta(meta, c.opts.maxTensorBytes); err != nil {
		d.done()
		return nil, err
	}
	n := int(meta.ByteLength)
	if meta.Location != nil || len(resp.InlineData) > 0 || resp.TransferId != 0 || uint64(n) > d.loc.Length {
		d.done()
		return nil, status.Errorf(codes.Internal, "tensorrpc: the server says tensor %q of %d bytes landed in %d bytes, with a location, inline bytes or a transfer", meta.Key, n, d.loc.Length)
	}
	if !d.keep() {
		return nil, status.Error(codes.Internal, "tensorrpc: a landing kept before its grant was revoked")
	}
	c.stats.transfers.Add(1)
	c.stats.dataPlaneBytes.Add(int64(n))
	c.stats.landed.Add(1)
	explain(ctx, MovedLanded, 1, 0)
	if dst := d.into; dst != nil {
		if err := matchInto(meta, dst); err != nil {
			return nil, err
		}
		if err := verifySum(meta, dst.Bytes()); err != nil {
			return nil, err
		}
		return dst, nil
	}
	if err := verifySum(meta, d.buf.Bytes()[:n]); err != nil {
		d.buf.Release()
		return nil, err
	}
	dtype, shape := shapeOf(meta)
	zt, err := zerocopy.New(dtype, shape, d.buf.Bytes()[:n])
	if err != nil {
		d.buf.Release()
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return &Tensor{Tensor: zt, buf: d.buf}, nil
}

// land Writes e's tensor into the client's landing at on lane l and is
// the answer that says so, or reports false, with e still the caller's,
// when the tensor does not land there (see writeLanding; with into, the
// landing of a Fetch Into, also when the tensor is not exactly into's
// dtype and shape). e's buffer is released when the Write completes.
func (s *Server) land(ss *serverSession, l *engine.Link, key string, e rendezvous.Entry, at *pb.Location, into *pb.TensorMeta) (*pb.FetchResponse, bool) {
	n := len(e.Tensor.Bytes())
	if m := into; m != nil && (m.Dtype != pb.DType(e.Tensor.DType()) || m.ByteLength != uint64(n) || !slices.Equal(m.Shape, e.Tensor.Shape())) {
		return nil, false // not what the caller's tensor is: its memory stays as it is
	}
	if !s.mayLand(ss, l, n, at) {
		return nil, false
	}
	// Described before the Write, whose completion may release e's
	// buffer at once.
	meta := metaOf(key, e.Tensor, s.opts.checksums)
	if !s.writeLanding(ss, l, e.Buf, n, at) {
		return nil, false
	}
	return &pb.FetchResponse{Meta: meta, Landed: true}, true
}

// mayLand reports whether n bytes may land at, on lane l (writeLanding).
func (s *Server) mayLand(ss *serverSession, l *engine.Link, n int, at *pb.Location) bool {
	return at != nil && l != nil && ss.transport == TransportTCP && at.Transport == transportOf(ss.transport) &&
		n > 0 && uint64(n) <= at.Length && n <= s.opts.fetchLanding && len(at.Lanes) == 0
}

// writeLanding posts a Write of the first n bytes of buf into the
// client's landing at on lane l, ahead of the answer that will say so,
// taking over buf's reference (released when the Write completes); or
// reports false, buf still the caller's, when they do not land there:
// the session's plane is not tcp, n is 0 or more than the landing or
// than this server lands, or the Write could not be posted. The lane's
// queue pair delivers in order: the bytes are in place when the answer
// arrives.
func (s *Server) writeLanding(ss *serverSession, l *engine.Link, buf *mempool.Buffer, n int, at *pb.Location) bool {
	if !s.mayLand(ss, l, n, at) {
		return false
	}
	local, err := l.Domain.Reg.Local(buf)
	if err != nil {
		return false
	}
	local.Length = n
	wr := verbs.SendRequest{Op: verbs.OpWrite, Local: local, Remote: verbs.Remote{Addr: at.Address, Key: at.RemoteKey}, LazyCompletion: true}
	if err := l.PostAsync(wr, func(verbs.Completion) { buf.Release() }); err != nil {
		return false
	}
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(int64(n))
	ss.stats.landed.Add(1)
	return true
}

// landingRequest is the FetchRequest a FETCH_REQ with the LANDING flag
// carries: a key and a landing, and nothing the flag does not go with.
func landingRequest(h wire.FrameHeader, body []byte) (*pb.FetchRequest, error) {
	if h.Flags&(wire.FlagRows|wire.FlagLease) != 0 {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: a FETCH_REQ with the LANDING flag asks for rows or a lease")
	}
	req := &pb.FetchRequest{}
	if err := unmarshalFrame(body, req); err != nil {
		return nil, err
	}
	if req.Landing == nil || req.Rows != nil {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: a FETCH_REQ with the LANDING flag names no landing, or rows")
	}
	return req, nil
}

// replyHints is a session's sizes of the reply tensors that did not go
// inline, in order, that each method's last Call returned, for the
// landings of its next Call.
type replyHints struct {
	sizes sync.Map // string -> []int
	n     atomic.Int32
}

func (h *replyHints) get(method string) []int {
	if v, ok := h.sizes.Load(method); ok {
		return v.([]int)
	}
	return nil
}

func (h *replyHints) put(method string, ns []int) {
	if v, ok := h.sizes.Load(method); ok {
		if !slices.Equal(v.([]int), ns) {
			h.sizes.Store(method, ns)
		}
		return
	}
	if len(ns) == 0 {
		return
	}
	if h.n.Add(1) > maxLandingHints {
		h.sizes.Clear()
		h.n.Store(1)
	}
	h.sizes.Store(method, ns)
}

// replyLandings are the landings of a Call of method on lane l for its
// reply's tensors (CallRequest.reply_landings), as many as the sizes its
// last reply's tensors that did not go inline had, up to the last that
// lands: one that does not (too large, or one the session would
// compress, or no pool memory at hand) keeps its place with none (nil,
// an empty Location in the request), so that each keeps its index.
func (c *Client) replyLandings(ctx context.Context, s *clientSession, l *engine.Link, method string) []*landing {
	if s.landing == 0 || s.transport != TransportTCP {
		return nil
	}
	var ds []*landing
	last := 0
	for _, n := range s.replyHints.get(method) {
		var d *landing
		if n > engine.FrameInline(s.eager) && n <= s.landing && l.Squeeze.Plain(ctx, n) {
			if buf, err := c.pool.TryAlloc(n); err == nil {
				if g, err := l.Grant(buf, n, verbs.AccessRemoteWrite); err == nil {
					d = newLanding(s, g, buf.Arena().ID(), n, &landing{buf: buf})
				} else {
					buf.Release()
				}
			}
		}
		ds = append(ds, d)
		if d != nil {
			last = len(ds)
		}
	}
	return ds[:last]
}

// replyLocations is what a CallRequest names of ds.
func replyLocations(ds []*landing) []*pb.Location {
	if len(ds) == 0 {
		return nil
	}
	locs := make([]*pb.Location, len(ds))
	for i, d := range ds {
		if d == nil {
			locs[i] = &pb.Location{}
		} else {
			locs[i] = d.loc
		}
	}
	return locs
}

// revokeAll is the Call's hold for its landings.
func revokeAll(ds []*landing) {
	for _, d := range ds {
		if d != nil {
			d.revoke()
		}
	}
}

// doneAll is the caller's end of the landings keep did not take.
func doneAll(ds []*landing) {
	for _, d := range ds {
		if d != nil && !d.kept {
			d.done()
		}
	}
}

// landedReply is the reply tensor meta describes, whose bytes landed in
// ds[*meta.LandingIndex].
func (c *Client) landedReply(ctx context.Context, ds []*landing, meta *pb.TensorMeta) (*Tensor, error) {
	i := int(*meta.LandingIndex)
	if i >= len(ds) || ds[i] == nil || ds[i].kept {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: reply tensor landed in landing %d of %d, none or taken", i, len(ds))
	}
	if meta.InlineIndex != nil || meta.TransferId != 0 {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: a landed reply tensor with inline data or a transfer")
	}
	d := ds[i]
	d.kept = true
	return c.landed(ctx, d, meta, &pb.FetchResponse{})
}
