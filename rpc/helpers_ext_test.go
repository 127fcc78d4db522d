package rpc_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestMain serves both of rpc's test packages: one test binary holds them.
func TestMain(m *testing.M) {
	if mode := childproc.Role(); mode != "" {
		os.Exit(runChild(mode))
	}
	leakcheck.Main(m)
}

// Helpers that need no part of package rpc live in rpctest, shared with
// the white-box tests.
var (
	ctxT              = rpctest.Context
	pattern           = rpctest.Pattern
	fill              = rpctest.Fill
	waitFor           = rpctest.WaitFor
	skipWithoutDevice = rpctest.SkipWithoutDevice
)

type hookProvider = rpctest.HookProvider

// testTransports are the data planes end-to-end tests run over. ibv tests
// skip, naming the reason, where there is no RDMA device.
var testTransports = []string{rpc.TransportIBV, rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC}

// small pools keep the tests' memory modest.
func testPool() rpc.Option {
	return rpc.WithPoolOptions(mempool.WithArenaSize(4<<20), mempool.WithLimit(3<<30))
}

// pair starts a Server and a Client restricted to transport and registers
// cleanups that check both end with every buffer released and no
// goroutine left.
func pair(t *testing.T, transport string, serverOpts []rpc.ServerOption, clientOpts []rpc.DialOption) (*rpc.Server, *rpc.Client) {
	t.Helper()
	e := start(t, transport, serverOpts, clientOpts)
	return e.srv, e.c
}

// endpoints are a started Server, its Client and the server's address.
type endpoints struct {
	srv  *rpc.Server
	c    *rpc.Client
	addr string
}

// start is pair for tests and benchmarks, with the server's address. A
// benchmark may hold several pairs at once: only a test checks for
// goroutines left.
func start(t testing.TB, transport string, serverOpts []rpc.ServerOption, clientOpts []rpc.DialOption) endpoints {
	t.Helper()
	skipWithoutDevice(t, transport)
	ts := []string{transport}
	if transport != rpc.TransportGRPC {
		ts = append(ts, rpc.TransportGRPC)
	}
	s, err := rpc.NewServer(append([]rpc.ServerOption{rpc.WithTransports(ts...), testPool()}, serverOpts...)...)
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
	c, err := rpc.Dial(ctx, lis.Addr().String(), append([]rpc.DialOption{rpc.WithTransports(ts...), testPool(), insecureCreds()}, clientOpts...)...)
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
		if _, ok := t.(*testing.T); ok {
			leakcheck.Check(t)
		}
	})
	if c.Transport() != transport {
		t.Fatalf("negotiated %s, want %s (rejections: %v)", c.Transport(), transport, c.Rejections())
	}
	return endpoints{srv: s, c: c, addr: lis.Addr().String()}
}

// serveOn starts a Server on addr (":0" style addresses pick a port) and
// returns it with its listener's address and a stop function.
func serveOn(t *testing.T, addr string, opts ...rpc.ServerOption) (*rpc.Server, string, func()) {
	t.Helper()
	s, err := rpc.NewServer(append([]rpc.ServerOption{testPool()}, opts...)...)
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

func wrapped(t *testing.T, n int, seed byte) *rpc.Tensor {
	t.Helper()
	b := make([]byte, n)
	pattern(b, seed)
	zt, err := zerocopy.New(zerocopy.Uint8, []int64{int64(n)}, b)
	if err != nil {
		t.Fatal(err)
	}
	return rpc.WrapTensor(zt)
}

// publishBytes publishes n bytes of pattern seed under key and returns a
// copy of them.
func publishBytes(t *testing.T, s *rpc.Server, key string, n int, seed byte) []byte {
	t.Helper()
	w := wrapped(t, n, seed)
	defer w.Release()
	if err := s.Publish(ctxT(t), key, w); err != nil {
		t.Fatal(err)
	}
	return append([]byte(nil), w.Bytes()...)
}

// echo answers with copies of the request's tensors; metadata starting
// with 'M' asks for a 200 KiB answer's metadata.
func echo(s *rpc.Server) rpc.Handler {
	return func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		out := &rpc.Message{Metadata: in.Metadata}
		if len(in.Metadata) > 0 && in.Metadata[0] == 'M' {
			out.Metadata = bytes.Repeat([]byte{'r'}, 200<<10)
		}
		for _, t := range in.Tensors {
			o, err := s.NewTensor(ctx, t.DType(), t.Shape())
			if err != nil {
				out.Release()
				return nil, err
			}
			copy(o.Bytes(), t.Bytes())
			out.Tensors = append(out.Tensors, o)
		}
		return out, nil
	}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis
}

// insecureCreds is the plaintext credentials every test client passes.
func insecureCreds() rpc.DialOption { return rpc.WithTransportCredentials(insecure.NewCredentials()) }

// asServer and asDial convert options that fit both sides.
func asServer(opts []rpc.Option) []rpc.ServerOption {
	out := make([]rpc.ServerOption, len(opts))
	for i, o := range opts {
		out[i] = o
	}
	return out
}

func asDial(opts []rpc.Option) []rpc.DialOption {
	out := []rpc.DialOption{insecureCreds()}
	for _, o := range opts {
		out = append(out, o)
	}
	return out
}

// sessionGone reports whether c's latest session has ended.
func sessionGone(c *rpc.Client) bool { return rpc.SessionGone(c) }

// linkPoolBytes is what a session's data plane holds of its tensor pool:
// nothing (its own buffers come from the control pool).
const linkPoolBytes = 0

// dialVictim dials a new, well-behaved client on plane from the test's
// own address and checks with victimWorks that it can Send, Fetch and
// Call (what: under which attack).
func dialVictim(t *testing.T, s *rpc.Server, addr, plane, what string) {
	t.Helper()
	victim, err := rpc.Dial(ctxT(t), addr, rpc.WithTransports(plane), testPool(), insecureCreds())
	if err != nil {
		t.Fatalf("a new client on %s %s: %v", plane, what, err)
	}
	defer victim.Close()
	victimWorks(t, s, victim, what)
}

// victimWorks checks that another session's Fetch, Send and Call work.
func victimWorks(t *testing.T, s *rpc.Server, v *rpc.Client, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in := wrapped(t, 1<<20, 6)
	defer in.Release()
	if err := v.Send(ctx, "victim", in); err != nil {
		t.Fatalf("%s: the victim's Send: %v", what, err)
	}
	got, err := v.Fetch(ctx, "victim")
	if err != nil {
		t.Fatalf("%s: the victim's Fetch: %v", what, err)
	}
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatalf("%s: the victim fetched other bytes", what)
	}
	got.Release()
	reply, err := v.Call(ctx, "echo", &rpc.Message{Metadata: []byte("hi"), Tensors: []*rpc.Tensor{in}})
	if err != nil {
		t.Fatalf("%s: the victim's Call: %v", what, err)
	}
	if !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
		t.Fatalf("%s: the victim's Call answered other bytes", what)
	}
	reply.Release()
}
