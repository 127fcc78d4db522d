package rpc

import (
	"context"
	"errors"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// DeviceAllocFunc allocates the device memory a tensor fetched with
// FetchDevice lands in, once the server's answer has said what it is: n
// bytes (zerocopy.ByteSize of dtype and shape) are written from offset 0.
// For n == 0 it may return a nil buffer. An error it returns fails the
// fetch with its status code (ResourceExhausted when it has none).
type DeviceAllocFunc func(dtype zerocopy.DType, shape []int64, n int) (gpudirect.DeviceBuffer, error)

// FetchDevice fetches the tensor published under key onto a device, into
// a buffer alloc allocates once the server's answer says the tensor's
// dtype, shape and size: the caller need not know them beforehand. The
// bytes move by the best path the session has, as for FetchToDevice:
//
//   - CUDA IPC (WithCUDA on both sides, one host, a common GPU) when the
//     server holds the tensor on a device (PublishDeviceInPlace, or a
//     tensor sent over IPC): one device-to-device copy, host memory never
//     touched;
//   - GPUDirect RDMA into the buffer where gpudirect.Plan allows (ibv);
//   - on a data plane (shm, tcp, ibv staged) with a gpudirect.AsyncBuffer,
//     the pinned, pipelined staged read (chunks read into a ring of
//     pinned pool slots, each copied to the device while the next is
//     read);
//   - otherwise (the gRPC fallback, a plain DeviceBuffer) the whole
//     tensor is fetched into the pool, then copied onto the device once.
//
// The returned DeviceTensor's Buffer is the one alloc returned (Offset 0)
// and is the caller's to free. If FetchDevice fails after alloc returned,
// it frees that buffer itself (after any copy or Read into it has
// ended), so nothing leaks; alloc is called at most once, and not at all
// when the fetch fails before the answer arrives. The returned Decision
// says which path was taken and why.
//
// Experimental.
func (c *Client) FetchDevice(ctx context.Context, key string, alloc DeviceAllocFunc) (DeviceTensor, gpudirect.Decision, error) {
	if alloc == nil {
		return DeviceTensor{}, gpudirect.Decision{}, status.Error(codes.InvalidArgument, "tensorrpc: FetchDevice without an allocator")
	}
	dst := &deviceDst{alloc: alloc}
	t, d, err := c.fetchDevice(ctx, key, dst)
	if err != nil {
		dst.fail()
		return DeviceTensor{}, d, err
	}
	return t, d, nil
}

// FetchToDevice fetches the tensor published under key, like Fetch, into
// dst at offset, and returns its dtype and shape. It takes the paths
// FetchDevice describes: CUDA IPC where negotiated and the server holds
// the tensor on a device (dst must be a gpudirect.AsyncBuffer), the NIC
// writing device memory directly where the hardware allows, else staged
// (one host-to-device copy). For a gpudirect.AsyncBuffer on a data plane
// the staging is pipelined: the tensor is read in chunks
// (WithStagingChunk, 8 MiB by default) into a ring of pinned pool slots,
// each copied to the device asynchronously while the next is read, so the
// transfer takes about the time of the slower of the two. On the gRPC
// fallback the whole tensor is fetched, then copied with one asynchronous
// copy; a plain DeviceBuffer is fetched, then copied synchronously. If
// ctx ends midway, FetchToDevice returns ctx's error once its copies have
// completed; dst then holds some of the bytes. The returned Decision says
// which path was taken and why.
func (c *Client) FetchToDevice(ctx context.Context, key string, dst gpudirect.DeviceBuffer, offset int) (zerocopy.DType, []int64, gpudirect.Decision, error) {
	t, d, err := c.fetchDevice(ctx, key, &deviceDst{buf: dst, offset: offset})
	if err != nil {
		return 0, nil, d, err
	}
	return t.DType, t.Shape, d, nil
}

// deviceDst is where a device fetch lands: the caller's buffer at offset
// (FetchToDevice), or one alloc makes once the answer says the tensor's
// size (FetchDevice).
type deviceDst struct {
	buf    gpudirect.DeviceBuffer
	offset int
	alloc  DeviceAllocFunc
	// allocated: buf came from alloc, and is freed if the fetch fails;
	// late: a failed direct Read frees it when its abandoned Reads end.
	allocated bool
	late      bool
}

// get returns the buffer and offset n bytes of the tensor land at,
// allocating it at the first call in FetchDevice. The buffer is nil only
// for n == 0.
func (d *deviceDst) get(dtype zerocopy.DType, shape []int64, n int) (gpudirect.DeviceBuffer, int, error) {
	if d.alloc != nil && !d.allocated {
		buf, err := d.alloc(dtype, append([]int64(nil), shape...), n)
		if err != nil {
			if _, ok := status.FromError(err); !ok || status.Code(err) == codes.Unknown {
				err = status.Errorf(codes.ResourceExhausted, "tensorrpc: device memory for %d bytes: %v", n, err)
			}
			return nil, 0, err
		}
		d.buf, d.allocated = buf, true
	}
	if d.buf == nil {
		if n == 0 {
			return nil, 0, nil
		}
		return nil, 0, status.Errorf(codes.InvalidArgument, "tensorrpc: no device buffer for %d bytes", n)
	}
	if d.offset < 0 || d.offset > d.buf.Len() || n > d.buf.Len()-d.offset {
		return nil, 0, status.Errorf(codes.InvalidArgument, "tensorrpc: %d bytes at offset %d do not fit %s (%d bytes)", n, d.offset, d.buf.Device(), d.buf.Len())
	}
	return d.buf, d.offset, nil
}

// fail frees the buffer alloc made, once the fetch failed (unless a
// failed direct Read frees it later).
func (d *deviceDst) fail() {
	if d.allocated && !d.late && d.buf != nil {
		d.buf.Free()
	}
	d.allocated, d.buf = false, nil
}

// noBytes is the Decision of a device fetch of 0 bytes into no buffer.
var noBytes = gpudirect.Decision{Path: gpudirect.Staged, Reason: "0 bytes: nothing to move"}

// fetchDevice is the work of FetchToDevice and FetchDevice: CUDA IPC when
// the session has it, else the server's answer on the data plane, read by
// the path the destination allows, else (gRPC) a Fetch copied onto the
// device.
func (c *Client) fetchDevice(ctx context.Context, key string, dst *deviceDst) (DeviceTensor, gpudirect.Decision, error) {
	s, err := c.start(ctx)
	if err != nil {
		return DeviceTensor{}, gpudirect.Decision{}, err
	}
	defer c.leave()
	if t, ok, err := c.fetchIPC(ctx, s, key, dst); ok {
		return t, ipcDecision, err
	}
	if e, ok := s.calls.(framePlane); ok {
		return c.fetchDeviceFrames(ctx, e, key, dst)
	}
	t, err := c.Fetch(ctx, key)
	if err != nil {
		return DeviceTensor{}, gpudirect.Decision{}, err
	}
	defer t.Release()
	buf, off, err := dst.get(t.DType(), t.Shape(), len(t.Bytes()))
	if err != nil {
		return DeviceTensor{}, gpudirect.Decision{}, err
	}
	out := DeviceTensor{DType: t.DType(), Shape: append([]int64(nil), t.Shape()...), Buffer: buf, Offset: off}
	if buf == nil {
		return out, noBytes, nil
	}
	d := c.plan(s, buf)
	if err := c.stage.stageIn(ctx, &c.stats, buf, off, t.Bytes(), t.buf); err != nil {
		return DeviceTensor{}, d, err
	}
	c.stats.copied(len(t.Bytes()))
	c.stats.staged.Add(1)
	return out, d, nil
}

// fetchDeviceFrames is a device fetch on a data plane: an ordinary
// FETCH_REQ, whose answer says the tensor's size before the destination is
// chosen; then a direct Read into the device where Plan allows, the
// pipelined staged read for an AsyncBuffer, else a read into the pool and
// one synchronous copy.
func (c *Client) fetchDeviceFrames(ctx context.Context, e framePlane, key string, dst *deviceDst) (DeviceTensor, gpudirect.Decision, error) {
	s := e.s
	var out DeviceTensor
	var d gpudirect.Decision
	err := c.intercept(ctx, s, OpFetch, key, 0, func(ctx context.Context, info *CallInfo) error {
		l, resp, err := e.ask(ctx, key, fetchOptions{})
		if err != nil {
			return err
		}
		if err := checkMeta(resp.Meta, c.opts.maxTensorBytes); err != nil {
			c.releaseTransfer(s, resp.TransferId)
			return err
		}
		dtype, shape := shapeOf(resp.Meta)
		n := int(resp.Meta.ByteLength)
		buf, off, err := dst.get(dtype, shape, n)
		if err != nil {
			c.releaseTransfer(s, resp.TransferId)
			return err
		}
		out = DeviceTensor{DType: dtype, Shape: append([]int64(nil), shape...), Buffer: buf, Offset: off}
		info.setResponse(int64(n))
		if buf == nil {
			c.releaseTransfer(s, resp.TransferId)
			c.stats.transfers.Add(1)
			d = noBytes
			return nil
		}
		d = c.plan(s, buf)
		if d.Path == gpudirect.Direct {
			err := c.readDirect(ctx, e, l, resp, dst, buf, off)
			var nr errNotRegistered
			if !errors.As(err, &nr) {
				if err == nil {
					c.stats.direct.Add(1)
				}
				return err
			}
			d = gpudirect.Decision{Path: gpudirect.Staged, Reason: nr.Error() + "; using host staging"}
		}
		if ab, ok := c.stage.async(buf); ok {
			if err := c.readPipelined(ctx, e, l, resp, ab, off); err != nil {
				return err
			}
		} else {
			t, err := c.receive(ctx, s, l, resp.Meta, resp.InlineData, resp.TransferId, fetchOptions{})
			if err != nil {
				c.stats.errors.Add(1)
				return err
			}
			defer t.Release()
			if err := c.stage.stageIn(ctx, &c.stats, buf, off, t.Bytes(), t.buf); err != nil {
				return err
			}
		}
		c.stats.copied(n)
		c.stats.staged.Add(1)
		return nil
	})
	if err != nil {
		return DeviceTensor{}, d, err
	}
	return out, d, nil
}

// errNotRegistered is a direct Read whose device memory could not be
// registered: the transfer is still held, to be read staged instead.
type errNotRegistered struct{ msg string }

func (e errNotRegistered) Error() string { return e.msg }

// readDirect reads the tensor resp grants straight into registered
// device memory buf at offset. It fails with errNotRegistered, keeping the
// transfer, when the memory cannot be registered.
func (c *Client) readDirect(ctx context.Context, e framePlane, l *engine.Link, resp *pb.FetchResponse, dst *deviceDst, buf gpudirect.DeviceBuffer, offset int) error {
	s := e.s
	n := int(resp.Meta.ByteLength)
	loc := resp.Meta.Location
	if loc == nil { // small: it came inline
		if err := gpudirect.StageIn(buf, offset, resp.InlineData); err != nil || len(resp.InlineData) != n {
			return status.Errorf(codes.InvalidArgument, "tensorrpc: inline tensor %q: %d bytes, %v", resp.Meta.Key, len(resp.InlineData), err)
		}
		return nil
	}
	mr, local, err := c.registerDevice(s, buf, offset, n, verbs.AccessLocalWrite)
	if err != nil {
		return errNotRegistered{msg: "registering " + buf.Device() + " with " + s.transport + " failed: " + err.Error()}
	}
	id := resp.TransferId
	// Reads a failed ReadLanes abandoned still write buf: a buffer
	// FetchDevice allocated is freed once they end, not before.
	free := dst.allocated
	dst.late = free
	err = engine.ReadLanes(ctx, l, s.lanes, local, verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}, loc.Lanes, func() {
		mr.Deregister()
		c.releaseTransfer(s, id)
		if free {
			buf.Free()
		}
	})
	if err != nil {
		return err
	}
	dst.late = false
	mr.Deregister()
	c.releaseTransfer(s, id)
	c.stats.transfers.Add(1)
	c.stats.dataPlaneBytes.Add(int64(n))
	return nil
}

