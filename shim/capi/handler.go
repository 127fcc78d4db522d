package main

/*
#include <stdlib.h>
#include "tensorrpc.h"
*/
import "C"

import (
	"context"
	"sync"
	"unsafe"

	"google.golang.org/grpc/codes"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// replyEntry collects what a C handler replies while it runs.
type replyEntry struct {
	server *serverEntry
	ctx    context.Context

	mu      sync.Mutex
	done    bool
	meta    []byte
	tensors []*rpc.Tensor
	errMsg  string
	details string
}

func getReply(h C.trpc_reply) (*replyEntry, error) {
	r, ok := replies.get(uint64(h))
	if !ok {
		return nil, errorf(codes.FailedPrecondition, "reply handle %d is unknown or its handler has returned", uint64(h))
	}
	return r, nil
}

// handler adapts the C handler fn to an rpc.Handler. The request tensors
// are handed to fn as DLManagedTensors with references of their own (rpc
// releases its references when the handler returns), so fn may keep them.
func (s *serverEntry) handler(method string, fn C.trpc_handler_fn, userData unsafe.Pointer) rpc.Handler {
	return func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		if !s.enter() {
			return nil, errorf(codes.Unavailable, "server is closing")
		}
		defer s.inflight.Done()
		var own []*rpc.Tensor
		for _, t := range req.Tensors {
			d, err := s.dup(t)
			if err != nil {
				for _, t := range own {
					t.Release()
				}
				return nil, err
			}
			own = append(own, d)
		}
		arr, err := exportAll(own, s)
		if err != nil {
			return nil, err
		}
		r := &replyEntry{server: s, ctx: ctx}
		rh := replies.add(r)
		cmethod := C.CString(method)
		var meta *C.uint8_t
		if len(req.Metadata) > 0 {
			// Go memory without Go pointers, read by C only during the call.
			meta = (*C.uint8_t)(unsafe.Pointer(unsafe.SliceData(req.Metadata)))
		}
		code := C.trpc_invoke_handler(fn, userData, C.trpc_reply(rh), cmethod, meta, C.int64_t(len(req.Metadata)), arr, C.int64_t(len(own)))
		C.free(unsafe.Pointer(cmethod))
		C.free(unsafe.Pointer(arr))
		replies.remove(rh)
		r.mu.Lock()
		r.done = true
		r.mu.Unlock()
		if code != 0 {
			for _, t := range r.tensors {
				t.Release()
			}
			c := codes.Code(code)
			if code < 0 || c > codes.Unauthenticated {
				c = codes.Unknown
			}
			msg := r.errMsg
			if msg == "" {
				msg = "handler for " + method + " failed"
			}
			return nil, withDetails(c, msg, r.details)
		}
		return &rpc.Message{Metadata: r.meta, Tensors: r.tensors}, nil
	}
}

// trpc_reply_set_metadata sets the reply's metadata to a copy of
// data[0:n].
//
//export trpc_reply_set_metadata
func trpc_reply_set_metadata(h C.trpc_reply, data *C.uint8_t, n C.int64_t, errOut **C.char) C.int {
	r, err := getReply(h)
	if err != nil {
		return report(errOut, err)
	}
	if n < 0 || (n > 0 && data == nil) {
		return report(errOut, errorf(codes.InvalidArgument, "bad metadata (%d bytes)", int64(n)))
	}
	meta := C.GoBytes(unsafe.Pointer(data), C.int(n))
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return report(errOut, errorf(codes.FailedPrecondition, "the handler has returned"))
	}
	r.meta = meta
	return 0
}

// trpc_reply_add_tensor appends the caller's tensor to the reply. It is
// copied into the server's pool now (no copy when it is a tensor this
// server handed out), so the caller may free it when this returns.
//
//export trpc_reply_add_tensor
func trpc_reply_add_tensor(h C.trpc_reply, dl *C.DLTensor, errOut **C.char) C.int {
	r, err := getReply(h)
	if err != nil {
		return report(errOut, err)
	}
	var t *rpc.Tensor
	if dl != nil && dl.device.device_type == dlCUDA {
		// ABI version 5: staged into the server's pool now.
		t, err = stageDevice(dl, r.server.stager(r.ctx))
	} else {
		t, err = r.replyTensor(dl)
	}
	if err != nil {
		return report(errOut, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		t.Release()
		return report(errOut, errorf(codes.FailedPrecondition, "the handler has returned"))
	}
	r.tensors = append(r.tensors, t)
	return 0
}

// replyTensor is the caller's CPU tensor dl as a tensor of the server's
// pool: the tensor itself when the server handed it out, else a copy.
func (r *replyEntry) replyTensor(dl *C.DLTensor) (*rpc.Tensor, error) {
	zt, err := fromDL(dl)
	if err != nil {
		return nil, err
	}
	var t *rpc.Tensor
	if oh, o, ok := lookup(zt); ok {
		if o.server == r.server {
			t, err = r.server.dup(o.t)
		}
		unref(oh)
	}
	if t == nil && err == nil {
		t, err = r.server.srv.NewTensor(r.ctx, zt.DType(), zt.Shape())
		if err == nil {
			memcopy.Copy(t.Bytes(), zt.Bytes())
		}
	}
	return t, err
}

// trpc_reply_set_error sets the message the client sees when the handler
// returns a non-zero status code.
//
//export trpc_reply_set_error
func trpc_reply_set_error(h C.trpc_reply, msg *C.char) C.int {
	r, err := getReply(h)
	if err != nil || msg == nil {
		return C.int(codeOf(err))
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errMsg = C.GoString(msg)
	return 0
}

// trpc_reply_set_error_details attaches details (a traceback, say) to the
// error the handler returns: the client's trpc_error_details returns them.
// Added in ABI version 3.
//
//export trpc_reply_set_error_details
func trpc_reply_set_error_details(h C.trpc_reply, details *C.char) C.int {
	r, err := getReply(h)
	if err != nil || details == nil {
		return C.int(codeOf(err))
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.details = C.GoString(details)
	return 0
}
