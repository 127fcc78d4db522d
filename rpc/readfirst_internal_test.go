// White-box: which Sends the server reads before their calls run.

package rpc

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestSendReadFirst: a plain Send whose tensor the server reads from the
// client's memory is read as its frame arrives, and its call runs as the
// Read completes, without a goroutine of its own (sendReadFirst): on tcp
// up to a striped size (from engine.MinCompressed planned as auto
// compression says, but for a Read that would probe the plane first), on
// shm up to shmReadFirstMax. A Send with a deadline, or to a
// server with an interceptor, is read as before, by its call. Either way what was sent is what is fetched, and
// the pools are left empty (pair's cleanup).
func TestSendReadFirst(t *testing.T) {
	cases := []struct {
		transport string
		n         int
		deadline  bool
		intercept bool
		first     bool
	}{
		{TransportTCP, 64 << 10, false, false, true},
		{TransportTCP, 512 << 10, false, false, true},
		{TransportTCP, 4 << 20, false, false, true}, // planned as auto compression says (after the first probes)
		{TransportTCP, 64 << 10, true, false, false},
		{TransportTCP, 64 << 10, false, true, false},
		{TransportSHM, 64 << 10, false, false, true},
		{TransportSHM, shmReadFirstMax + 4096, false, false, false},
	}
	for i, tc := range cases {
		t.Run(fmt.Sprintf("%s/%d/deadline=%v/intercept=%v", tc.transport, tc.n, tc.deadline, tc.intercept), func(t *testing.T) {
			var sopts []ServerOption
			intercepted := 0
			if tc.intercept {
				sopts = append(sopts, WithInterceptors(func(ctx context.Context, info *CallInfo, next func(context.Context) error) error {
					intercepted++
					return next(ctx)
				}))
			}
			s, c := pair(t, tc.transport, sopts, nil)
			ctx := context.Background()
			for j := range 4 {
				x := wrapped(t, tc.n, byte(i+j))
				sctx, cancel := ctx, context.CancelFunc(func() {})
				if tc.deadline {
					sctx, cancel = context.WithTimeout(ctx, time.Minute)
				}
				err := c.Send(sctx, "k", x)
				cancel()
				if err != nil {
					x.Release()
					t.Fatal(err)
				}
				got, err := c.Fetch(ctx, "k")
				if err != nil {
					x.Release()
					t.Fatal(err)
				}
				if !bytes.Equal(got.Bytes(), x.Bytes()) {
					t.Fatalf("send %d: fetched bytes differ from those sent", j)
				}
				got.Release()
				x.Release()
			}
			// Not every one need be: after a call that took long where
			// its frame was read (a slow machine, the race detector),
			// the next runs in a goroutine (handlerPace).
			if got := s.readsFirst.Load(); tc.first != (got > 0) {
				t.Fatalf("%d of 4 Sends read first, want %s", got, map[bool]string{true: "some", false: "none"}[tc.first])
			}
			if tc.intercept && intercepted == 0 {
				t.Fatal("the interceptor saw no call")
			}
		})
	}
}

// TestCallReadFirst: a Call whose one tensor to read goes to a handler
// that runs where its frame was read is read first too (callReadFirst):
// the handler gets the bytes sent; a Call of an unknown method, or to a
// server whose handlers run in goroutines of their own, is not.
func TestCallReadFirst(t *testing.T) {
	cases := []struct {
		transport  string
		n          int
		method     string
		goroutines bool
		first      bool
	}{
		{TransportTCP, 64 << 10, "echo", false, true},
		{TransportSHM, 64 << 10, "echo", false, true},
		{TransportTCP, 64 << 10, "nope", false, false},
		{TransportTCP, 64 << 10, "echo", true, false},
	}
	for i, tc := range cases {
		t.Run(fmt.Sprintf("%s/%s/goroutines=%v", tc.transport, tc.method, tc.goroutines), func(t *testing.T) {
			var sopts []ServerOption
			if tc.goroutines {
				sopts = append(sopts, WithHandlerGoroutines())
			}
			s, c := pair(t, tc.transport, sopts, nil)
			s.Handle("echo", echo(s))
			ctx := context.Background()
			for j := range 4 {
				x := wrapped(t, tc.n, byte(i+j))
				reply, err := c.Call(ctx, tc.method, &Message{Tensors: []*Tensor{x}})
				switch {
				case tc.method != "echo":
					if status.Code(err) != codes.Unimplemented {
						t.Fatalf("call of %q: %v, want Unimplemented", tc.method, err)
					}
				case err != nil:
					t.Fatal(err)
				case len(reply.Tensors) != 1 || !bytes.Equal(reply.Tensors[0].Bytes(), x.Bytes()):
					t.Fatalf("call %d: the reply is not what was sent", j)
				}
				reply.Release()
				x.Release()
			}
			if got := s.readsFirst.Load(); tc.first != (got > 0) {
				t.Fatalf("%d of 4 Calls read first, want %s (see TestSendReadFirst)", got, map[bool]string{true: "some", false: "none"}[tc.first])
			}
		})
	}
}
