package main

/*
#include <stdlib.h>
#include <string.h>
#include "tensorrpc.h"
*/
import "C"

import (
	"context"
	"errors"
	"unsafe"

	"google.golang.org/grpc/codes"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// clientEntry is a Client the C side opened.
type clientEntry struct {
	c *rpc.Client
}

// stager allocates staging tensors for device tensors (ABI version 5) in
// the client's pool.
func (c *clientEntry) stager(ctx context.Context) newTensorFunc {
	return func(dtype zerocopy.DType, shape []int64) (*rpc.Tensor, error) {
		return c.c.NewTensor(ctx, dtype, shape)
	}
}

func getClient(h C.trpc_client) (*clientEntry, error) {
	c, ok := clients.get(uint64(h))
	if !ok {
		return nil, errorf(codes.FailedPrecondition, "client handle %d is closed or unknown", uint64(h))
	}
	return c, nil
}

// trpc_client_dial opens a session with the server at target ("host:port"),
// waiting up to timeout_ms (forever when negative) for it. The control
// connection is plaintext gRPC (insecure credentials): the shim has no TLS.
//
//export trpc_client_dial
func trpc_client_dial(target *C.char, opts *C.trpc_options, timeoutMs C.int64_t, out *C.trpc_client, errOut **C.char) C.int {
	if target == nil || out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL target or out"))
	}
	dopts, err := dialOptions(opts)
	if err != nil {
		return report(errOut, err)
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	c, err := rpc.Dial(ctx, C.GoString(target), dopts...)
	if err != nil {
		return report(errOut, err)
	}
	*out = C.trpc_client(clients.add(&clientEntry{c: c}))
	return 0
}

// trpc_client_close ends the session. Tensors received stay valid until
// deleted; *outstanding (if not NULL) is how many pool buffers are still
// live.
//
//export trpc_client_close
func trpc_client_close(h C.trpc_client, outstanding *C.int64_t, errOut **C.char) C.int {
	c, ok := clients.remove(uint64(h))
	if !ok {
		return report(errOut, errorf(codes.FailedPrecondition, "client handle %d is closed or unknown", uint64(h)))
	}
	err := c.c.Close()
	if errors.Is(err, mempool.ErrOutstanding) {
		err = nil
	}
	if outstanding != nil {
		*outstanding = C.int64_t(c.c.Pool().Stats().Allocs)
	}
	return report(errOut, err)
}

// trpc_client_transport stores the session's data plane ("shm", "tcp",
// "ibv" or "grpc") in *out, malloc'd.
//
//export trpc_client_transport
func trpc_client_transport(h C.trpc_client, out **C.char, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	*out = C.CString(c.c.Transport())
	return 0
}

// Flags of trpc_client_fetch and trpc_server_fetch, defined in
// tensorrpc.h.
const (
	// fetchLease (trpc_client_fetch) asks for a shared-memory lease of the
	// server's memory (no copy; must not be written) when the session uses
	// shm.
	fetchLease = C.TRPC_FETCH_LEASE
	// fetchTake (trpc_server_fetch) also unpublishes the key.
	fetchTake = C.TRPC_FETCH_TAKE
	// fetchWait waits until the key is published (rpc.WaitForKey) instead
	// of failing at once with NotFound.
	fetchWait = C.TRPC_FETCH_WAIT
)

// fetchOptions are the rpc options of the flags common to both fetches.
func fetchOptions(flags C.int) []rpc.FetchOption {
	if flags&fetchWait != 0 {
		return []rpc.FetchOption{rpc.WaitForKey()}
	}
	return nil
}

// trpc_client_fetch fetches the tensor published under key, taking up to
// timeout_ms (no limit when negative). flags: TRPC_FETCH_LEASE (1) = lease;
// TRPC_FETCH_WAIT (2) = wait for the key to be published; without it a key
// that is not published fails at once with NOT_FOUND.
//
//export trpc_client_fetch
func trpc_client_fetch(h C.trpc_client, key *C.char, flags C.int, timeoutMs C.int64_t, out **C.DLManagedTensor, errOut **C.char) C.int {
	c, err := fetchClient(h, key, out != nil, flags)
	if err != nil {
		return report(errOut, err)
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	opts := fetchOptions(flags)
	if flags&fetchLease != 0 {
		opts = append(opts, rpc.Lease())
	}
	t, err := c.c.Fetch(ctx, C.GoString(key), opts...)
	if err != nil {
		return report(errOut, err)
	}
	m, err := export(t, nil)
	if err != nil {
		return report(errOut, err)
	}
	*out = m
	return 0
}

// trpc_client_fetch_tensor is trpc_client_fetch without out-parameters
// (ABI version 7): the tensor, or NULL on failure, whose status code and
// message trpc_last_error returns on this thread.
//
//export trpc_client_fetch_tensor
func trpc_client_fetch_tensor(h C.trpc_client, key *C.char, flags C.int, timeoutMs C.int64_t) *C.DLManagedTensor {
	var m *C.DLManagedTensor
	var msg *C.char
	if code := trpc_client_fetch(h, key, flags, timeoutMs, &m, &msg); code != 0 {
		C.trpc_set_last_error(code, msg)
		return nil
	}
	return m
}

// trpc_client_send puts the caller's tensor into the server's rendezvous
// under key. The library reads the tensor's memory only until it returns:
// a tensor the shim handed out is sent from its pool memory; other memory
// is wrapped, not copied, and rpc grants it to the server in place where
// the data plane can read caller memory (tcp), revoking the grant before
// Send returns, or copies it into the pool once (shm, grpc).
//
//export trpc_client_send
func trpc_client_send(h C.trpc_client, key *C.char, dl *C.DLTensor, timeoutMs C.int64_t, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if key == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL key"))
	}
	if dl != nil && dl.device.device_type == dlCUDA {
		// ABI version 5: a CUDA tensor ready on the legacy default stream.
		return report(errOut, sendDevice(c, key, dl, timeoutMs))
	}
	t, done, err := input(dl, nil)
	if err != nil {
		return report(errOut, err)
	}
	defer done()
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	return report(errOut, c.c.Send(ctx, C.GoString(key), t))
}

// trpc_client_call calls method with metadata[0:metadata_len] and the n
// tensors of the array tensors. On success the reply's metadata is stored
// in *reply_metadata (malloc'd, NULL when empty) and *reply_metadata_len,
// and its tensors in *reply_tensors (a malloc'd array of *n_reply
// DLManagedTensor pointers, NULL when empty). Free the arrays with
// trpc_free and each tensor with its deleter.
//
//export trpc_client_call
func trpc_client_call(h C.trpc_client, method *C.char, metadata *C.uint8_t, metadataLen C.int64_t,
	tensors *C.DLTensor, n C.int64_t, timeoutMs C.int64_t,
	replyMetadata **C.uint8_t, replyMetadataLen *C.int64_t, replyTensors ***C.DLManagedTensor, nReply *C.int64_t,
	errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if method == nil || replyMetadata == nil || replyMetadataLen == nil || replyTensors == nil || nReply == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL method or reply pointer"))
	}
	if metadataLen < 0 || (metadataLen > 0 && metadata == nil) {
		return report(errOut, errorf(codes.InvalidArgument, "bad metadata (%d bytes)", int64(metadataLen)))
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	ts, done, err := inputs(tensors, n, c.stager(ctx))
	if err != nil {
		return report(errOut, err)
	}
	defer done()
	req := &rpc.Message{Tensors: ts}
	if metadataLen > 0 {
		req.Metadata = C.GoBytes(unsafe.Pointer(metadata), C.int(metadataLen))
	}
	reply, err := c.c.Call(ctx, C.GoString(method), req)
	if err != nil {
		return report(errOut, err)
	}
	arr, err := exportAll(reply.Tensors, nil)
	if err != nil {
		return report(errOut, err)
	}
	*replyMetadata, *replyMetadataLen = nil, 0
	if len(reply.Metadata) > 0 {
		*replyMetadata = (*C.uint8_t)(C.CBytes(reply.Metadata))
		*replyMetadataLen = C.int64_t(len(reply.Metadata))
	}
	*replyTensors, *nReply = arr, C.int64_t(len(reply.Tensors))
	return 0
}

// trpc_client_empty allocates an uninitialised tensor in the client's
// pool. Sending it costs no copy.
//
//export trpc_client_empty
func trpc_client_empty(h C.trpc_client, dtype C.DLDataType, ndim C.int32_t, shape *C.int64_t, out **C.DLManagedTensor, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	t, err := emptyTensor(dtype, ndim, shape, c.c.NewTensor)
	if err != nil {
		return report(errOut, err)
	}
	m, err := export(t, nil)
	if err != nil {
		return report(errOut, err)
	}
	*out = m
	return 0
}

// trpc_client_pool_stats stores the client pool's statistics in *out.
//
//export trpc_client_pool_stats
func trpc_client_pool_stats(h C.trpc_client, out *C.trpc_pool_stats, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	fillPoolStats(out, c.c.Pool().Stats())
	return 0
}

// trpc_client_stats stores the session's transfer statistics in *out.
//
//export trpc_client_stats
func trpc_client_stats(h C.trpc_client, out *C.trpc_stats, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	fillStats(out, c.c.Stats())
	return 0
}
