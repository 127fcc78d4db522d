package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// dialChild dials a child server and checks the client ends clean.
func dialChild(t *testing.T, ch *childproc.Process, transport string, opts ...rpc.DialOption) *rpc.Client {
	t.Helper()
	addr := childtest.Line(t, ch)
	ts := []string{transport}
	if transport != rpc.TransportGRPC {
		ts = append(ts, rpc.TransportGRPC)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := rpc.Dial(ctx, addr, append([]rpc.DialOption{rpc.WithTransports(ts...), testPool(), insecureCreds()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	if c.Transport() != transport {
		t.Fatalf("negotiated %s, want %s: %v", c.Transport(), transport, c.Rejections())
	}
	return c
}

func closeClient(t *testing.T, c *rpc.Client) {
	t.Helper()
	// Close fails when the pool still has buffers out.
	if err := c.Close(); err != nil {
		t.Errorf("client Close: %v", err)
	}
}

func TestPeerInAnotherProcess(t *testing.T) {
	const size = 3<<20 + 5
	want := make([]byte, size)
	fill(want, 7)
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			ch := startChild(t, "server", tr, size)
			c := dialChild(t, ch, tr)
			ctx := ctxT(t)
			got, err := c.Fetch(ctx, "big")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), want) {
				t.Fatal("fetched bytes differ")
			}
			reply, err := c.Call(ctx, "reverse", &rpc.Message{Tensors: []*rpc.Tensor{got, wrapped(t, 10, 1)}})
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(reply.Tensors[1].Bytes(), want) {
				t.Fatal("call reply differs")
			}
			reply.Release()
			if err := c.Send(ctx, "back", got); err != nil {
				t.Fatal(err)
			}
			got.Release()
			closeClient(t, c)
			ch.Kill()
			leakcheck.Check(t)
		})
	}
}

// TestServerKilledMidCall kills the server process while a call waits in
// its handler: the call fails with Unavailable, later calls too, and the
// client's buffers all come back.
func TestServerKilledMidCall(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			ch := startChild(t, "server", tr, 1<<20)
			c := dialChild(t, ch, tr)
			ctx := ctxT(t)
			errc := make(chan error, 1)
			go func() {
				_, err := c.Call(ctx, "block", &rpc.Message{Tensors: []*rpc.Tensor{wrapped(t, 200000, 3)}})
				errc <- err
			}()
			if l := childtest.Line(t, ch); l != "blocked" {
				t.Fatalf("child said %q", l)
			}
			ch.Kill()
			if err := <-errc; status.Code(err) != codes.Unavailable {
				t.Fatalf("call to a killed server: %v, want Unavailable", err)
			}
			waitFor(t, "the session to notice", func() bool { return sessionGone(c) })
			if _, err := c.Fetch(ctx, "big"); status.Code(err) != codes.Unavailable {
				t.Fatalf("fetch after the kill: %v, want Unavailable", err)
			}
			closeClient(t, c)
			leakcheck.Check(t)
		})
	}
}

// TestServerKilledMidRead kills the server between its Fetch answer and the
// client's Read of its memory (over tcp, where the Read needs the peer): the
// Read fails with Unavailable and the destination buffer is freed.
func TestServerKilledMidRead(t *testing.T) {
	const size = 64 << 20
	ch := startChild(t, "server", rpc.TransportTCP, size)
	// The server process is gone by the time the client's Read is posted.
	var once sync.Once
	kill := func(wr verbs.SendRequest) error {
		if wr.Op == verbs.OpRead {
			once.Do(ch.Kill)
		}
		return nil
	}
	c := dialChild(t, ch, rpc.TransportTCP, rpc.WithProvider(hookProvider{Provider: tcp.New(), OnPost: kill}))
	_, err := c.Fetch(ctxT(t), "big")
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("Fetch from a server killed mid-read: %v, want Unavailable", err)
	}
	closeClient(t, c)
	leakcheck.Check(t)
}

// TestClientKilledMidSend kills a client process that keeps sending large
// tensors: the server ends its session and frees every destination.
func TestClientKilledMidSend(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, err := rpc.NewServer(rpc.WithTransports(tr, rpc.TransportGRPC), testPool())
			if err != nil {
				t.Fatal(err)
			}
			lis := listen(t)
			served := make(chan error, 1)
			go func() { served <- s.Serve(lis) }()
			ch := startChild(t, "client", tr, 16<<20, "TENSORRPC_TEST_ADDR="+lis.Addr().String())
			if l := childtest.Line(t, ch); l != "sending" {
				t.Fatalf("child said %q", l)
			}
			waitFor(t, "the client's tensors", func() bool { return s.Stats().Transfers >= 3 })
			ch.Kill()
			waitFor(t, "the session to end", func() bool { return len(s.Sessions()) == 0 })
			// Keys the client managed to send stay published; drop them.
			for i := range 1000 {
				s.Unpublish(fmt.Sprintf("flood%d", i))
			}
			if st := s.Pool().Stats(); st.InUse != 0 {
				t.Fatalf("server pool: %d bytes in use after the client died", st.InUse)
			}
			s.Stop()
			<-served
			leakcheck.Check(t)
		})
	}
}
