package rpc

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// ipcClientSession is a session's CUDA IPC state on the client: the GPUs
// both peers list, the server's handles it opened, and the releases under
// way.
type ipcClientSession struct {
	devices map[[16]byte]bool
	send    bool
	cache   *handleCache

	mu       sync.Mutex
	closed   bool
	pending  []uint64    // finished transfers not given back yet (releaseIPC)
	flush    *time.Timer // gives pending back; nil when none is due
	releases sync.WaitGroup
	stop     context.CancelFunc
	ctx      context.Context // of the releases; ends with the session
}

func newIPCClientSession(c *Client, devices map[[16]byte]bool, send bool) *ipcClientSession {
	ctx, stop := context.WithCancel(context.Background())
	return &ipcClientSession{devices: devices, send: send, cache: newHandleCache(c.opts.cuda), ctx: ctx, stop: stop}
}

// close closes the opened handles (those a copy still uses as it ends)
// and waits for the releases under way, which the session's end cuts
// short: the server releases what an ended session held.
func (x *ipcClientSession) close() {
	if x == nil {
		return
	}
	x.mu.Lock()
	x.closed = true
	if x.flush != nil && x.flush.Stop() {
		x.releases.Done() // the session's end releases them on the server
	}
	x.mu.Unlock()
	x.stop()
	x.releases.Wait()
	x.cache.close()
}

// ipcReleaseDelay is how long a finished CUDA IPC transfer waits to be
// given back, so that the transfers made close together are given back in
// one ReleaseDevice call, after them rather than beside the next one's
// request (a release per transfer, sent as the next transfer asked,
// cost that transfer 100-170 µs on a 2-core VM). The server keeps the
// tensor that long more. ipcReleaseBatch releases go at once.
const (
	ipcReleaseDelay = time.Millisecond
	ipcReleaseBatch = 64
)

// releaseIPC gives a transfer back to the server, without waiting for
// the answer: the next call need not wait for it.
func (c *Client) releaseIPC(s *clientSession, id uint64) {
	x := s.ipc
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return
	}
	x.pending = append(x.pending, id)
	if len(x.pending) >= ipcReleaseBatch {
		ids := x.pending
		x.pending = nil
		x.releases.Add(1)
		go func() {
			defer x.releases.Done()
			c.sendReleases(s, ids)
		}()
		return
	}
	if x.flush != nil {
		return // due already: it takes this one too
	}
	x.releases.Add(1)
	x.flush = time.AfterFunc(ipcReleaseDelay, func() {
		defer x.releases.Done()
		x.mu.Lock()
		ids := x.pending
		x.pending, x.flush = nil, nil
		x.mu.Unlock()
		c.sendReleases(s, ids)
	})
}

// sendReleases gives the transfers ids back to the server.
func (c *Client) sendReleases(s *clientSession, ids []uint64) {
	if len(ids) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(s.ipc.ctx, closeFlushTimeout)
	defer cancel()
	c.api.ReleaseDevice(ctx, &pb.ReleaseRequest{SessionId: s.id, TransferIds: ids})
}

// deviceUUID returns the UUID of the GPU buf lives on, when it exports IPC
// handles on a GPU the session shares.
func (x *ipcClientSession) exportable(buf gpudirect.DeviceBuffer) (gpudirect.IPCHandle, bool) {
	e, ok := buf.(gpudirect.IPCExporter)
	if !ok {
		return gpudirect.IPCHandle{}, false
	}
	h, err := e.IPCHandle()
	if err != nil || !x.devices[h.UUID] {
		return gpudirect.IPCHandle{}, false
	}
	return h, true
}

// ipcDecision is the Decision of a transfer over CUDA IPC.
var ipcDecision = gpudirect.Decision{Path: gpudirect.IPC, Reason: "CUDA IPC: copied device to device between two processes of one host"}

// sendDeviceIPC is SendDevice over CUDA IPC when the session negotiated
// it; ok false: send staged or direct instead.
func (c *Client) sendDeviceIPC(ctx context.Context, s *clientSession, key string, t DeviceTensor, n int) (gpudirect.Decision, bool, error) {
	if s.ipc == nil || !s.ipc.send {
		return gpudirect.Decision{}, false, nil
	}
	ok, err := c.sendIPC(ctx, s, key, t, n)
	return ipcDecision, ok, err
}

