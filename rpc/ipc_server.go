package rpc

import (
	"context"
	"math"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rendezvous"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// maxIPCTransfers bounds the FetchDevice transfers one session may leave
// unreleased.
const maxIPCTransfers = 1024

// ipcServer holds a Server's tensors published on a device
// (PublishDeviceInPlace, and those clients sent over CUDA IPC), beside
// the rendezvous of host tensors: a key's newest publish, host or device,
// is what a Fetch of it gets. It is safe for concurrent use.
type ipcServer struct {
	mu      sync.Mutex
	entries map[string]*deviceEntry
	exports map[[64]byte]*ipcExport // by handle bytes
	lastID  uint64
}

// deviceEntry is one tensor in device memory, referenced by the
// rendezvous while published and by each transfer reading it.
type deviceEntry struct {
	dtype  zerocopy.DType
	shape  []int64
	buf    gpudirect.DeviceBuffer
	offset int
	n      int
	seq    uint64
	// handle names the tensor's allocation, its Offset the tensor's first
	// byte in it; exp is nil when buf exports no IPC handle.
	handle gpudirect.IPCHandle
	exp    *ipcExport
	owned  bool // the server allocated buf: freed with the last reference
	// released, when set, is called with the last reference
	// (PublishDeviceInPlace's Released).
	released func()
	refs     int           // under ipcServer.mu
	done     chan struct{} // closed when refs reach 0
}

// ipcExport is one allocation exported to sessions, named by an id for as
// long as a published tensor or a transfer uses it. When none does, the
// sessions that received it are told (FetchDeviceResponse.gone), and an
// export of the same handle later gets a new id: a client never serves a
// handle it opened for a freed allocation.
type ipcExport struct {
	key      [64]byte
	id       uint64
	refs     int
	sessions map[*ipcServerSession]struct{}
}

// put publishes e under key (e.refs 1) and returns the entry it replaces,
// whose reference the caller drops.
func (r *ipcServer) put(key string, e *deviceEntry) *deviceEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.entries == nil {
		r.entries, r.exports = map[string]*deviceEntry{}, map[[64]byte]*ipcExport{}
	}
	e.refs, e.done = 1, make(chan struct{})
	if e.exp != nil {
		x := r.exports[e.handle.Handle]
		if x == nil {
			r.lastID++
			x = &ipcExport{key: e.handle.Handle, id: r.lastID, sessions: map[*ipcServerSession]struct{}{}}
			r.exports[x.key] = x
		}
		x.refs++
		e.exp = x
	}
	old := r.entries[key]
	if old != nil && old.seq > e.seq {
		r.entries[key] = old // a later publish is in place
		return e
	}
	r.entries[key] = e
	return old
}

// acquire returns key's entry with a reference, or nil.
func (r *ipcServer) acquire(key string) *deviceEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.entries[key]
	if e != nil {
		e.refs++
	}
	return e
}

// remove unpublishes key and returns its entry, whose reference the
// caller drops.
func (r *ipcServer) remove(key string) *deviceEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.entries[key]
	delete(r.entries, key)
	return e
}

// supersede unpublishes key's device tensor when a host tensor numbered
// seq replaced it, and returns it for the caller to drop its reference.
func (r *ipcServer) supersede(key string, seq uint64) *deviceEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.entries[key]
	if e == nil || e.seq > seq {
		return nil
	}
	delete(r.entries, key)
	return e
}

// removeAll unpublishes every key (Server.Close).
func (r *ipcServer) removeAll() []*deviceEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	var es []*deviceEntry
	for k, e := range r.entries {
		es = append(es, e)
		delete(r.entries, k)
	}
	return es
}

