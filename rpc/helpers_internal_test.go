// White-box helpers for the tests that look inside sessions, links and
// frames; the black-box tests' helpers are in helpers_ext_test.go.

package rpc

import (
	"context"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"

	"google.golang.org/grpc/credentials/insecure"
	"net"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Helpers that need no part of package rpc live in rpctest, shared with
// the black-box tests.
var (
	ctxT              = rpctest.Context
	pattern           = rpctest.Pattern
	waitFor           = rpctest.WaitFor
	skipWithoutDevice = rpctest.SkipWithoutDevice
	sessionGone       = SessionGone
)

type hookProvider = rpctest.HookProvider

// small pools keep the tests' memory modest.
func testPool() Option {
	return WithPoolOptions(mempool.WithArenaSize(4<<20), mempool.WithLimit(3<<30))
}

// pair starts a Server and a Client restricted to transport and registers
// cleanups that check both end with every buffer released and no
// goroutine left.
func pair(t *testing.T, transport string, serverOpts []ServerOption, clientOpts []DialOption) (*Server, *Client) {
	t.Helper()
	skipWithoutDevice(t, transport)
	ts := []string{transport}
	if transport != TransportGRPC {
		ts = append(ts, TransportGRPC)
	}
	s, err := NewServer(append([]ServerOption{WithTransports(ts...), testPool()}, serverOpts...)...)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := Dial(ctx, lis.Addr().String(), append([]DialOption{WithTransports(ts...), testPool(), insecureCreds()}, clientOpts...)...)
	if err != nil {
		s.Stop()
		<-served
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("client Close: %v", err)
		}
		s.Stop()
		<-served
		if st := s.Pool().Stats(); st.InUse != 0 {
			t.Errorf("server pool: %d bytes still in use", st.InUse)
		}
		leakcheck.Check(t)
	})
	if c.Transport() != transport {
		t.Fatalf("negotiated %s, want %s (rejections: %v)", c.Transport(), transport, c.Rejections())
	}
	return s, c
}

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

func wrapped(t *testing.T, n int, seed byte) *Tensor {
	t.Helper()
	b := make([]byte, n)
	pattern(b, seed)
	zt, err := zerocopy.New(zerocopy.Uint8, []int64{int64(n)}, b)
	if err != nil {
		t.Fatal(err)
	}
	return WrapTensor(zt)
}

// write is a one-sided Write of local to the peer's addr through key: no
// grant of tensorrpc's allows one, so the peer refuses it.
func write(local verbs.Local, addr uint64, key uint32) verbs.SendRequest {
	return verbs.SendRequest{Op: verbs.OpWrite, Local: local, Remote: verbs.Remote{Addr: addr, Key: key}}
}

// insecureCreds is the plaintext credentials every test client passes.
func insecureCreds() DialOption { return WithTransportCredentials(insecure.NewCredentials()) }
