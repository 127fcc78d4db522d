package rpc

import (
	"context"
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

// landing is a Fetch's landing on the client: its buffer and the grant
// that opens it to the server. Of the call's two ends, the revoke (the
// call's hold: its answer came, or the link ended) and the caller's
// (done, or keep), the second frees the buffer, unless keep took it.
type landing struct {
	buf  *mempool.Buffer
	g    verbs.Grant
	loc  *pb.Location
	ends atomic.Int32
}

// revoke ends the grant: no Write of the server lands after it.
func (d *landing) revoke() {
	d.g.Revoke()
	d.end()
}

// done is the caller's end when nothing landed: the buffer goes once
// the grant is revoked.
func (d *landing) done() { d.end() }

func (d *landing) end() {
	if d.ends.Add(1) == 2 {
		d.buf.Release()
	}
}

// keep is the caller's end when the bytes landed: the buffer is the
// caller's. It reports false (and the buffer goes with the revoke) when
// the grant was not revoked yet, which an answer that came never leaves.
func (d *landing) keep() bool {
	return d.ends.Add(1) == 2
}

// landingFor is a landing for a Fetch of key on lane l, or nil when the
// Fetch does not land: the session's plane takes none, the Fetch is not
// of a whole tensor into the pool, the key's size is not known or not
// one that lands, or the session would compress the bytes. Failing to
// grant one is not an error: the Fetch goes as any other.
func (c *Client) landingFor(ctx context.Context, s *clientSession, l *engine.Link, key string, fo fetchOptions) *landing {
	if s.landing == 0 || fo.into != nil || fo.rows != nil || fo.lease || s.transport != TransportTCP {
		return nil
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
	r := g.Remote()
	return &landing{buf: buf, g: g, loc: &pb.Location{
		Transport: transportOf(s.transport), RegionId: buf.Arena().ID(), RemoteKey: r.Key,
		Address: r.Addr, Offset: uint64(buf.Offset()), Length: uint64(n),
	}}
}

// landed is the tensor of an answer that says its bytes landed in d.
func (c *Client) landed(ctx context.Context, d *landing, meta *pb.TensorMeta, resp *pb.FetchResponse) (*Tensor, error) {
	if err := checkMeta(meta, c.opts.maxTensorBytes); err != nil {
		d.done()
		return nil, err
	}
	n := int(meta.ByteLength)
	if meta.Location != nil || len(resp.InlineData) > 0 || resp.TransferId != 0 || n > d.buf.Len() {
		d.done()
		return nil, status.Errorf(codes.Internal, "tensorrpc: the server says tensor %q of %d bytes landed in %d bytes, with a location, inline bytes or a transfer", meta.Key, n, d.buf.Len())
	}
	if !d.keep() {
		return nil, status.Error(codes.Internal, "tensorrpc: a landing kept before its grant was revoked")
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
	c.stats.transfers.Add(1)
	c.stats.dataPlaneBytes.Add(int64(n))
	c.stats.landed.Add(1)
	explain(ctx, MovedLanded, 1, 0)
	return &Tensor{Tensor: zt, buf: d.buf}, nil
}

// land Writes e's tensor into the client's landing on lane l and is the
// answer that says so, or reports false, with e still the caller's, when
// the tensor does not land there: the session's plane is not tcp, the
// tensor is empty, larger than the landing or than this server lands, or
// the Write could not be posted. The Write goes ahead of the answer on
// l, whose queue pair delivers in order; e's buffer is released when it
// completes.
func (s *Server) land(ss *serverSession, l *engine.Link, key string, e rendezvous.Entry, at *pb.Location) (*pb.FetchResponse, bool) {
	n := len(e.Tensor.Bytes())
	if at == nil || l == nil || ss.transport != TransportTCP || at.Transport != transportOf(ss.transport) ||
		n == 0 || uint64(n) > at.Length || n > s.opts.fetchLanding || len(at.Lanes) > 0 {
		return nil, false
	}
	local, err := l.Domain.Reg.Local(e.Buf)
	if err != nil {
		return nil, false
	}
	local.Length = n
	meta := metaOf(key, e.Tensor, s.opts.checksums)
	buf := e.Buf
	wr := verbs.SendRequest{Op: verbs.OpWrite, Local: local, Remote: verbs.Remote{Addr: at.Address, Key: at.RemoteKey}, LazyCompletion: true}
	if err := l.PostAsync(wr, func(verbs.Completion) { buf.Release() }); err != nil {
		return nil, false
	}
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(int64(n))
	ss.stats.landed.Add(1)
	return &pb.FetchResponse{Meta: meta, Landed: true}, true
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
