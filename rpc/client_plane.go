package rpc

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// callPlane carries one session's Fetch, Send and Call. Client.Fetch, Send
// and Call check their arguments once and hand them to their session's
// plane, one of two:
//
//   - engine, the data-plane engine (a session on ibv, shm or tcp): every
//     call is frames on the session's lanes (a body too large for a slot
//     goes indirect, see rpc/internal/engine/frame.go), and tensor bytes move one-sided, pulled
//     by the receiver. Device tensors take the same path (SendDevice,
//     FetchToDevice).
//   - streams, the gRPC-stream fallback (a TRANSPORT_GRPC session).
type callPlane interface {
	fetch(ctx context.Context, key string, fo fetchOptions) (*Tensor, error)
	send(ctx context.Context, key string, t *Tensor) error
	call(ctx context.Context, method string, req *Message) (*Message, error)
}

// outgoing is a tensor on its way to the server: a host tensor t, or
// device memory registered for the transfer (region, from offset), whose
// done the engine runs exactly once, when the data plane no longer reads
// it (which can be after the call returned, when ctx ended first).
type outgoing struct {
	meta   *pb.TensorMeta
	t      *Tensor
	region verbs.MemoryRegion
	offset int
	done   func()
	rows   []int64 // SendRows: the rows t's rows are written over
}

func (o outgoing) len() int { return int(o.meta.ByteLength) }

func (o outgoing) finish() {
	if o.done != nil {
		o.done()
	}
}

// framePlane is the callPlane of a session on a data plane: every call is a frame.
type framePlane struct {
	c *Client
	s *clientSession
}

func (e framePlane) fetch(ctx context.Context, key string, fo fetchOptions) (*Tensor, error) {
	l := e.s.lane()
	fo.land = e.c.landingFor(ctx, e.s, l, key, fo)
	var t0 time.Time
	if fo.land != nil && l.Squeeze != nil {
		t0 = time.Now()
	}
	resp, err := e.c.askFrame(ctx, e.s, l, key, fo)
	if fo.land != nil {
		if err == nil && resp.Landed {
			if !t0.IsZero() {
				// What a Read would have measured for auto's goodput.
				l.Squeeze.Observe(int(resp.Meta.GetByteLength()), 0, time.Since(t0))
			}
			t, err := e.c.landed(ctx, fo.land, resp.Meta, resp)
			if err == nil {
				e.s.hints.put(key, len(t.Bytes()))
			}
			return t, err
		}
		d := fo.land
		d.done()
		if d.into != nil {
			// Caller memory is the caller's again when Fetch returns:
			// the grant must be revoked first (it is once the answer, or
			// the lane's end, came).
			awaitReads(e.s, d.revoked)
		}
		fo.land = nil
	}
	if err != nil {
		return nil, err
	}
	if n := int(resp.Meta.GetByteLength()); fo.rows == nil && n > engine.FrameInline(e.s.eager) {
		e.s.hints.put(key, n)
	}
	fo.rowsOfSource = resp.RowsOfSource
	if fo.rowsOfSource {
		loc := resp.Meta.GetLocation()
		if fo.rows == nil || loc == nil {
			e.c.releaseTransfer(e.s, resp.TransferId)
			return nil, status.Error(codes.Internal, "tensorrpc: the server's answer grants a source's rows to a Fetch that asked for none, or grants nothing")
		}
		// The location grants the whole source: its length is checked
		// against each row read, the rest as for any tensor.
		meta := proto.Clone(resp.Meta).(*pb.TensorMeta)
		fo.sourceBytes, meta.Location.Length = loc.Length, meta.ByteLength
		resp.Meta = meta
	}
	if fo.rows != nil && !fo.rowsOfSource {
		if err := checkRowsAnswer(resp.Meta, len(fo.rows)); err != nil {
			e.c.releaseTransfer(e.s, resp.TransferId)
			return nil, err
		}
	}
	t, err := e.c.receive(ctx, e.s, l, resp.Meta, resp.InlineData, resp.TransferId, fo)
	recycleInline(resp.InlineData) // copied into the tensor, or failed
	if err != nil {
		e.c.stats.errors.Add(1)
	}
	return t, err
}

// ask asks for the tensor published under key: the server's answer, and
// the lane whose grants its location names.
func (e framePlane) ask(ctx context.Context, key string, fo fetchOptions) (*engine.Link, *pb.FetchResponse, error) {
	l := e.s.lane()
	resp, err := e.c.askFrame(ctx, e.s, l, key, fo)
	return l, resp, err
}

func (e framePlane) send(ctx context.Context, key string, t *Tensor) error {
	return e.sendOut(ctx, outgoing{meta: metaOf(key, t.Tensor, e.c.opts.checksums), t: t})
}

// sendOut sends a host or device tensor.
func (e framePlane) sendOut(ctx context.Context, out outgoing) error {
	return e.c.sendFrame(ctx, e.s, out)
}

func (e framePlane) call(ctx context.Context, method string, req *Message) (*Message, error) {
	return e.c.callFrame(ctx, e.s, method, req)
}

// streams is the gRPC-stream fallback's callPlane. Its calls are gRPC
// streams of their own, which the session's end does not end: Close
// cancels them (untilClose).
type streams struct {
	c *Client
	s *clientSession
}

func (p streams) fetch(ctx context.Context, key string, fo fetchOptions) (*Tensor, error) {
	ctx, stop := p.c.untilClose(ctx)
	defer stop()
	return p.c.fetchStream(ctx, p.s, key, fo)
}

func (p streams) send(ctx context.Context, key string, t *Tensor) error {
	ctx, stop := p.c.untilClose(ctx)
	defer stop()
	return p.c.sendStream(ctx, p.s, key, t, nil)
}

func (p streams) call(ctx context.Context, method string, req *Message) (*Message, error) {
	ctx, stop := p.c.untilClose(ctx)
	defer stop()
	return p.c.callStream(ctx, p.s, method, req)
}
