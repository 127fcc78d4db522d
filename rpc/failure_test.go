package rpc_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestFallbackWhenDataPlaneCannotConnect advertises tcp addresses nobody
// listens on: the tcp data plane fails to connect and the session falls
// back to gRPC, saying why.
func TestFallbackWhenDataPlaneCannotConnect(t *testing.T) {
	unreachable := rpc.WithProvider(tcp.New(tcp.WithAdvertiseAddress("127.0.0.1:1"), tcp.WithDialTimeout(2*time.Second)))
	opts := []rpc.Option{unreachable, rpc.WithConnectTimeout(3 * time.Second)}
	s, c := pair(t, rpc.TransportGRPC, asServer(append(opts, rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC))), asDial(append(opts, rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC))))
	found := false
	for _, r := range c.Rejections() {
		if r.Transport == rpc.TransportTCP && strings.Contains(r.Reason, "connect") {
			found = true
		}
	}
	if !found {
		t.Fatalf("rejections do not explain tcp: %v", c.Rejections())
	}
	ctx := ctxT(t)
	in := wrapped(t, 3<<20, 9)
	if err := s.Publish(context.Background(), "x", in); err != nil {
		t.Fatal(err)
	}
	got, err := c.Fetch(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	defer got.Release()
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatal("data differs")
	}
}

// TestNoFallback: without TransportGRPC a session whose data plane cannot
// connect fails instead of falling back.
func TestNoFallback(t *testing.T) {
	s, err := rpc.NewServer(rpc.WithTransports(rpc.TransportTCP), testPool())
	if err != nil {
		t.Fatal(err)
	}
	lis := listen(t)
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	defer func() { s.Stop(); <-served }()
	ctx := ctxT(t)
	// A client that offers only shm cannot meet a tcp-only server.
	_, err = rpc.Dial(ctx, lis.Addr().String(), rpc.WithTransports(rpc.TransportSHM), testPool(), insecureCreds())
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("Dial: %v, want FailedPrecondition", err)
	}
}

// TestCancelMidTransfer cancels Fetch and Send of a large tensor while the
// one-sided operation is under way; every buffer comes back on both sides.
func TestCancelMidTransfer(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			big, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{256 << 20})
			if err != nil {
				t.Fatal(err)
			}
			fill(big.Bytes(), 1)
			s.Publish(context.Background(), "big", big)
			big.Release()
			published := s.Pool().Stats().InUse
			for _, delay := range []time.Duration{0, time.Millisecond, 10 * time.Millisecond} {
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(delay, cancel)
				got, err := c.Fetch(ctx, "big")
				if err == nil {
					got.Release() // it finished first; fine
				} else if code := status.Code(err); code != codes.Canceled {
					t.Fatalf("cancelled Fetch: %v", err)
				}
				cancel()
			}
			src, err := c.NewTensor(ctxT(t), zerocopy.Uint8, []int64{256 << 20})
			if err != nil {
				t.Fatal(err)
			}
			for _, delay := range []time.Duration{0, time.Millisecond, 10 * time.Millisecond} {
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(delay, cancel)
				if err := c.Send(ctx, "sent", src); err != nil && status.Code(err) != codes.Canceled {
					t.Fatalf("cancelled Send: %v", err)
				}
				cancel()
			}
			src.Release()
			s.Unpublish("sent")
			waitFor(t, "the client's buffers", func() bool { return c.Pool().Stats().InUse <= linkPoolBytes })
			waitFor(t, "the server's buffers", func() bool { s.Unpublish("sent"); return s.Pool().Stats().InUse <= published+linkPoolBytes })
		})
	}
}

// TestBackpressure: a server whose pool is full makes Send wait until
// memory is released, or until the context ends.
func TestBackpressure(t *testing.T) {
	small := rpc.WithPoolOptions(mempool.WithArenaSize(8<<20), mempool.WithLimit(64<<20))
	s, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{small}, nil)
	ctx := ctxT(t)
	a := wrapped(t, 40<<20, 1)
	if err := c.Send(ctx, "a", a); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := c.Send(short, "b", a); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Send into a full pool: %v, want DeadlineExceeded", err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Send(ctx, "b", a) }()
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("Send into a full pool returned %v before memory was freed", err)
	default:
	}
	got, err := s.Take(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	got.Release()
	if err := <-done; err != nil {
		t.Fatalf("Send after memory was freed: %v", err)
	}
	s.Unpublish("b")
}

// TestLimits: a tensor over the peer's size limit is ResourceExhausted.
func TestLimits(t *testing.T) {
	_, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithMaxTensorBytes(1 << 20)}, nil)
	err := c.Send(ctxT(t), "x", wrapped(t, 2<<20, 1))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("oversized Send: %v", err)
	}
}
