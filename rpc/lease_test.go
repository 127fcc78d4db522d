package rpc_test

import (
	"bytes"
	"context"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"testing"
)

// TestLease fetches with Lease: on shm the tensor is the server's memory,
// with no copy; on tcp it is an ordinary copy.
func TestLease(t *testing.T) {
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			in := wrapped(t, 1<<20, 6)
			s.Publish(context.Background(), "x", in)
			before := c.Stats()
			got, err := c.Fetch(ctx, "x", rpc.Lease())
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), in.Bytes()) {
				t.Fatal("data differs")
			}
			after := c.Stats()
			wantLease := tr == rpc.TransportSHM
			if got.Leased() != wantLease || (after.Leases-before.Leases == 1) != wantLease {
				t.Fatalf("Leased() = %v, leases %d → %d; want lease %v", got.Leased(), before.Leases, after.Leases, wantLease)
			}
			if wantLease {
				if c.Pool().Stats().InUse > linkPoolBytes { // only the link's own buffers
					t.Fatalf("a lease used %d bytes of the client's pool", c.Pool().Stats().InUse)
				}
				// The lease is the server's memory: the server's buffer stays
				// held after Unpublish until the lease is released.
				s.Unpublish("x")
				if s.Pool().Stats().InUse < 1<<20 {
					t.Fatal("the server freed a leased buffer")
				}
				if !bytes.Equal(got.Bytes(), in.Bytes()) {
					t.Fatal("leased data changed after Unpublish")
				}
			}
			got.Release()
			got.Release() // a second Release does nothing
			s.Unpublish("x")
			waitFor(t, "the server's buffer", func() bool { return s.Pool().Stats().InUse <= linkPoolBytes })
		})
	}
}

// TestLeaseOutlivesClientAndServer: a leased tensor (the server's memory,
// mapped read-only) stays readable after the Client is closed and the
// server process is killed; it keeps the bytes it had.
func TestLeaseOutlivesClientAndServer(t *testing.T) {
	const size = 8<<20 + 3
	ch := startChild(t, "server", rpc.TransportSHM, size)
	c := dialChild(t, ch, rpc.TransportSHM)
	got, err := c.Fetch(ctxT(t), "big", rpc.Lease())
	if err != nil {
		t.Fatal(err)
	}
	if !got.Leased() {
		t.Fatal("not leased")
	}
	if err := c.Close(); err != nil {
		t.Fatalf("client Close with a lease out: %v", err)
	}
	ch.Kill()
	want := make([]byte, size)
	fill(want, 7) // what the child published
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatal("the leased bytes changed after the client closed and the server died")
	}
	got.Release()
	leakcheck.Check(t)
}
