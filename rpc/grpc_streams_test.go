package rpc_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// TestGRPCPlaneStreamLimit: the gRPC plane's calls are streams of their
// own beside the session's, so a server that allows one stream per
// connection (grpc.MaxConcurrentStreams(1)) leaves them none. Dial says so
// when that plane is chosen, instead of a session whose every call waits
// for its deadline; data planes, whose calls are frames, are not affected;
// two streams are enough.
func TestGRPCPlaneStreamLimit(t *testing.T) {
	serve := func(t *testing.T, streams uint32) string {
		s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC),
			rpc.WithGRPCServerOptions(grpc.MaxConcurrentStreams(streams)))
		publishBytes(t, s, "x", 256<<10, 1)
		return addr
	}
	dial := func(addr, plane string) (*rpc.Client, error) {
		return rpc.Dial(ctxT(t), addr, testPool(), insecureCreds(), rpc.WithTransports(plane), rpc.WithConnectTimeout(300*time.Millisecond))
	}
	fetch := func(t *testing.T, c *rpc.Client) {
		t.Helper()
		x, err := c.Fetch(ctxT(t), "x")
		if err != nil {
			t.Fatal(err)
		}
		x.Release()
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("one", func(t *testing.T) {
		addr := serve(t, 1)
		c, err := dial(addr, rpc.TransportGRPC)
		if err == nil {
			c.Close()
			t.Fatal("Dial on the gRPC plane succeeded against a server allowing one stream per connection")
		}
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "MaxConcurrentStreams") {
			t.Fatalf("Dial: %v; want FailedPrecondition naming grpc.MaxConcurrentStreams", err)
		}
		c, err = dial(addr, rpc.TransportTCP)
		if err != nil {
			t.Fatalf("Dial on tcp: %v", err)
		}
		if c.Transport() != rpc.TransportTCP {
			t.Fatalf("transport %q, want tcp", c.Transport())
		}
		fetch(t, c)
	})
	t.Run("two", func(t *testing.T) {
		c, err := dial(serve(t, 2), rpc.TransportGRPC)
		if err != nil {
			t.Fatalf("Dial on the gRPC plane: %v", err)
		}
		if c.Transport() != rpc.TransportGRPC {
			t.Fatalf("transport %q, want grpc", c.Transport())
		}
		fetch(t, c)
	})
}