// readPipelined reads the tensor resp grants into dst at offset staged on
// a data plane: the client reads it a chunk at a time into a ring of
// pinned pool slots (over every lane where it is granted on all) and
// copies each chunk to the device asynchronously while it reads the next
// (gpudirect.StageInPipelined). The server saw a Fetch like any other:
// nothing new on the wire.
func (c *Client) readPipelined(ctx context.Context, e framePlane, l *engine.Link, resp *pb.FetchResponse, dst gpudirect.AsyncBuffer, offset int) error {
	s := e.s
	key := resp.Meta.Key
	n := int(resp.Meta.ByteLength)
	loc := resp.Meta.Location
	if loc == nil { // small: it came inline
		if len(resp.InlineData) != n {
			return status.Errorf(codes.InvalidArgument, "tensorrpc: inline tensor %q: %d bytes for %d", key, len(resp.InlineData), n)
		}
		if err := c.stage.stageIn(ctx, &c.stats, dst, offset, resp.InlineData, nil); err != nil {
			return err
		}
		c.stats.inlineBytes.Add(int64(n))
		c.stats.transfers.Add(1)
		return nil
	}
	id := resp.TransferId
	if loc.Transport != transportOf(s.transport) || id == 0 || loc.Length != uint64(n) {
		c.releaseTransfer(s, id)
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: a location of %d bytes on %s for %d bytes on %s", key, loc.Length, loc.Transport, n, s.transport)
	}
	// The server's grant stays until every Read of it has completed,
	// also those a cancelled transfer left under way.
	var holds atomic.Int32
	holds.Store(1)
	drop := func() {
		if holds.Add(-1) == 0 {
			c.releaseTransfer(s, id)
		}
	}
	var pinned atomic.Bool
	ring := c.stage.ring
	if k := len(loc.Lanes); k > 1 && c.opts.stageChunk == 0 {
		// A striped tensor: chunks large enough to be read over every
		// lane at once (engine.Stripes), else each chunk's Read runs on
		// two lanes while the whole Fetch would run on all (on 16 cores,
		// 8 MiB chunks read 12 GB/s where the Fetch of the tensor read 30).
		chunk := ring.Chunk
		if chunk <= 0 {
			chunk = gpudirect.DefaultStageChunk
		}
		ring.Chunk = max(chunk, k*engine.StripePart)
	}
	err := gpudirect.StageInPipelined(ctx, c.pool, dst, offset, n, ring, func(ctx context.Context, ch gpudirect.StageChunk) error {
		local, err := l.Domain.Reg.Local(ch.Ring)
		if err != nil {
			return status.Error(codes.Internal, err.Error())
		}
		local.Offset += ch.At
		local.Length = ch.Len
		pinned.Store(c.stage.pinned(dst, ch.Ring))
		remote, striped := chunkAt(loc, ch.Pos)
		holds.Add(1)
		ch.Ring.Retain()
		end := func() {
			ch.Ring.Release()
			drop()
		}
		if err := engine.ReadLanes(ctx, l, s.lanes, local, remote, striped, end); err != nil {
			return err
		}
		end()
		return nil
	})
	drop()
	if err != nil {
		c.stats.errors.Add(1)
		return stagingStatus(dst, err)
	}
	c.stats.stagedTransfer(n, pinned.Load())
	return nil
}
