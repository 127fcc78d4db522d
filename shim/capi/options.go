package main

/*
#include "tensorrpc.h"
*/
import "C"

import (
	"context"
	"slices"
	"strings"
	"time"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/callhint"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

var transportNames = []string{rpc.TransportIBV, rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC}

// options is a trpc_options read into Go: the options of both sides, and
// the settings only a server uses.
type options struct {
	shared         []rpc.Option
	eagerThreshold int    // server only; 0 is the default
	dataAddress    string // server only; "" is the default
}

// readOptions reads o (which may be NULL).
func readOptions(o *C.trpc_options) (options, error) {
	out := options{} // TENSORRPC_LOG and the other environment knobs are read by package rpc
	if o == nil {
		return out, nil
	}
	if o.transports != nil {
		var names []string
		for _, n := range strings.Split(C.GoString(o.transports), ",") {
			n = strings.TrimSpace(n)
			if n == "" {
				continue
			}
			if !slices.Contains(transportNames, n) {
				return options{}, errorf(codes.InvalidArgument, "unknown transport %q (known: %s)", n, strings.Join(transportNames, ", "))
			}
			names = append(names, n)
		}
		if len(names) == 0 {
			return options{}, errorf(codes.InvalidArgument, "no transport named in %q", C.GoString(o.transports))
		}
		out.shared = append(out.shared, rpc.WithTransports(names...))
	}
	if o.eager_threshold < 0 || o.pool_limit < 0 || o.max_tensor_bytes < 0 || o.connect_timeout_ms < 0 {
		return options{}, errorf(codes.InvalidArgument, "negative option")
	}
	out.eagerThreshold = int(o.eager_threshold)
	if o.pool_limit > 0 {
		out.shared = append(out.shared, rpc.WithPoolOptions(mempool.WithLimit(int64(o.pool_limit))))
	}
	if o.max_tensor_bytes > 0 {
		out.shared = append(out.shared, rpc.WithMaxTensorBytes(int64(o.max_tensor_bytes)))
	}
	if o.connect_timeout_ms > 0 {
		out.shared = append(out.shared, rpc.WithConnectTimeout(time.Duration(o.connect_timeout_ms)*time.Millisecond))
	}
	if o.data_address != nil {
		out.dataAddress = strings.TrimSpace(C.GoString(o.data_address))
	}
	return out, nil
}

// serverOptions translates o (which may be NULL) into the options of
// rpc.NewServer.
func serverOptions(o *C.trpc_options) ([]rpc.ServerOption, error) {
	r, err := readOptions(o)
	if err != nil {
		return nil, err
	}
	var opts []rpc.ServerOption
	if c := sessionCUDA(); c != nil {
		opts = append(opts, rpc.WithCUDA(c))
	}
	for _, opt := range r.shared {
		opts = append(opts, opt)
	}
	if r.eagerThreshold > 0 {
		opts = append(opts, rpc.WithEagerThreshold(r.eagerThreshold))
	}
	if r.dataAddress != "" {
		opts = append(opts, rpc.WithDataAddress(r.dataAddress))
	}
	return opts, nil
}

// dialOptions translates o (which may be NULL) into the options of
// rpc.Dial. The server-only fields (eager_threshold, data_address) are
// ignored, so that one trpc_options can configure both sides. The shim has
// no TLS: the control connection is plaintext gRPC, said explicitly, as
// rpc.Dial requires.
func dialOptions(o *C.trpc_options) ([]rpc.DialOption, error) {
	r, err := readOptions(o)
	if err != nil {
		return nil, err
	}
	opts := []rpc.DialOption{rpc.WithTransportCredentials(insecure.NewCredentials())}
	if c := sessionCUDA(); c != nil {
		opts = append(opts, rpc.WithCUDA(c))
	}
	for _, opt := range r.shared {
		opts = append(opts, opt)
	}
	return opts, nil
}

// callContext is the context of one call: timeoutMs milliseconds, or no
// deadline when it is negative.
// It is marked callhint.Locked: the calling goroutine is locked to the
// foreign thread that called in. Without a deadline it is one context for
// every call, which nothing cancels (its Done is nil): a call made with it
// allocates no context and arranges nothing for its end (a cancellable
// one had every tcp call register and stop a context.AfterFunc).
func callContext(timeoutMs C.int64_t) (context.Context, context.CancelFunc) {
	if timeoutMs < 0 {
		return lockedBackground, func() {}
	}
	return context.WithTimeout(lockedBackground, time.Duration(timeoutMs)*time.Millisecond)
}

var lockedBackground = callhint.Locked(context.Background())

func fillPoolStats(out *C.trpc_pool_stats, s mempool.Stats) {
	*out = C.trpc_pool_stats{
		in_use: C.int64_t(s.InUse), requested: C.int64_t(s.Requested), peak: C.int64_t(s.Peak),
		reserved: C.int64_t(s.Reserved), allocs: C.int64_t(s.Allocs), total_allocs: C.int64_t(s.TotalAllocs),
		arenas: C.int64_t(s.Arenas), waiting: C.int64_t(s.Waiting),
	}
}

func fillStats(out *C.trpc_stats, s rpc.Stats) {
	*out = C.trpc_stats{
		transfers: C.int64_t(s.Transfers), data_plane_bytes: C.int64_t(s.DataPlaneBytes),
		inline_bytes: C.int64_t(s.InlineBytes), stream_bytes: C.int64_t(s.StreamBytes),
		copies: C.int64_t(s.Copies), copied_bytes: C.int64_t(s.CopiedBytes),
		leases: C.int64_t(s.Leases), errors: C.int64_t(s.Errors),
	}
}

// shapeOf reads an ndim-long shape array.
func shapeOf(ndim C.int32_t, shape *C.int64_t) ([]int64, error) {
	if ndim < 0 || int(ndim) > zerocopy.MaxRank || (ndim > 0 && shape == nil) {
		return nil, errorf(codes.InvalidArgument, "bad shape (%d dimensions)", int(ndim))
	}
	out := make([]int64, int(ndim))
	if ndim > 0 {
		for i, d := range unsafe.Slice(shape, int(ndim)) {
			out[i] = int64(d)
		}
	}
	return out, nil
}
