package rpc_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
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
