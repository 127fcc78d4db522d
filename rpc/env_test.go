package rpc

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

func TestParseTransports(t *testing.T) {
	good := map[string][]string{
		"tcp":           {"tcp"},
		"shm, TCP,grpc": {"shm", "tcp", "grpc"},
		"tcp,tcp":       {"tcp"},
		"^ibv":          {"shm", "tcp", "grpc"},
		"^ibv,shm":      {"tcp", "grpc"},
	}
	for in, want := range good {
		if got, err := parseTransports(in); err != nil || !slices.Equal(got, want) {
			t.Errorf("parseTransports(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{",", "udp", "tcp,udp", "^ibv,shm,tcp,grpc", "^"} {
		if got, err := parseTransports(in); err == nil {
			t.Errorf("parseTransports(%q) = %v, want an error", in, got)
		}
	}
}

func TestEnvLogger(t *testing.T) {
	for _, tc := range []struct {
		level, format string
		ok, logs      bool
	}{
		{"debug", "", true, true}, {"TRACE", "json", true, true}, {"INFO", "text", true, true},
		{"warn", "", true, true}, {"error", "", true, true}, {"off", "", true, false},
		{"loud", "", false, false}, {"info", "xml", false, false},
	} {
		l, err := envLogger(tc.level, tc.format)
		if (err == nil) != tc.ok || (l != nil) != tc.logs {
			t.Errorf("envLogger(%q, %q) = %v, %v", tc.level, tc.format, l, err)
		}
	}
}

// TestEnvKnobs checks that the environment reaches NewServer and Dial, that
// explicit options win over it, and that a bad value fails with
// InvalidArgument naming the variable.
func TestEnvKnobs(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	t.Setenv(EnvTransports, "grpc")
	t.Setenv(EnvLog, "off")
	_, addr, _ := serveOn(t, "127.0.0.1:0")
	ctx := context.Background()
	c, err := Dial(ctx, addr, insecureCreds(), testPool())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	if got := c.Transport(); got != TransportGRPC {
		t.Errorf("with %s=grpc the session uses %q", EnvTransports, got)
	}
	c2, err := Dial(ctx, addr, insecureCreds(), testPool(), WithTransports(TransportTCP, TransportGRPC))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if got := c2.opts.transports; !slices.Equal(got, []string{TransportTCP, TransportGRPC}) {
		t.Errorf("WithTransports did not win over %s: %v", EnvTransports, got)
	}

	for _, kv := range [][2]string{{EnvTransports, "udp"}, {EnvLog, "loud"}, {EnvLogFormat, "xml"}, {EnvLanes, "0"}, {EnvLanes, "17"}, {EnvLanes, "many"}} {
		t.Run(kv[0]+"="+kv[1], func(t *testing.T) {
			t.Setenv(EnvLog, "info")
			t.Setenv(kv[0], kv[1])
			if _, err := NewServer(testPool()); status.Code(err) != codes.InvalidArgument {
				t.Errorf("NewServer with %s=%q: %v, want InvalidArgument", kv[0], kv[1], err)
			}
			if _, err := Dial(ctx, addr, insecureCreds(), testPool()); status.Code(err) != codes.InvalidArgument {
				t.Errorf("Dial with %s=%q: %v, want InvalidArgument", kv[0], kv[1], err)
			}
		})
	}
	t.Run(EnvLanes, func(t *testing.T) {
		t.Setenv(EnvLanes, "3")
		if got := buildDialOptions(nil).lanesFor(TransportTCP); got != 3 {
			t.Errorf("%s=3: %d lanes", EnvLanes, got)
		}
		if got := buildDialOptions([]DialOption{WithLanes(2)}).lanesFor(TransportTCP); got != 2 {
			t.Errorf("WithLanes(2) beside %s=3: %d lanes", EnvLanes, got)
		}
		if got := buildDialOptions(nil).lanesFor(TransportGRPC); got != 1 {
			t.Errorf("grpc: %d lanes", got)
		}
	})
	names := map[string]bool{}
	for _, k := range EnvKnobs() {
		names[k.Name] = true
		if k.Name == EnvTransports && k.Value != "grpc" {
			t.Errorf("EnvKnobs reports %s=%q, want grpc", k.Name, k.Value)
		}
	}
	for _, n := range []string{EnvLog, EnvLogFormat, EnvTransports, EnvSocketIfname, EnvTCPAddr, EnvLanes} {
		if !names[n] {
			t.Errorf("EnvKnobs lacks %s", n)
		}
	}
}

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
	_, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP, TransportGRPC), WithLogger(logger(&slogs)),
		WithProvider(tcp.New(tcp.WithListenAddress("127.0.0.1:0"), tcp.WithAdvertiseAddress("127.0.0.1:1"))))
	ctx := ctxT(t)
	c, err := Dial(ctx, addr, insecureCreds(), testPool(), WithTransports(TransportTCP, TransportGRPC), WithLogger(logger(&clogs)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	if c.Transport() != TransportGRPC {
		t.Fatalf("negotiated %s, want the grpc fallback", c.Transport())
	}
	for side, out := range map[string]string{"client": clogs.String(), "server": slogs.String()} {
		if !strings.Contains(out, "level=INFO") || !strings.Contains(out, "data plane not used") ||
			!strings.Contains(out, "transport=tcp") || !strings.Contains(out, "reason=") || !strings.Contains(out, "fix=") {
			t.Errorf("the %s's log does not say why tcp was refused:\n%s", side, out)
		}
	}
}