// unref drops one reference to e: the last frees a buffer the server
// owns, ends the export of its allocation when no other entry uses it
// and wakes UnpublishDevice.
func (r *ipcServer) unref(e *deviceEntry) {
	if e == nil {
		return
	}
	r.mu.Lock()
	e.refs--
	last := e.refs == 0
	if last && e.exp != nil {
		x := e.exp
		x.refs--
		if x.refs == 0 {
			if r.exports[x.key] == x {
				delete(r.exports, x.key)
			}
			for ss := range x.sessions {
				ss.addGone(x.id)
			}
		}
	}
	r.mu.Unlock()
	if last {
		if e.owned {
			e.buf.Free()
		}
		if e.released != nil {
			e.released()
		}
		close(e.done)
	}
}

// given records that ss received a handle of e's allocation.
func (r *ipcServer) given(e *deviceEntry, ss *ipcServerSession) {
	r.mu.Lock()
	e.exp.sessions[ss] = struct{}{}
	r.mu.Unlock()
}

// forget removes ss from every export (its session ended).
func (r *ipcServer) forget(ss *ipcServerSession) {
	r.mu.Lock()
	for _, x := range r.exports {
		delete(x.sessions, ss)
	}
	r.mu.Unlock()
}

// ipcServerSession is a session's CUDA IPC state on the server.
type ipcServerSession struct {
	devices map[[16]byte]bool // the GPUs both peers list
	send    bool              // SendDevice is served

	mu        sync.Mutex
	transfers map[uint64]*deviceEntry
	lastID    uint64
	gone      []uint64
	closed    bool
	opened    *handleCache // the client's handles (SendDevice)
}

func newIPCServerSession(devices map[[16]byte]bool, send bool) *ipcServerSession {
	return &ipcServerSession{devices: devices, send: send, transfers: map[uint64]*deviceEntry{}}
}

func (x *ipcServerSession) addGone(id uint64) {
	x.mu.Lock()
	if !x.closed {
		x.gone = append(x.gone, id)
	}
	x.mu.Unlock()
}

func (x *ipcServerSession) takeGone() []uint64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	g := x.gone
	x.gone = nil
	return g
}

// hold keeps e's reference for a transfer until the client releases it.
func (x *ipcServerSession) hold(e *deviceEntry) (uint64, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	switch {
	case x.closed:
		return 0, status.Error(codes.Unavailable, "tensorrpc: session ended")
	case len(x.transfers) >= maxIPCTransfers:
		return 0, status.Errorf(codes.ResourceExhausted, "tensorrpc: %d CUDA IPC transfers unreleased, the most a session may hold", len(x.transfers))
	}
	x.lastID++
	x.transfers[x.lastID] = e
	return x.lastID, nil
}

// release returns the entries of the transfers ids names.
func (x *ipcServerSession) release(ids []uint64) []*deviceEntry {
	x.mu.Lock()
	defer x.mu.Unlock()
	var es []*deviceEntry
	for _, id := range ids {
		if e, ok := x.transfers[id]; ok {
			es = append(es, e)
			delete(x.transfers, id)
		}
	}
	return es
}

// end releases what the session holds and closes the handles it opened.
func (s *Server) endIPC(ss *serverSession) {
	x := ss.ipc
	if x == nil {
		return
	}
	x.mu.Lock()
	x.closed = true
	held := x.transfers
	x.transfers = map[uint64]*deviceEntry{}
	opened := x.opened
	x.mu.Unlock()
	for _, e := range held {
		s.ipc.unref(e)
	}
	s.ipc.forget(x)
	if opened != nil {
		opened.close()
	}
}

// handles returns the session's cache of opened client handles.
func (x *ipcServerSession) handles(drv ipcDriver) *handleCache {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.opened == nil {
		x.opened = newHandleCache(drv)
		if x.closed {
			x.opened.close()
		}
	}
	return x.opened
}

