// White-box: these tests check the unexported parsing of the environment and the options it sets.

package rpc

import (
	"context"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
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

	for _, kv := range [][2]string{{EnvTransports, "udp"}, {EnvLog, "loud"}, {EnvLogFormat, "xml"}, {EnvLanes, "0"}, {EnvLanes, "17"}, {EnvLanes, "many"}, {EnvPollSpin, "-1"}, {EnvPollSpin, "1001"}, {EnvPollSpin, "50us"}, {EnvCopy, "fast"}} {
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
	t.Run(EnvPollSpin, func(t *testing.T) {
		if o := buildDialOptions(nil); o.pollSpin != engine.PollSpin || o.pollSet {
			t.Errorf("default poll spin %v (set %v), want %v, not set", o.pollSpin, o.pollSet, engine.PollSpin)
		}
		t.Setenv(EnvPollSpin, "200")
		if o := buildDialOptions(nil); o.pollSpin != 200*time.Microsecond || !o.pollSet {
			t.Errorf("%s=200: poll spin %v, set %v", EnvPollSpin, o.pollSpin, o.pollSet)
		}
		t.Setenv(EnvPollSpin, "0")
		if got := buildDialOptions(nil).pollSpin; got != 0 {
			t.Errorf("%s=0: poll spin %v", EnvPollSpin, got)
		}
	})
	names := map[string]bool{}
	for _, k := range EnvKnobs() {
		names[k.Name] = true
		if k.Name == EnvTransports && k.Value != "grpc" {
			t.Errorf("EnvKnobs reports %s=%q, want grpc", k.Name, k.Value)
		}
	}
	for _, n := range []string{EnvLog, EnvLogFormat, EnvTransports, EnvSocketIfname, EnvTCPAddr, EnvLanes, EnvCompression, EnvPollSpin, EnvCopy} {
		if !names[n] {
			t.Errorf("EnvKnobs lacks %s", n)
		}
	}
}
