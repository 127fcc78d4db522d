package rpc_test

import (
	"bytes"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// syncBuffer is a log sink safe for the server's and client's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRefusedPlanesAreLogged: when a data plane is refused, both sides
// log it at Info with the reason and the fix.
func TestRefusedPlanesAreLogged(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	var slogs, clogs syncBuffer
	logger := func(w io.Writer) *slog.Logger {
		return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	// The server offers tcp with an address nobody listens on for its
	// data plane, so the client's connect fails and both sides log it.
	_, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), rpc.WithLogger(logger(&slogs)),
		rpc.WithProvider(tcp.New(tcp.WithListenAddress("127.0.0.1:0"), tcp.WithAdvertiseAddress("127.0.0.1:1"))))
	ctx := ctxT(t)
	c, err := rpc.Dial(ctx, addr, insecureCreds(), testPool(), rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), rpc.WithLogger(logger(&clogs)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	if c.Transport() != rpc.TransportGRPC {
		t.Fatalf("negotiated %s, want the grpc fallback", c.Transport())
	}
	for side, out := range map[string]string{"client": clogs.String(), "server": slogs.String()} {
		if !strings.Contains(out, "level=INFO") || !strings.Contains(out, "data plane not used") ||
			!strings.Contains(out, "transport=tcp") || !strings.Contains(out, "reason=") || !strings.Contains(out, "fix=") {
			t.Errorf("the %s's log does not say why tcp was refused:\n%s", side, out)
		}
	}
}