// PublishDeviceInPlace publishes a device tensor under key without
// copying it: the Server keeps a reference to t.Buffer, clients on the
// same host fetch it over CUDA IPC (FetchToDevice, device to device), and
// others, or host Fetches, get it staged out (one device-to-host copy per
// fetch). Replacing the key, Unpublish or UnpublishDevice end the
// publish.
//
// The buffer stays the caller's: it must not be freed or written while
// published, nor until UnpublishDevice returns (clients may still be
// copying it). Buffers that export IPC handles (gpudirect.IPCExporter)
// are fetched over CUDA IPC; others are always staged.
//
// Options: Released hands the buffer over until the publish ends;
// Writable is refused (clients cannot write rows of a device tensor).
//
// Experimental.
func (s *Server) PublishDeviceInPlace(ctx context.Context, key string, t DeviceTensor, opts ...PublishOption) error {
	var po publishOptions
	for _, o := range opts {
		o(&po)
	}
	fail := func(err error) error {
		if po.released != nil {
			po.released()
		}
		return err
	}
	if po.writable {
		return fail(status.Error(codes.InvalidArgument, "tensorrpc: a device tensor cannot be published writable"))
	}
	n, err := deviceBytes(t)
	if err != nil {
		return fail(err)
	}
	e := &deviceEntry{dtype: t.DType, shape: append([]int64(nil), t.Shape...), buf: t.Buffer, offset: t.Offset, n: n, released: po.released}
	if err := exportEntry(e); err != nil {
		return fail(err)
	}
	s.publishDevice(key, e)
	return nil
}

// exportEntry sets e's handle when its buffer exports one.
func exportEntry(e *deviceEntry) error {
	x, ok := e.buf.(gpudirect.IPCExporter)
	if !ok || e.n == 0 {
		return nil
	}
	h, err := x.IPCHandle()
	if err != nil {
		return nil // not exportable: fetched staged
	}
	if h.Offset < 0 || h.Offset > math.MaxInt64-int64(e.offset) {
		return status.Errorf(codes.Internal, "tensorrpc: %s exports an IPC handle at offset %d", e.buf.Device(), h.Offset)
	}
	h.Offset += int64(e.offset)
	h.Len = int64(e.n)
	e.handle, e.exp = h, &ipcExport{}
	return nil
}

// publishDevice puts e under key, ordered among the key's publishes.
func (s *Server) publishDevice(key string, e *deviceEntry) {
	if e.seq == 0 {
		e.seq = s.rv.NextSeq()
	}
	s.rv.Remove(key)
	s.ipc.unref(s.ipc.put(key, e))
}

// UnpublishDevice removes key, like Unpublish, and when it held a device
// tensor waits until no client is copying it any more (or ctx ends): the
// buffer of PublishDeviceInPlace is then the caller's to free or reuse.
// It reports whether key was published.
func (s *Server) UnpublishDevice(ctx context.Context, key string) (bool, error) {
	removed := s.rv.Remove(key)
	e := s.ipc.remove(key)
	if e == nil {
		return removed, nil
	}
	done := e.done
	s.ipc.unref(e)
	select {
	case <-done:
		return true, nil
	case <-ctx.Done():
		return true, status.FromContextError(ctx.Err()).Err()
	}
}

// stagedDevice is a host Fetch of key when its newest publish is a device
// tensor: staged out into the pool (ok), else ok false and the rendezvous
// answers.
func (s *Server) stagedDevice(ctx context.Context, key string) (rendezvous.Entry, bool, error) {
	e := s.ipc.acquire(key)
	if e == nil {
		return rendezvous.Entry{}, false, nil
	}
	defer s.ipc.unref(e)
	if host, err := s.rv.TryFetch(key); err == nil {
		newer := host.Seq > e.seq
		host.Buf.Release()
		if newer {
			return rendezvous.Entry{}, false, nil
		}
	}
	buf, err := gpudirect.StageOut(ctx, s.pool, e.buf, e.offset, e.n)
	if err != nil {
		return rendezvous.Entry{}, true, status.Errorf(codes.Internal, "tensorrpc: staging %s: %v", e.buf.Device(), err)
	}
	t, err := newPoolTensor(e.dtype, e.shape, buf)
	if err != nil {
		return rendezvous.Entry{}, true, status.Error(codes.Internal, err.Error())
	}
	s.total.staged.Add(1)
	return rendezvous.Entry{Tensor: t.Tensor, Buf: t.buf, Seq: e.seq}, true, nil
}

