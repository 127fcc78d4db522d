package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// framedPair is a pair whose client counts the unary calls it makes.
func framedPair(t *testing.T, transport string) (*rpc.Server, *rpc.Client, *rpctest.MethodCalls) {
	t.Helper()
	u := rpctest.NewMethodCalls()
	s, c := pair(t, transport, nil, []rpc.DialOption{rpc.WithGRPCDialOptions(grpc.WithUnaryInterceptor(u.Intercept))})
	if !rpc.SessionHasFrames(c) {
		t.Fatal("no frames")
	}
	return s, c, u
}

// TestSendCallFrames: on a data-plane session, Send and Call of every
// size, and their releases, make no unary call; a request or a reply too
// large for a slot goes indirect.
func TestSendCallFrames(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c, u := framedPair(t, tr)
			s.Handle("echo", echo(s))
			ctx := ctxT(t)
			sizes := []int{0, 100, rpc.DefaultEagerThreshold, rpc.DefaultEagerThreshold + 1, 1 << 20, 3<<20 + 5}
			for i, n := range sizes {
				w := wrapped(t, n, byte(i))
				if err := c.Send(ctx, "k", w); err != nil {
					t.Fatalf("send %d bytes: %v", n, err)
				}
				got, err := c.Fetch(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got.Bytes(), w.Bytes()) {
					t.Fatalf("send of %d bytes: fetched other bytes", n)
				}
				got.Release()
				w.Release()
			}
			var req rpc.Message
			for i, n := range sizes {
				req.Tensors = append(req.Tensors, wrapped(t, n, byte(10+i)))
			}
			req.Metadata = []byte("hello")
			for _, meta := range [][]byte{[]byte("hello"), []byte("M: a large reply")} {
				req.Metadata = meta
				reply, err := c.Call(ctx, "echo", &req)
				if err != nil {
					t.Fatal(err)
				}
				if len(reply.Tensors) != len(sizes) {
					t.Fatalf("%d reply tensors, want %d", len(reply.Tensors), len(sizes))
				}
				for i, r := range reply.Tensors {
					if !bytes.Equal(r.Bytes(), req.Tensors[i].Bytes()) {
						t.Fatalf("reply tensor %d differs", i)
					}
				}
				if meta[0] == 'M' && len(reply.Metadata) != 200<<10 {
					t.Fatalf("indirect reply: %d bytes of metadata", len(reply.Metadata))
				}
				reply.Release()
			}
			// Metadata larger than a slot: the request goes indirect, still
			// a frame.
			req.Metadata = bytes.Repeat([]byte{'x'}, 100<<10)
			reply, err := c.Call(ctx, "echo", &req)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(reply.Metadata, req.Metadata) || len(reply.Tensors) != len(sizes) {
				t.Fatal("indirect call's reply differs")
			}
			reply.Release()
			req.Release()
			if n := u.Total(); n != 0 {
				t.Fatalf("%d unary calls on a data-plane session", n)
			}
		})
	}
}

// TestCallFrameErrors: a handler's status, details included, reaches the
// caller over frames; a plain error is Unknown; an unknown method is
// Unimplemented.
func TestCallFrameErrors(t *testing.T) {
	s, c, _ := framedPair(t, rpc.TransportTCP)
	info := &errdetails.DebugInfo{StackEntries: []string{"frame 1", "frame 2"}, Detail: "boom"}
	s.Handle("details", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		st, _ := status.New(codes.FailedPrecondition, "not ready").WithDetails(info)
		return nil, st.Err()
	})
	s.Handle("plain", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		return nil, errors.New("plain failure")
	})
	ctx := ctxT(t)
	_, err := c.Call(ctx, "details", &rpc.Message{})
	st := status.Convert(err)
	if st.Code() != codes.FailedPrecondition || st.Message() != "not ready" || len(st.Details()) != 1 || !proto.Equal(st.Details()[0].(proto.Message), info) {
		t.Fatalf("details call: %v, details %v", err, st.Details())
	}
	if _, err := c.Call(ctx, "plain", &rpc.Message{}); status.Code(err) != codes.Unknown || status.Convert(err).Message() != "plain failure" {
		t.Fatalf("plain error: %v", err)
	}
	if _, err := c.Call(ctx, "nope", &rpc.Message{}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("unknown method: %v", err)
	}
}

