package rpc_test

import (
	"bytes"
	"context"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// ranWhereFramesAreRead reports whether the calling goroutine is the one
// that read the call's frame: its stack holds the server's frame handling
// (a handler on a goroutine of its own starts below it).
func ranWhereFramesAreRead() bool {
	buf := make([]byte, 64<<10)
	return strings.Contains(string(buf[:runtime.Stack(buf, false)]), "rpc.(*Server).serveFrame(")
}

// inlineEcho echoes its request's first tensor into a reply of replyBytes
// (the request's size when 0), and records where it ran.
func inlineEcho(s *rpc.Server, inline *atomic.Bool, replyBytes int) rpc.Handler {
	return func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		inline.Store(ranWhereFramesAreRead())
		n := replyBytes
		if n == 0 {
			n = len(in.Tensors[0].Bytes())
		}
		o, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
		if err != nil {
			return nil, err
		}
		copy(o.Bytes(), in.Tensors[0].Bytes())
		return &rpc.Message{Tensors: []*rpc.Tensor{o}}, nil
	}
}

func callBytes(t *testing.T, c *rpc.Client, method string, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	pattern(b, 7)
	reply, err := c.Call(ctxT(t), method, &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{int64(n)}, b))}})
	if err != nil {
		t.Fatalf("Call %s of %d bytes: %v", method, n, err)
	}
	defer reply.Release()
	got := bytes.Clone(reply.Tensors[0].Bytes())
	if !bytes.Equal(got[:min(n, len(got))], b[:min(n, len(got))]) {
		t.Fatalf("Call %s of %d bytes: the reply differs", method, n)
	}
	return got
}

// TestInlineHandler: a handler registered Inline runs where its call's
// frame was read when the request came in the frame, even on a Server
// given WithHandlerGoroutines, and on a goroutine of its own when it did
// not (a request tensor past the eager threshold); one not Inline then
// runs on a goroutine of its own. Every call answers the same.
func TestInlineHandler(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithHandlerGoroutines()}, nil)
			var inline, plain atomic.Bool
			s.Handle("inline", inlineEcho(s, &inline, 0), rpc.Inline())
			s.Handle("inline-big-reply", inlineEcho(s, &inline, 1<<20), rpc.Inline())
			s.Handle("plain", inlineEcho(s, &plain, 0))
			for i := range 3 {
				callBytes(t, c, "inline", 4<<10)
				if !inline.Load() {
					t.Fatalf("call %d: an Inline handler with a 4 KiB request ran on a goroutine of its own", i)
				}
				callBytes(t, c, "plain", 4<<10)
				if plain.Load() {
					t.Fatalf("call %d: with WithHandlerGoroutines, a handler not registered Inline ran where frames are read", i)
				}
			}
			if got := callBytes(t, c, "inline-big-reply", 4<<10); len(got) != 1<<20 || !inline.Load() {
				t.Fatalf("an Inline handler's 1 MiB reply: %d bytes, ran inline %v", len(got), inline.Load())
			}
			callBytes(t, c, "inline", 1<<20)
			if inline.Load() {
				t.Fatal("an Inline handler whose 1 MiB request tensor is pulled ran where frames are read")
			}
		})
	}
}

// TestInlineHandlerOnGRPC: on a gRPC-only session (no frames) an Inline
// handler runs as any other, and answers the same.
func TestInlineHandlerOnGRPC(t *testing.T) {
	s, c := pair(t, rpc.TransportGRPC, nil, nil)
	var inline atomic.Bool
	s.Handle("inline", inlineEcho(s, &inline, 0), rpc.Inline())
	for _, n := range []int{4 << 10, 1 << 20} {
		callBytes(t, c, "inline", n)
		if inline.Load() {
			t.Fatalf("a %d-byte call on the grpc plane ran where frames are read", n)
		}
	}
}

// TestInlineHandlerNotWithInterceptors: interceptors may wait, so a
// Server with any runs Inline handlers as any other.
func TestInlineHandlerNotWithInterceptors(t *testing.T) {
	var seen atomic.Int32
	icept := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		seen.Add(1)
		return next(ctx)
	}
	s, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithInterceptors(icept)}, nil)
	var inline atomic.Bool
	s.Handle("inline", inlineEcho(s, &inline, 0), rpc.Inline())
	callBytes(t, c, "inline", 4<<10)
	if inline.Load() || seen.Load() == 0 {
		t.Fatalf("with an interceptor: ran inline %v, interceptor ran %d times", inline.Load(), seen.Load())
	}
}

// TestInlineHandlerDoesNotWaitForPool: memory an Inline call asks of a
// full pool fails at once with ResourceExhausted (another call would wait
// until its deadline); the call after it, with the pool free, succeeds.
func TestInlineHandlerDoesNotWaitForPool(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithPoolOptions(mempool.WithArenaSize(4<<20), mempool.WithLimit(8<<20))}, nil)
	hog, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{6 << 20})
	if err != nil {
		t.Fatal(err)
	}
	var inline atomic.Bool
	s.Handle("inline", inlineEcho(s, &inline, 4<<20), rpc.Inline())
	b := make([]byte, 4<<10)
	_, err = c.Call(ctxT(t), "inline", &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{4 << 10}, b))}})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "Inline") || !inline.Load() {
		t.Fatalf("an Inline call that needs 4 MiB of a full pool: %v (ran inline %v), want ResourceExhausted naming Inline", err, inline.Load())
	}
	hog.Release()
	callBytes(t, c, "inline", 4<<10)
}
