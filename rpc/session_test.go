package rpc

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// serveOn starts a Server on addr (":0" style addresses pick a port) and
// returns it with its listener's address and a stop function.
func serveOn(t *testing.T, addr string, opts ...ServerOption) (*Server, string, func()) {
	t.Helper()
	s, err := NewServer(append([]ServerOption{testPool()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	var lis net.Listener
	for try := 0; ; try++ { // the port of a server just stopped may linger briefly
		if lis, err = net.Listen("tcp", addr); err == nil || try == 100 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			s.Stop()
			<-served
			if st := s.Pool().Stats(); st.InUse != 0 {
				t.Errorf("server pool: %d bytes still in use", st.InUse)
			}
		}
	}
	t.Cleanup(stop)
	return s, lis.Addr().String(), stop
}

// TestSessionRecoversAfterServerRestart restarts the server on the same
// address: calls under way fail with Unavailable, the Client reports the
// state changes, and the next calls open a new session that renegotiates
// the data plane.
func TestSessionRecoversAfterServerRestart(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM, TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			t.Cleanup(func() { leakcheck.Check(t) })
			ts := []string{tr, TransportGRPC}
			s1, addr, stop1 := serveOn(t, "127.0.0.1:0", WithTransports(ts...))
			in := wrapped(t, 1<<20, 3)
			s1.Publish(context.Background(), "w", in)
			blocked := make(chan struct{})
			s1.Handle("block", func(ctx context.Context, _ *Message) (*Message, error) {
				close(blocked)
				<-ctx.Done()
				return nil, ctx.Err()
			})
			ctx := ctxT(t)
			fast := backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond}
			c, err := Dial(ctx, addr, WithTransports(ts...), testPool(), insecureCreds(), WithBackoff(fast))
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
				_, err := c.Call(ctx, "block", &Message{})
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

			s2, _, _ := serveOn(t, addr, WithTransports(ts...))
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
	ts := []string{TransportTCP, TransportGRPC}
	_, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(ts...), WithConnectTimeout(time.Minute),
		WithProvider(tcp.New(tcp.WithAdvertiseAddress("127.0.0.1:1"))))
	ctx := ctxT(t)
	start := time.Now()
	c, err := Dial(ctx, addr, WithTransports(ts...), testPool(), insecureCreds(), WithConnectTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	defer c.Close()
	t.Logf("Dial that fell back took %v", took)
	if took > 30*time.Second { // a wait for the one-minute timeout, not a slow machine
		t.Fatalf("Dial took %v: it waited for a timeout", took)
	}
	if c.Transport() != TransportGRPC {
		t.Fatalf("transport %s, want grpc", c.Transport())
	}
	var why *Rejection
	for _, r := range c.Rejections() {
		if r.Transport == TransportTCP {
			why = &r
		}
	}
	if why == nil || !strings.Contains(why.Reason, "connect") || why.Fix == "" {
		t.Fatalf("rejections do not say why tcp failed and what to do: %v", c.Rejections())
	}
}

// TestNotFoundNamesKey: Fetch of a key nobody published fails at once.
func TestNotFoundNamesKey(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportGRPC} {
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
				tn, err := c.Fetch(ctx, "later", WaitForKey())
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
	_, err := Dial(ctxT(t), addr, testPool())
	if err == nil || !strings.Contains(err.Error(), "WithTransportCredentials") {
		t.Fatalf("Dial without credentials: %v, want an error naming WithTransportCredentials", err)
	}
}

// TestLimitsAgree: the default pool holds the largest tensor the default
// limit allows, and a tensor over the limit fails with ResourceExhausted
// naming the option that raises it.
func TestLimitsAgree(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, err := NewServer(WithTransports(TransportGRPC))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	big, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{DefaultMaxTensorBytes})
	if err != nil {
		t.Fatalf("the default pool cannot hold a tensor of DefaultMaxTensorBytes: %v", err)
	}
	big.Release()
	if DefaultPoolLimit < 2*DefaultMaxTensorBytes {
		t.Fatalf("DefaultPoolLimit %d leaves no room beside one largest tensor", DefaultPoolLimit)
	}
	_, c := pair(t, TransportTCP, []ServerOption{WithMaxTensorBytes(1 << 20)}, nil)
	err = c.Send(ctxT(t), "x", wrapped(t, 2<<20, 1))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "WithMaxTensorBytes") {
		t.Fatalf("Send over the server's limit: %v, want ResourceExhausted naming WithMaxTensorBytes", err)
	}
}

var _ = errors.New