// TestCallFrameCancel: cancelling a Call while its handler runs cancels the
// handler's context; what the request granted is freed once the server
// has answered; the session goes on.
func TestCallFrameCancel(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c, _ := framedPair(t, tr)
			started, stopped := make(chan struct{}, 1), make(chan error, 1)
			s.Handle("block", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				started <- struct{}{}
				<-ctx.Done()
				stopped <- ctx.Err()
				return nil, ctx.Err()
			})
			s.Handle("echo", echo(s))
			in := wrapped(t, 1<<20, 7)
			defer in.Release()
			ctx, cancel := context.WithCancel(ctxT(t))
			done := make(chan error, 1)
			go func() {
				_, err := c.Call(ctx, "block", &rpc.Message{Tensors: []*rpc.Tensor{in}})
				done <- err
			}()
			<-started
			cancel()
			if err := <-done; status.Code(err) != codes.Canceled {
				t.Fatalf("cancelled call: %v", err)
			}
			select {
			case err := <-stopped:
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("handler's context: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the handler's context was not cancelled")
			}
			reply, err := c.Call(ctxT(t), "echo", &rpc.Message{Tensors: []*rpc.Tensor{in}})
			if err != nil {
				t.Fatalf("call after a cancelled one: %v", err)
			}
			if !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
				t.Fatal("reply differs")
			}
			reply.Release()
			// The grant's pool copy of in goes back once the late answer
			// arrives.
			deadline := time.Now().Add(10 * time.Second)
			for c.Pool().Stats().InUse != 0 {
				if time.Now().After(deadline) {
					t.Fatalf("client pool: %d bytes in use after the cancelled call", c.Pool().Stats().InUse)
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// TestGracefulStopFinishesFrameCalls: GracefulStop lets calls that arrived
// as frames finish and answer, as gRPC's lets unary calls finish, and the
// client gets those answers although the session ends right after.
func TestGracefulStopFinishesFrameCalls(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c, _ := framedPair(t, tr)
			started := make(chan struct{})
			s.Handle("slow", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				close(started)
				time.Sleep(200 * time.Millisecond)
				return &rpc.Message{Metadata: []byte("done")}, nil
			})
			done := make(chan error, 1)
			go func() {
				reply, err := c.Call(ctxT(t), "slow", &rpc.Message{})
				if err == nil && string(reply.Metadata) != "done" {
					err = errors.New("wrong reply")
				}
				reply.Release()
				done <- err
			}()
			<-started
			s.GracefulStop()
			if err := <-done; err != nil {
				t.Fatalf("call under way through GracefulStop: %v", err)
			}
			if _, err := c.Call(ctxT(t), "slow", &rpc.Message{}); status.Code(err) != codes.Unavailable {
				t.Fatalf("call after GracefulStop: %v, want Unavailable", err)
			}
		})
	}
}

// TestFrameCallsBounded: a session may have MaxFrameCalls calls under way
// as frames; more are answered ResourceExhausted at once, and the session
// goes on.
func TestFrameCallsBounded(t *testing.T) {
	s, c, _ := framedPair(t, rpc.TransportTCP)
	ctx := ctxT(t)
	const n = engine.MaxFrameCalls + 64
	errs := make(chan error, n)
	for i := range n {
		go func() {
			got, err := c.Fetch(ctx, fmt.Sprintf("never%d", i%8), rpc.WaitForKey())
			if err == nil {
				got.Release()
			}
			errs <- err
		}()
	}
	exhausted := 0
	for exhausted < n-engine.MaxFrameCalls {
		err := <-errs
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("a call past the bound: %v, want ResourceExhausted", err)
		}
		exhausted++
	}
	for i := range 8 {
		publishBytes(t, s, fmt.Sprintf("never%d", i), 64, 1)
	}
	for range engine.MaxFrameCalls {
		if err := <-errs; err != nil {
			t.Fatalf("a waiting call within the bound: %v", err)
		}
	}
}
