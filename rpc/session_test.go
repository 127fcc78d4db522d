package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestSessionRecoversAfterServerRestart restarts the server on the same
// address: calls under way fail with Unavailable, the Client reports the
// state changes, and the next calls open a new session that renegotiates
// the data plane.
func TestSessionRecoversAfterServerRestart(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			t.Cleanup(func() { leakcheck.Check(t) })
			ts := []string{tr, rpc.TransportGRPC}
			s1, addr, stop1 := serveOn(t, "127.0.0.1:0", rpc.WithTransports(ts...))
			in := wrapped(t, 1<<20, 3)
			s1.Publish(context.Background(), "w", in)
			blocked := make(chan struct{})
			s1.Handle("block", func(ctx context.Context, _ *rpc.Message) (*rpc.Message, error) {
				close(blocked)
				<-ctx.Done()
				return nil, ctx.Err()
			})
			ctx := ctxT(t)
			fast := backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond}
			c, err := rpc.Dial(ctx, addr, rpc.WithTransports(ts...), testPool(), insecureCreds(), rpc.WithBackoff(fast))
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := c.Close(); err != nil {
					t.Errorf("client Close: %v", err)
				}
				if c.State() != connectivity.Shutdown {
					t.Errorf("state after Close: %v", c.State())
				}
			}()
			if c.Transport() != tr || c.State() != connectivity.Ready {
				t.Fatalf("transport %s state %v, want %s Ready (%v)", c.Transport(), c.State(), tr, c.Rejections())
			}
			first := c.SessionID()
			got, err := c.Fetch(ctx, "w")
			if err != nil {
				t.Fatal(err)
			}
			got.Release()

			inflight := make(chan error, 1)
			go func() {
				_, err := c.Call(ctx, "block", &rpc.Message{})
				inflight <- err
			}()
			<-blocked
			stop1()
			if err := <-inflight; status.Code(err) != codes.Unavailable {
				t.Fatalf("call in flight across the restart: %v, want Unavailable", err)
			}
			wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
			defer wcancel()
			for c.State() == connectivity.Ready {
				if !c.WaitForStateChange(wctx, connectivity.Ready) {
					t.Fatal("the Client did not notice the session ended")
				}
			}
			// With no server, an attempt fails: Unavailable, then backoff.
			if _, err := c.Fetch(ctx, "w"); status.Code(err) != codes.Unavailable {
				t.Fatalf("Fetch with the server down: %v, want Unavailable", err)
			}

			s2, _, _ := serveOn(t, addr, rpc.WithTransports(ts...))
			s2.Publish(context.Background(), "w", in)
			deadline := time.Now().Add(20 * time.Second)
			for {
				got, err = c.Fetch(ctx, "w")
				if err == nil {
					break
				}
				if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
					t.Fatalf("Fetch after the restart: %v", err)
				}
				time.Sleep(10 * time.Millisecond)
			}
			if !bytes.Equal(got.Bytes(), in.Bytes()) {
				t.Fatal("data differs after the restart")
			}
			got.Release()
			if c.State() != connectivity.Ready || c.Transport() != tr || c.SessionID() == first {
				t.Fatalf("after the restart: state %v, transport %s, session %s (first %s)", c.State(), c.Transport(), c.SessionID(), first)
			}
			// Send and Call work on the new session too.
			if err := c.Send(ctx, "back", in); err != nil {
				t.Fatal(err)
			}
			back, err := s2.Fetch(ctx, "back")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Bytes(), in.Bytes()) {
				t.Fatal("sent data differs")
			}
			back.Release()
		})
	}
}

// TestFallbackIsFast makes the tcp data plane fail to connect (the server
// advertises a port nobody listens on) with a long connect timeout: the
// client's failure reaches the server at once, so Dial falls back without
// waiting for any timeout, and the rejection names cause and fix.
func TestFallbackIsFast(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	ts := []string{rpc.TransportTCP, rpc.TransportGRPC}
	_, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(ts...), rpc.WithConnectTimeout(time.Minute),
		rpc.WithProvider(tcp.New(tcp.WithAdvertiseAddress("127.0.0.1:1"))))
	ctx := ctxT(t)
	start := time.Now()
	c, err := rpc.Dial(ctx, addr, rpc.WithTransports(ts...), testPool(), insecureCreds(), rpc.WithConnectTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	defer c.Close()
	t.Logf("Dial that fell back took %v", took)
	if took > 30*time.Second { // a wait for the one-minute timeout, not a slow machine
		t.Fatalf("Dial took %v: it waited for a timeout", took)
	}
	if c.Transport() != rpc.TransportGRPC {
		t.Fatalf("transport %s, want grpc", c.Transport())
	}
	var why *rpc.Rejection
	for _, r := range c.Rejections() {
		if r.Transport == rpc.TransportTCP {
			why = &r
		}
	}
	if why == nil || !strings.Contains(why.Reason, "connect") || why.Fix == "" {
		t.Fatalf("rejections do not say why tcp failed and what to do: %v", c.Rejections())
	}
}

// TestNotFoundNamesKey: Fetch of a key nobody published fails at once.
func TestNotFoundNamesKey(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			_, err := c.Fetch(ctx, "nobody/published/this")
			if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "nobody/published/this") {
				t.Fatalf("Fetch: %v, want NotFound naming the key", err)
			}
			if _, err := s.Fetch(ctx, "nor/this"); status.Code(err) != codes.NotFound {
				t.Fatalf("Server.Fetch: %v, want NotFound", err)
			}
			got := make(chan error, 1)
			go func() {
				tn, err := c.Fetch(ctx, "later", rpc.WaitForKey())
				if err == nil {
					tn.Release()
				}
				got <- err
			}()
			time.Sleep(20 * time.Millisecond)
			s.Publish(ctx, "later", wrapped(t, 100, 1))
			if err := <-got; err != nil {
				t.Fatalf("Fetch with WaitForKey: %v", err)
			}
		})
	}
}

// TestDialNeedsCredentials: no silent insecure default.
func TestDialNeedsCredentials(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	_, addr, _ := serveOn(t, "127.0.0.1:0")
	_, err := rpc.Dial(ctxT(t), addr, testPool())
	if err == nil || !strings.Contains(err.Error(), "WithTransportCredentials") {
		t.Fatalf("Dial without credentials: %v, want an error naming WithTransportCredentials", err)
	}
}

// TestLimitsAgree: the default pool holds the largest tensor the default
// limit allows, and a tensor over the limit fails with ResourceExhausted
// naming the option that raises it.
func TestLimitsAgree(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, err := rpc.NewServer(rpc.WithTransports(rpc.TransportGRPC))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	big, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{rpc.DefaultMaxTensorBytes})
	if err != nil {
		t.Fatalf("the default pool cannot hold a tensor of DefaultMaxTensorBytes: %v", err)
	}
	big.Release()
	if rpc.DefaultPoolLimit < 2*rpc.DefaultMaxTensorBytes {
		t.Fatalf("DefaultPoolLimit %d leaves no room beside one largest tensor", rpc.DefaultPoolLimit)
	}
	_, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithMaxTensorBytes(1 << 20)}, nil)
	err = c.Send(ctxT(t), "x", wrapped(t, 2<<20, 1))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "WithMaxTensorBytes") {
		t.Fatalf("Send over the server's limit: %v, want ResourceExhausted naming WithMaxTensorBytes", err)
	}
}

var _ = errors.New
