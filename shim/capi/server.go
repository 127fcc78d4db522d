package main

/*
#include <stdlib.h>
#include "tensorrpc.h"
*/
import "C"

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"unsafe"

	"google.golang.org/grpc/codes"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// serverEntry is a Server the C side opened, serving on its own listener.
type serverEntry struct {
	srv    *rpc.Server
	lis    net.Listener
	served chan struct{} // closed when Serve returns
	dupSeq atomic.Uint64
	cuda   bool // made with a CUDA driver (rpc.WithCUDA): CUDA tensors are published in place

	mu       sync.Mutex
	closed   bool
	inflight sync.WaitGroup // handlers running C code
}

// enter registers a handler invocation; it fails once the server closes,
// so that no C function pointer is called after trpc_server_close returns.
func (s *serverEntry) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.inflight.Add(1)
	return true
}

// dup returns a new reference to t, a tensor in the server's pool, as a
// tensor of its own. rpc has no Retain for tensors, but publishing a pool
// tensor takes a reference to its buffer (no copy), and Take hands that
// reference over.
func (s *serverEntry) dup(t *rpc.Tensor) (*rpc.Tensor, error) {
	key := fmt.Sprintf("\x00tensorrpc-shim/dup/%d", s.dupSeq.Add(1))
	if err := s.srv.Publish(context.Background(), key, t); err != nil {
		return nil, err
	}
	return s.srv.Take(context.Background(), key)
}

// stager allocates staging tensors for device tensors in the server's
// pool.
func (s *serverEntry) stager(ctx context.Context) newTensorFunc {
	return func(dtype zerocopy.DType, shape []int64) (*rpc.Tensor, error) {
		return s.srv.NewTensor(ctx, dtype, shape)
	}
}

func getServer(h C.trpc_server) (*serverEntry, error) {
	s, ok := servers.get(uint64(h))
	if !ok {
		return nil, errorf(codes.FailedPrecondition, "server handle %d is closed or unknown", uint64(h))
	}
	return s, nil
}

// trpc_server_new makes a server listening on listen ("host:port"; NULL or
// "" means "127.0.0.1:0") and serving in the background.
//
//export trpc_server_new
func trpc_server_new(listen *C.char, opts *C.trpc_options, out *C.trpc_server, errOut **C.char) C.int {
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	sopts, err := serverOptions(opts)
	if err != nil {
		return report(errOut, err)
	}
	addr := "127.0.0.1:0"
	if listen != nil && C.GoString(listen) != "" {
		addr = C.GoString(listen)
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return report(errOut, errorf(codes.InvalidArgument, "listening on %s: %v", addr, err))
	}
	srv, err := rpc.NewServer(sopts...)
	if err != nil {
		lis.Close()
		return report(errOut, err)
	}
	s := &serverEntry{srv: srv, lis: lis, served: make(chan struct{}), cuda: sessionCUDA() != nil}
	go func() {
		defer close(s.served)
		srv.Serve(lis)
	}()
	*out = C.trpc_server(servers.add(s))
	return 0
}

// trpc_server_address stores the server's listening address ("host:port")
// in *out, malloc'd.
//
//export trpc_server_address
func trpc_server_address(h C.trpc_server, out **C.char, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	*out = C.CString(s.lis.Addr().String())
	return 0
}

// trpc_server_close stops the server: sessions end, calls under way fail,
// and no handler runs after it returns. Tensors handed out stay valid until
// deleted; *outstanding (if not NULL) is how many pool buffers are still
// live.
//
//export trpc_server_close
func trpc_server_close(h C.trpc_server, outstanding *C.int64_t, errOut **C.char) C.int {
	s, ok := servers.remove(uint64(h))
	if !ok {
		return report(errOut, errorf(codes.FailedPrecondition, "server handle %d is closed or unknown", uint64(h)))
	}
	s.srv.Stop()
	<-s.served
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.inflight.Wait()
	if outstanding != nil {
		*outstanding = C.int64_t(s.srv.Pool().Stats().Allocs)
	}
	return 0
}