// fetchIPC is a device fetch over CUDA IPC when the session negotiated
// it. ok is false when the tensor must be fetched staged instead: the
// destination cannot take a device copy (not a gpudirect.AsyncBuffer), or
// the key holds a host tensor (or one the server cannot export to this
// client).
func (c *Client) fetchIPC(ctx context.Context, s *clientSession, key string, dst *deviceDst) (t DeviceTensor, ok bool, err error) {
	x := s.ipc
	if x == nil {
		return DeviceTensor{}, false, nil
	}
	if _, async := dst.buf.(gpudirect.AsyncBuffer); dst.alloc == nil && !async {
		return DeviceTensor{}, false, nil
	}
	var resp *pb.FetchDeviceResponse
	staged := false
	err = c.intercept(ctx, s, OpFetch, key, 0, func(ctx context.Context, info *CallInfo) error {
		var err error
		resp, err = c.api.FetchDevice(withAddedMetadata(ctx), &pb.FetchRequest{SessionId: s.id, Key: key})
		if err != nil {
			return sessionError(s, err)
		}
		x.cache.drop(resp.Gone)
		if resp.Host {
			staged = true
			return nil
		}
		release := func() {
			if resp.TransferId != 0 {
				c.releaseIPC(s, resp.TransferId)
			}
		}
		defer release()
		if err := checkMeta(resp.Meta, c.opts.maxTensorBytes); err != nil {
			return err
		}
		dtype, shape := shapeOf(resp.Meta)
		n := int(resp.Meta.ByteLength)
		buf, off, err := dst.get(dtype, shape, n)
		if err != nil {
			return err
		}
		if _, async := buf.(gpudirect.AsyncBuffer); buf != nil && !async {
			staged = true // the buffer alloc made copies synchronously only
			return nil
		}
		t = DeviceTensor{DType: dtype, Shape: append([]int64(nil), shape...), Buffer: buf, Offset: off}
		info.setResponse(int64(n))
		return c.copyIPC(ctx, x, resp, buf, off)
	})
	if err != nil {
		return DeviceTensor{}, true, err
	}
	if staged {
		return DeviceTensor{}, false, nil
	}
	return t, true, nil
}

// copyIPC copies the tensor resp names into dst at offset, which holds
// it.
func (c *Client) copyIPC(ctx context.Context, x *ipcClientSession, resp *pb.FetchDeviceResponse, dst gpudirect.DeviceBuffer, offset int) error {
	n := int(resp.Meta.ByteLength)
	if n == 0 {
		return nil
	}
	h, err := checkHandle(resp.Handle, n, x.devices)
	if err != nil {
		return status.Errorf(codes.Internal, "tensorrpc: the server's answer: %s", status.Convert(err).Message())
	}
	src, err := x.cache.acquire(h, resp.Handle.Allocation, int(h.Offset)+n)
	if err != nil {
		return ipcCopyError("opening the server's handle", err)
	}
	defer x.cache.release(src)
	if err := x.cache.copy(ctx, dst, offset, src.buf, int(h.Offset), n); err != nil {
		return ipcCopyError("copying from the server's device", err)
	}
	c.stats.ipc.Add(1)
	return nil
}

// sendIPC is SendDevice over CUDA IPC: the server copies the tensor out
// of t.Buffer before it answers. ok is false when the buffer exports no
// handle on a GPU the session shares (then it is sent staged).
func (c *Client) sendIPC(ctx context.Context, s *clientSession, key string, t DeviceTensor, n int) (ok bool, err error) {
	h, ok := s.ipc.exportable(t.Buffer)
	if !ok && n > 0 {
		return false, nil
	}
	meta := &pb.TensorMeta{Key: key, Dtype: pb.DType(t.DType), Shape: append([]int64(nil), t.Shape...), ByteLength: uint64(n)}
	req := &pb.SendDeviceRequest{SessionId: s.id, Meta: meta}
	if n > 0 {
		req.Handle = &pb.DeviceHandle{
			Handle: h.Handle[:], Offset: uint64(h.Offset) + uint64(t.Offset), Length: uint64(n), DeviceUuid: h.UUID[:],
		}
	}
	err = c.intercept(ctx, s, OpSend, key, int64(n), func(ctx context.Context, _ *CallInfo) error {
		if _, err := c.api.SendDevice(withAddedMetadata(ctx), req); err != nil {
			return sessionError(s, err)
		}
		return nil
	})
	if err == nil && n > 0 {
		c.stats.ipc.Add(1)
	}
	return true, err
}