// FetchDevice implements the FetchDevice method (CUDA IPC).
func (s service) FetchDevice(ctx context.Context, req *pb.FetchRequest) (*pb.FetchDeviceResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	if ss == nil || ss.ipc == nil {
		return nil, status.Error(codes.FailedPrecondition, "tensorrpc: FetchDevice needs a session that negotiated CUDA IPC")
	}
	var resp *pb.FetchDeviceResponse
	err = s.intercept(ctx, ss, OpFetch, req.Key, PathUnary, 0, func(ctx context.Context, info *CallInfo) error {
		var err error
		resp, err = s.fetchDevice(ss, req.Key)
		info.setResponse(int64(resp.GetMeta().GetByteLength()))
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

func (s *Server) fetchDevice(ss *serverSession, key string) (*pb.FetchDeviceResponse, error) {
	// Gone ids go out in answers only: an error would lose them.
	host := func() *pb.FetchDeviceResponse { return &pb.FetchDeviceResponse{Host: true, Gone: ss.ipc.takeGone()} }
	e := s.ipc.acquire(key)
	if h, err := s.rv.TryFetch(key); err == nil {
		newer := e == nil || h.Seq > e.seq
		h.Buf.Release()
		if newer {
			s.ipc.unref(e)
			return host(), nil
		}
	} else if e == nil {
		return nil, rendezvousError(key, err)
	}
	meta := &pb.TensorMeta{Key: key, Dtype: pb.DType(e.dtype), Shape: e.shape, ByteLength: uint64(e.n)}
	if e.n == 0 {
		s.ipc.unref(e)
		return &pb.FetchDeviceResponse{Meta: meta, Gone: ss.ipc.takeGone()}, nil
	}
	if e.exp == nil || !ss.ipc.devices[e.handle.UUID] {
		s.ipc.unref(e) // not exportable, or on a GPU the client lacks
		return host(), nil
	}
	id, err := ss.ipc.hold(e)
	if err != nil {
		s.ipc.unref(e)
		return nil, err
	}
	s.ipc.given(e, ss.ipc)
	ss.stats.ipc.Add(1)
	return &pb.FetchDeviceResponse{
		Meta: meta, TransferId: id, Gone: ss.ipc.takeGone(),
		Handle: &pb.DeviceHandle{
			Handle: e.handle.Handle[:], Offset: uint64(e.handle.Offset), Length: uint64(e.n),
			DeviceUuid: e.handle.UUID[:], Allocation: e.exp.id,
		},
	}, nil
}

// ReleaseDevice implements the ReleaseDevice method.
func (s service) ReleaseDevice(ctx context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	if ss == nil {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: ReleaseDevice needs a session")
	}
	if ss.ipc != nil {
		for _, e := range ss.ipc.release(req.TransferIds) {
			s.ipc.unref(e)
		}
	}
	return &pb.ReleaseResponse{}, nil
}

// SendDevice implements the SendDevice method (CUDA IPC).
func (s service) SendDevice(ctx context.Context, req *pb.SendDeviceRequest) (*pb.SendResponse, error) {
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return nil, err
	}
	if ss == nil || ss.ipc == nil || !ss.ipc.send {
		return nil, status.Error(codes.FailedPrecondition, "tensorrpc: SendDevice needs a session that negotiated CUDA IPC sends")
	}
	err = s.intercept(ctx, ss, OpSend, req.GetMeta().GetKey(), PathUnary, int64(req.GetMeta().GetByteLength()), func(ctx context.Context, _ *CallInfo) error {
		return s.sendDevice(ctx, ss, req)
	})
	if err != nil {
		return nil, err
	}
	return &pb.SendResponse{}, nil
}

func (s *Server) sendDevice(ctx context.Context, ss *serverSession, req *pb.SendDeviceRequest) error {
	m := req.Meta
	if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
		return err
	}
	if m.Location != nil {
		return status.Error(codes.InvalidArgument, "tensorrpc: SendDevice with a location")
	}
	n := int(m.ByteLength)
	dtype, shape := shapeOf(m)
	if n == 0 {
		t, err := s.NewTensor(ctx, dtype, shape)
		if err != nil {
			return err
		}
		return s.send(m.Key, t, 0)
	}
	h, err := checkHandle(req.Handle, n, ss.ipc.devices)
	if err != nil {
		return err
	}
	seq := s.rv.NextSeq()
	dst, err := s.opts.deviceAlloc.Alloc(n)
	if err != nil {
		return status.Errorf(codes.ResourceExhausted, "tensorrpc: device memory for %q (%d bytes): %v", m.Key, n, err)
	}
	e := &deviceEntry{dtype: dtype, shape: append([]int64(nil), shape...), buf: dst, n: n, seq: seq, owned: true}
	if err := s.copyFromPeer(ctx, ss.ipc, dst, h, n); err != nil {
		dst.Free()
		return err
	}
	if err := exportEntry(e); err != nil {
		dst.Free()
		return err
	}
	s.publishDevice(m.Key, e)
	ss.stats.ipc.Add(1)
	return nil
}

// copyFromPeer copies n bytes from the client's memory h names into dst.
func (s *Server) copyFromPeer(ctx context.Context, x *ipcServerSession, dst gpudirect.DeviceBuffer, h gpudirect.IPCHandle, n int) error {
	cache := x.handles(s.opts.cuda)
	src, err := cache.acquire(h, 0, int(h.Offset)+n)
	if err != nil {
		return ipcCopyError("opening the client's handle", err)
	}
	defer cache.release(src)
	if err := cache.copy(ctx, dst, 0, src.buf, int(h.Offset), n); err != nil {
		return ipcCopyError("copying from the client's device", err)
	}
	return nil
}

// checkHandle validates a peer's DeviceHandle for a tensor of n bytes
// (n > 0) on the session's devices.
func checkHandle(d *pb.DeviceHandle, n int, devices map[[16]byte]bool) (gpudirect.IPCHandle, error) {
	var h gpudirect.IPCHandle
	switch {
	case d == nil:
		return h, status.Error(codes.InvalidArgument, "tensorrpc: a device tensor without a handle")
	case len(d.Handle) != len(h.Handle):
		return h, status.Errorf(codes.InvalidArgument, "tensorrpc: an IPC handle of %d bytes, not %d", len(d.Handle), len(h.Handle))
	case len(d.DeviceUuid) != len(h.UUID):
		return h, status.Errorf(codes.InvalidArgument, "tensorrpc: a device UUID of %d bytes, not %d", len(d.DeviceUuid), len(h.UUID))
	case d.Length != uint64(n):
		return h, status.Errorf(codes.InvalidArgument, "tensorrpc: the handle covers %d bytes, the tensor has %d", d.Length, n)
	case d.Offset > uint64(math.MaxInt-n):
		return h, status.Errorf(codes.InvalidArgument, "tensorrpc: the handle's offset %d is out of range", d.Offset)
	}
	copy(h.Handle[:], d.Handle)
	copy(h.UUID[:], d.DeviceUuid)
	if !devices[h.UUID] {
		return h, status.Errorf(codes.InvalidArgument, "tensorrpc: the handle names device %s, which the session did not negotiate", uuidText(h.UUID))
	}
	h.Offset, h.Len = int64(d.Offset), int64(n)
	return h, nil
}
