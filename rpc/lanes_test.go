package rpc_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
)

// TestLanesNegotiated: a session has the smaller of the two sides' lanes.
func TestLanesNegotiated(t *testing.T) {
	for _, c := range []struct{ client, server, want int }{{4, 2, 2}, {2, 4, 2}, {1, 4, 1}, {3, 3, 3}} {
		t.Run(fmt.Sprintf("client%d-server%d", c.client, c.server), func(t *testing.T) {
			s, cl := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithLanes(c.server)}, []rpc.DialOption{rpc.WithLanes(c.client)})
			if got := rpc.SessionLanes(cl); got != c.want {
				t.Fatalf("client has %d lanes, want %d", got, c.want)
			}
			if got := rpc.ServerSessionLanes(s); len(got) != 1 || got[0] != c.want {
				t.Fatalf("server sessions have %v lanes, want [%d]", got, c.want)
			}
			publishBytes(t, s, "k", 1<<20, 1)
			for range 2 * c.want {
				got, err := cl.Fetch(ctxT(t), "k")
				if err != nil {
					t.Fatal(err)
				}
				got.Release()
			}
		})
	}
}

// TestLanesAllowed: a session gets the lanes it wants while the control
// pool's slots stay within half its limit, and none past that (the
// session is refused: slots are never waited for).
func TestLanesAllowed(t *testing.T) {
	ctl, err := engine.NewControlPool()
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	slot := engine.SlotSizeFor(rpc.DefaultEagerThreshold)
	if got := engine.LanesAllowed(ctl, 8, slot); got != 8 {
		t.Fatalf("empty pool: %d lanes, want 8", got)
	}
	perLane := engine.FrameSlots * slot
	hog, err := ctl.Alloc(ctxT(t), engine.ControlPoolLimit/2-3*perLane)
	if err != nil {
		t.Fatal(err)
	}
	got := engine.LanesAllowed(ctl, 8, slot)
	hog.Release()
	if got < 1 || got > 3 {
		t.Fatalf("pool near half full: %d lanes, want 1 to 3", got)
	}
	hog, err = ctl.Alloc(ctxT(t), engine.ControlPoolLimit/2+perLane)
	if err != nil {
		t.Fatal(err)
	}
	defer hog.Release()
	if got := engine.LanesAllowed(ctl, 8, slot); got != 0 {
		t.Fatalf("pool past half full: %d lanes, want 0", got)
	}
}

// TestCloseAfterServerEnded: a Client closed just after the server ended
// its session (while the client may still hold the session's lanes for
// late answers) closes that session too, leaving no goroutine behind.
func TestCloseAfterServerEnded(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			t.Cleanup(func() { leakcheck.Check(t) })
			s, addr, stop := serveOn(t, "127.0.0.1:0", rpc.WithTransports(tr), rpc.WithLanes(2))
			c, err := rpc.Dial(ctxT(t), addr, rpc.WithTransports(tr), rpc.WithLanes(2), testPool(), insecureCreds())
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Connect(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			publishBytes(t, s, "k", 1<<20, 1)
			got, err := c.Fetch(ctxT(t), "k")
			if err != nil {
				t.Fatal(err)
			}
			got.Release()
			stop()
			for !sessionGone(c) {
				time.Sleep(time.Millisecond)
			}
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
