package rpc

import (
	"context"
	"log/slog"

	"google.golang.org/grpc/credentials/insecure"
	"net"
	"os"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func TestMain(m *testing.M) {
	if mode := childproc.Role(); mode != "" {
		os.Exit(runChild(mode))
	}
	leakcheck.Main(m)
}

// testTransports are the data planes end-to-end tests run over. ibv tests
// skip, naming the reason, where there is no RDMA device.
var testTransports = []string{TransportIBV, TransportTCP, TransportSHM, TransportGRPC}

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

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// pattern fills b with bytes that depend on seed and position.
func pattern(b []byte, seed byte) {
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
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

func listen(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis
}

// write is a one-sided Write of local to the peer's addr through key: no
// grant of tensorrpc's allows one, so the peer refuses it.
func write(local verbs.Local, addr uint64, key uint32) verbs.SendRequest {
	return verbs.SendRequest{Op: verbs.OpWrite, Local: local, Remote: verbs.Remote{Addr: addr, Key: key}}
}

// skipWithoutDevice skips the test when transport's provider has no device
// here, with the provider's own explanation.
func skipWithoutDevice(t testing.TB, transport string) {
	t.Helper()
	if p := defaultProvider(transport, slog.New(slog.DiscardHandler)); p != nil {
		if _, err := p.Devices(); err != nil {
			t.Skipf("no %s device: %v", transport, err)
		}
	}
}

// insecureCreds is the plaintext credentials every test client passes.
func insecureCreds() DialOption { return WithTransportCredentials(insecure.NewCredentials()) }

// asServer and asDial convert options that fit both sides.
func asServer(opts []Option) []ServerOption {
	out := make([]ServerOption, len(opts))
	for i, o := range opts {
		out[i] = o
	}
	return out
}

func asDial(opts []Option) []DialOption {
	out := []DialOption{insecureCreds()}
	for _, o := range opts {
		out = append(out, o)
	}
	return out
}

// currentLink is the data plane of c's open session (nil on grpc).
func currentLink(c *Client) *engine.Link {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sess == nil {
		return nil
	}
	return c.sess.link
}

// sessionGone reports whether c's latest session has ended.
func sessionGone(c *Client) bool {
	c.mu.Lock()
	s := c.sess
	c.mu.Unlock()
	return s == nil || s.err() != nil
}

// linkPoolBytes is what a session's data plane holds of its tensor pool:
// nothing (its own buffers come from the control pool).
const linkPoolBytes = 0