// trpc_server_publish publishes a copy of the caller's tensor under key (no
// copy when it is a tensor this server handed out).
//
//export trpc_server_publish
func trpc_server_publish(h C.trpc_server, key *C.char, dl *C.DLTensor, errOut **C.char) C.int {
	return trpc_server_publish_flags(h, key, dl, 0, errOut)
}

// publishWritable (TRPC_PUBLISH_WRITABLE) lets clients write rows of the
// published tensor (rpc.Writable).
const publishWritable = C.TRPC_PUBLISH_WRITABLE

// trpc_server_publish_flags is trpc_server_publish with flags:
// TRPC_PUBLISH_WRITABLE (1) lets clients write rows of the tensor
// (trpc_client_send_rows); it must have at least one dimension. Writes land
// in the published pool memory: a tensor this server handed out
// (trpc_server_empty, trpc_server_fetch) is published without a copy, so
// its holder sees them. Added in ABI version 4.
//
//export trpc_server_publish_flags
func trpc_server_publish_flags(h C.trpc_server, key *C.char, dl *C.DLTensor, flags C.int, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if key == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL key"))
	}
	if flags&^publishWritable != 0 {
		return report(errOut, errorf(codes.InvalidArgument, "unknown publish flags %#x", int(flags)))
	}
	var opts []rpc.PublishOption
	if flags&publishWritable != 0 {
		opts = append(opts, rpc.Writable())
	}
	t, done, err := input(dl, s.stager(context.Background()))
	if err != nil {
		return report(errOut, err)
	}
	defer done()
	return report(errOut, s.srv.Publish(context.Background(), C.GoString(key), t, opts...))
}

// trpc_server_publish_device publishes the caller's tensor under key and
// hands the library its owner: release(owner) is called exactly once,
// from any thread, when the library no longer reads the tensor's memory
// (also when this call fails; release may be NULL). A kDLCUDA tensor on a
// server made with a CUDA driver (one the library loads without cost: see
// trpc_client_fetch_device) is published in place on its device, not
// copied: clients in other processes of the same host fetch it over CUDA
// IPC (device to device), others (this process's too) and
// trpc_server_fetch get it staged out of it; release
// is called once the publish ends (the key replaced, unpublished or
// taken, the server closed) and no client copies it any more. The caller
// must not write the tensor while it is published, as with PyTorch's own
// CUDA IPC. Other tensors (CPU, 0 bytes, a server without CUDA) are
// published as trpc_server_publish_flags publishes them, and release is
// called before it returns. flags: TRPC_PUBLISH_WRITABLE (a CUDA tensor
// is then staged into the pool, as trpc_server_publish_flags does). Added
// in ABI version 6.
//
//export trpc_server_publish_device
func trpc_server_publish_device(h C.trpc_server, key *C.char, dl *C.DLTensor, release C.trpc_release_fn, owner unsafe.Pointer, flags C.int, errOut **C.char) C.int {
	released := func() { C.trpc_call_release(release, owner) }
	s, err := getServer(h)
	if err != nil {
		released()
		return report(errOut, err)
	}
	if key == nil || dl == nil || dl.device.device_type != dlCUDA || !s.cuda || flags != 0 {
		rc := trpc_server_publish_flags(h, key, dl, flags, errOut)
		released()
		return rc
	}
	in, err := openDevice(dl)
	if err != nil {
		released()
		return report(errOut, err)
	}
	if in.n == 0 {
		in.done()
		rc := trpc_server_publish_flags(h, key, dl, flags, errOut)
		released()
		return rc
	}
	done := in.done
	err = s.srv.PublishDeviceInPlace(context.Background(), C.GoString(key), in.t, rpc.Released(func() {
		done()
		released()
	}))
	return report(errOut, err)
}

// trpc_server_unpublish removes key; it returns 1 when key was published.
//
//export trpc_server_unpublish
func trpc_server_unpublish(h C.trpc_server, key *C.char) C.int {
	s, err := getServer(h)
	if err != nil || key == nil {
		return 0
	}
	if s.srv.Unpublish(C.GoString(key)) {
		return 1
	}
	return 0
}

