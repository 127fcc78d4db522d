package rpc_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// The messages a new user meets (issue 27's rough edges): in tensorrpc's
// words and naming the caller's API.

// TestStopTellsWaitersPlainly: after Stop, a Fetch waiting for a key
// fails Unavailable with a message in tensorrpc's words that says the
// server went away, not the providers' chain of errors (issue 27).
func TestStopTellsWaitersPlainly(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			_, addr, stop := serveOn(t, "127.0.0.1:0")
			ctx := ctxT(t)
			c, err := rpc.Dial(ctx, addr, insecureCreds(), rpc.WithTransports(tr))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			got := make(chan error, 1)
			go func() { _, err := c.Fetch(ctx, "never", rpc.WaitForKey()); got <- err }()
			time.Sleep(50 * time.Millisecond) // the Fetch waits at the server (or not yet: either must read well)
			stop()
			err = <-got
			msg := status.Convert(err).Message()
			if status.Code(err) != codes.Unavailable || !strings.HasPrefix(msg, "tensorrpc: ") || !strings.Contains(msg, "stopped") ||
				strings.Contains(msg, "verbs:") || strings.Contains(msg, "unixpacket") {
				t.Errorf("Fetch waiting when the server stopped: %v; want Unavailable in tensorrpc's words that it stopped", err)
			}
		})
	}
}

// TestDialWithoutCredentialsNamesRPC: Dial without credentials says which
// rpc option to pass, not gRPC's DialOption.
func TestDialWithoutCredentialsNamesRPC(t *testing.T) {
	_, err := rpc.Dial(ctxT(t), "127.0.0.1:1")
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(msg, "rpc.WithTransportCredentials(insecure.NewCredentials())") || strings.Contains(msg, "grpc.WithTransportCredentials") {
		t.Errorf("Dial without credentials: %v", err)
	}
}

// failingProvider is tcp whose device cannot open, with a reason of its own.
type failingProvider struct {
	verbs.Provider
	reason string
}

func (p failingProvider) Open(string) (verbs.ProtectionDomain, error) {
	return nil, errors.New(p.reason)
}

// TestUnavailablePlaneLoggedOnce: a process with a Server and a Client (or
// several) logs a data plane it cannot open once, not once for each.
func TestUnavailablePlaneLoggedOnce(t *testing.T) {
	var logged bytes.Buffer
	var mu sync.Mutex
	log := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logged}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	reason := fmt.Sprintf("test device %d is missing", time.Now().UnixNano())
	opt := rpc.WithProvider(failingProvider{tcp.New(), reason})
	for range 2 {
		s, err := rpc.NewServer(testPool(), opt, rpc.WithLogger(log), rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC))
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(logged.String(), reason); n != 1 {
		t.Errorf("the unavailable plane was logged %d times, want once:\n%s", n, logged.String())
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (w lockedWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(b)
}
