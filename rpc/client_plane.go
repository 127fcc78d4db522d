package rpc

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// callPlane carries one session's Fetch, Send and Call. Client.Fetch, Send
// and Call check their arguments once and hand them to their session's
// plane, one of two:
//
//   - engine, the data-plane engine (a session on ibv, shm or tcp): calls
//     as frames on the session's lanes when both sides negotiated them
//     (data_plane_calls), else, and for a request too large for a receive
//     slot, the unary methods; tensor bytes move one-sided either way.
//     Device tensors take the same path (SendDevice, FetchToDevice).
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
}

func (o outgoing) len() int { return int(o.meta.ByteLength) }

func (o outgoing) finish() {
	if o.done != nil {
		o.done()
	}
}

// engine is the data-plane engine's callPlane.
type engine struct {
	c *Client
	s *clientSession
}

func (e engine) fetch(ctx context.Context, key string, fo fetchOptions) (*Tensor, error) {
	l, resp, err := e.ask(ctx, key, fo)
	if err != nil {
		return nil, err
	}
	t, err := e.c.receive(ctx, e.s, l, resp.Meta, resp.InlineData, resp.TransferId, fo.lease)
	if err != nil {
		e.c.stats.errors.Add(1)
	}
	return t, err
}

// ask asks for the tensor published under key: the server's answer, and
// the lane whose grants its location names.
func (e engine) ask(ctx context.Context, key string, fo fetchOptions) (*link, *pb.FetchResponse, error) {
	if e.s.frames && frameHeaderLen+len(key) <= e.s.link.fr.slotSize {
		l := e.s.lane()
		resp, fallback, err := e.c.askFrame(ctx, e.s, l, key, fo)
		if !fallback {
			return l, resp, err
		}
	}
	resp, err := e.c.askUnary(ctx, e.s, key, fo)
	return e.s.link, resp, err
}

func (e engine) send(ctx context.Context, key string, t *Tensor) error {
	return e.sendOut(ctx, outgoing{meta: metaOf(key, t.Tensor, e.c.opts.checksums), t: t})
}

// sendOut sends a host or device tensor.
func (e engine) sendOut(ctx context.Context, out outgoing) error {
	if e.s.frames {
		if fits, err := e.c.sendFrame(ctx, e.s, out); fits {
			return err
		}
	}
	_, err := e.c.sendMethods(ctx, e.s, out, false)
	return err
}

func (e engine) call(ctx context.Context, method string, req *Message) (*Message, error) {
	if e.s.frames {
		if reply, fits, err := e.c.callFrame(ctx, e.s, method, req); fits {
			return reply, err
		}
	}
	return e.c.callUnary(ctx, e.s, method, req)
}

// streams is the gRPC-stream fallback's callPlane.
type streams struct {
	c *Client
	s *clientSession
}

func (p streams) fetch(ctx context.Context, key string, fo fetchOptions) (*Tensor, error) {
	return p.c.fetchStream(ctx, p.s, key, fo.wait)
}

func (p streams) send(ctx context.Context, key string, t *Tensor) error {
	return p.c.sendStream(ctx, key, t)
}

func (p streams) call(ctx context.Context, method string, req *Message) (*Message, error) {
	return p.c.callStream(ctx, method, req)
}

// sendMethods moves one tensor with the Send method: inline when it is a
// small host tensor, else into a destination the server allocates, with
// WriteImm. With hold, the server keeps it for a Call and sendMethods
// returns its transfer id.
func (c *Client) sendMethods(ctx context.Context, s *clientSession, out outgoing, hold bool) (uint64, error) {
	n := out.len()
	if out.t != nil && n <= s.eager {
		resp, err := c.api.Send(ctx, &pb.SendRequest{SessionId: s.id, Meta: out.meta, InlineData: out.t.Bytes(), Hold: hold})
		if err != nil {
			return 0, sessionError(s, err)
		}
		c.stats.transfers.Add(1)
		c.stats.inlineBytes.Add(int64(n))
		if n > 0 {
			c.stats.copied(n) // into the control message
		}
		return resp.TransferId, nil
	}
	if out.t == nil {
		return c.writeRendezvous(ctx, s, out.meta, verbs.Local{Region: out.region, Offset: out.offset, Length: n}, out.finish, hold)
	}
	src, err := poolBuffer(ctx, c.pool, out.t, &c.stats)
	if err != nil {
		return 0, err
	}
	local, err := s.link.dev.reg.Local(src)
	if err != nil {
		src.Release()
		return 0, status.Error(codes.Internal, err.Error())
	}
	return c.writeRendezvous(ctx, s, out.meta, local, func() { src.Release() }, hold)
}