// trpc_server_fetch returns the tensor published under key (by this side or
// a client's send), taking up to timeout_ms (no limit when negative).
// flags: TRPC_FETCH_TAKE (1) also unpublishes the key (this argument was a
// boolean `take` before TRPC_FETCH_WAIT existed; 0 and 1 keep their
// meaning); TRPC_FETCH_WAIT (2) waits for the key to be published; without
// it a key that is not published fails at once with NOT_FOUND.
//
//export trpc_server_fetch
func trpc_server_fetch(h C.trpc_server, key *C.char, flags C.int, timeoutMs C.int64_t, out **C.DLManagedTensor, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if key == nil || out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL key or out"))
	}
	if flags&^(fetchTake|fetchWait) != 0 {
		return report(errOut, errorf(codes.InvalidArgument, "unknown fetch flags %#x", int(flags)))
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	var t *rpc.Tensor
	if flags&fetchTake != 0 {
		t, err = s.srv.Take(ctx, C.GoString(key), fetchOptions(flags)...)
	} else {
		t, err = s.srv.Fetch(ctx, C.GoString(key), fetchOptions(flags)...)
	}
	if err != nil {
		return report(errOut, err)
	}
	m, err := export(t, s)
	if err != nil {
		return report(errOut, err)
	}
	*out = m
	return 0
}

// trpc_server_empty allocates an uninitialised tensor in the server's pool.
// Publishing it or returning it from a handler costs no copy.
//
//export trpc_server_empty
func trpc_server_empty(h C.trpc_server, dtype C.DLDataType, ndim C.int32_t, shape *C.int64_t, out **C.DLManagedTensor, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	t, err := emptyTensor(dtype, ndim, shape, s.srv.NewTensor)
	if err != nil {
		return report(errOut, err)
	}
	m, err := export(t, s)
	if err != nil {
		return report(errOut, err)
	}
	*out = m
	return 0
}

// emptyTensor checks the arguments of trpc_*_empty and allocates with
// alloc, failing at once when the pool is full.
func emptyTensor(dtype C.DLDataType, ndim C.int32_t, shape *C.int64_t,
	alloc func(context.Context, zerocopy.DType, []int64) (*rpc.Tensor, error)) (*rpc.Tensor, error) {
	dt, err := zerocopy.DTypeFromDLPack(uint8(dtype.code), uint8(dtype.bits), uint16(dtype.lanes))
	if err != nil {
		return nil, errorf(codes.InvalidArgument, "unsupported dtype: %v", err)
	}
	sh, err := shapeOf(ndim, shape)
	if err != nil {
		return nil, err
	}
	if _, err := zerocopy.ByteSize(dt, sh); err != nil {
		return nil, errorf(codes.InvalidArgument, "%v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a full pool fails at once instead of waiting
	t, err := alloc(ctx, dt, sh)
	if codeOf(err) == codes.Canceled {
		err = errorf(codes.ResourceExhausted, "the pool is full")
	}
	return t, err
}

// trpc_server_handle registers fn for method. fn is called with user_data
// on tensorrpc threads until trpc_server_close returns.
//
//export trpc_server_handle
func trpc_server_handle(h C.trpc_server, method *C.char, fn C.trpc_handler_fn, userData unsafe.Pointer, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if method == nil || fn == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL method or handler"))
	}
	name := C.GoString(method)
	s.srv.Handle(name, s.handler(name, fn, userData))
	return 0
}

// trpc_server_pool_stats stores the server pool's statistics in *out.
//
//export trpc_server_pool_stats
func trpc_server_pool_stats(h C.trpc_server, out *C.trpc_pool_stats, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	fillPoolStats(out, s.srv.Pool().Stats())
	return 0
}

// trpc_server_stats stores the server's transfer statistics (over every
// session) in *out.
//
//export trpc_server_stats
func trpc_server_stats(h C.trpc_server, out *C.trpc_stats, errOut **C.char) C.int {
	s, err := getServer(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	fillStats(out, s.srv.Stats())
	return 0
}
