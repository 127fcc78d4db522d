package rpc

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// DeviceTensor is a tensor in device memory (a GPU, PCI p2pmem): its
// element type and shape, and the device buffer that holds its bytes from
// Offset on.
//
// Experimental: the direct (GPUDirect RDMA, p2pmem) path has not run on
// hardware; the staged path is tested with a host-memory stand-in device.
type DeviceTensor struct {
	DType  zerocopy.DType
	Shape  []int64
	Buffer gpudirect.DeviceBuffer
	Offset int
}

// topology discovers the host's PCI topology once per Client.
type topology struct {
	once sync.Once
	topo *gpudirect.Topology
}

func (t *topology) get(o *options) *gpudirect.Topology {
	t.once.Do(func() {
		if o.topology != nil {
			t.topo = o.topology
			return
		}
		topo, err := gpudirect.Discover()
		if err == nil {
			t.topo = topo
		}
	})
	return t.topo
}

// plan decides how a device buffer moves over this session's data plane.
func (c *Client) plan(s *clientSession, buf gpudirect.DeviceBuffer) gpudirect.Decision {
	if c.planFor != nil {
		return c.planFor(buf)
	}
	return gpudirect.Plan(buf, s.transport, c.topo.get(&c.opts))
}

// SendDevice puts a device tensor into the server's rendezvous under key,
// like Send. Where the hardware allows (ibv with GPUDirect RDMA or p2pmem,
// see gpudirect.Plan) the NIC reads the device memory directly; otherwise
// the bytes are staged through pool memory (one device-to-host copy).
// For a gpudirect.AsyncBuffer on a data plane the staging is pipelined:
// the server reserves the tensor's destination, the tensor is copied off
// the device in chunks (WithStagingChunk, 8 MiB by default) into a ring
// of pinned pool slots, each written into the destination while the next
// is copied, and a commit publishes it, so the transfer takes about the
// time of the slower of the two. If ctx ends or a copy or write fails
// midway, nothing is published and the destination is freed. Small
// tensors, the gRPC fallback, and servers from before reserved Sends
// (which do not announce them in the handshake) take the whole tensor to
// the host first, asynchronously into pinned memory, then Send it; a
// plain DeviceBuffer copies synchronously. The returned Decision says
// which path was taken and why.
func (c *Client) SendDevice(ctx context.Context, key string, t DeviceTensor) (gpudirect.Decision, error) {
	n, err := deviceBytes(t)
	if err != nil {
		return gpudirect.Decision{}, err
	}
	s, err := c.start(ctx)
	if err != nil {
		return gpudirect.Decision{}, err
	}
	defer c.leave()
	if d, ok, err := c.sendDeviceIPC(ctx, s, key, t, n); ok {
		return d, err
	}
	d := c.plan(s, t.Buffer)
	if e, ok := s.calls.(framePlane); ok && d.Path == gpudirect.Direct && n > s.eager {
		mr, _, err := c.registerDevice(s, t.Buffer, t.Offset, n, verbs.AccessLocalWrite)
		if err == nil {
			meta := &pb.TensorMeta{Key: key, Dtype: pb.DType(t.DType), Shape: append([]int64(nil), t.Shape...), ByteLength: uint64(n)}
			err = c.intercept(ctx, s, OpSend, key, int64(n), func(ctx context.Context, _ *CallInfo) error {
				return e.sendOut(ctx, outgoing{meta: meta, region: mr, offset: t.Offset, done: func() { mr.Deregister() }})
			})
			if err == nil {
				c.stats.direct.Add(1)
			}
			return d, err
		}
		d = gpudirect.Decision{Path: gpudirect.Staged, Reason: fmt.Sprintf("registering %s with %s failed: %v; using host staging", t.Buffer.Device(), s.transport, err)}
	}
	if e, ok := s.calls.(framePlane); ok && s.reservations && n > engine.FrameInline(s.eager) {
		if ab, ok := c.stage.async(t.Buffer); ok {
			err := c.intercept(ctx, s, OpSend, key, int64(n), func(ctx context.Context, _ *CallInfo) error {
				return c.sendPipelined(ctx, e, key, t, ab, n)
			})
			if err != nil {
				return d, err
			}
			c.stats.copied(n)
			c.stats.staged.Add(1)
			return d, nil
		}
	}
	buf, err := c.stage.stageOut(ctx, &c.stats, t, n)
	if err != nil {
		return d, err
	}
	c.stats.copied(n)
	staged, err := newPoolTensor(t.DType, t.Shape, buf)
	if err != nil {
		return d, status.Error(codes.InvalidArgument, err.Error())
	}
	defer staged.Release()
	if err := c.Send(ctx, key, staged); err != nil {
		return d, err
	}
	c.stats.staged.Add(1)
	return d, nil
}

// registerDevice registers the direct memory of a device buffer for one
// transfer. Registering per transfer costs what the pool avoids for host
// memory; device arenas are few and long-lived in practice, and a cache of
// their registrations is future work.
func (c *Client) registerDevice(s *clientSession, buf gpudirect.DeviceBuffer, offset, n int, access verbs.Access) (verbs.MemoryRegion, verbs.Local, error) {
	m, ok := buf.Direct()
	if !ok {
		return nil, verbs.Local{}, fmt.Errorf("%s has no direct memory", buf.Device())
	}
	mr, err := s.link.Domain.PD.RegisterMemory(m, access)
	if err != nil {
		return nil, verbs.Local{}, err
	}
	return mr, verbs.Local{Region: mr, Offset: offset, Length: n}, nil
}

// PublishDevice publishes a device tensor under key by staging it into the
// Server's pool (one device-to-host copy, asynchronous into pinned memory
// for a gpudirect.AsyncBuffer); the device buffer may be reused once it
// returns.
func (s *Server) PublishDevice(ctx context.Context, key string, t DeviceTensor) error {
	n, err := deviceBytes(t)
	if err != nil {
		return err
	}
	buf, err := s.stage.stageOut(ctx, &s.total, t, n)
	if err != nil {
		return err
	}
	pt, err := newPoolTensor(t.DType, t.Shape, buf)
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	defer pt.Release()
	return s.Publish(ctx, key, pt)
}

func deviceBytes(t DeviceTensor) (int, error) {
	if t.Buffer == nil {
		return 0, status.Error(codes.InvalidArgument, "tensorrpc: device tensor without a buffer")
	}
	n, err := zerocopy.ByteSize(t.DType, t.Shape)
	if err != nil {
		return 0, status.Error(codes.InvalidArgument, err.Error())
	}
	if t.Offset < 0 || int64(t.Offset)+n > int64(t.Buffer.Len()) {
		return 0, status.Errorf(codes.InvalidArgument, "tensorrpc: %d bytes at offset %d do not fit %s (%d bytes)", n, t.Offset, t.Buffer.Device(), t.Buffer.Len())
	}
	return int(n), nil
}
