package rpc_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// fromAddr makes a Client's gRPC connection leave from the local address
// host (gRPC options keep calls on frames).
func fromAddr(host string) rpc.DialOption { return rpc.WithGRPCDialOptions(rpctest.DialFrom(host)) }

// abuseLanes dials clients from rpctest.AbuserAddr, each offering lanes
// lanes on tcp, until the server refuses one or max have opened; it
// returns the clients that opened, a func that closes and drops them, and
// the refusal. No dial may wait on anything: each returns within a few
// seconds (generous, for a loaded 2-core machine; before admission, a
// session past the control pool waited for its whole connect timeout).
func abuseLanes(t *testing.T, addr string, lanes, max int) ([]*rpc.Client, func(), error) {
	t.Helper()
	var held []*rpc.Client
	drop := func() {
		for _, c := range held {
			c.Close()
		}
		held = nil
	}
	t.Cleanup(drop)
	for range max {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		start := time.Now()
		c, err := rpc.Dial(ctx, addr, rpc.WithTransports(rpc.TransportTCP), rpc.WithLanes(lanes), testPool(), insecureCreds(), fromAddr(rpctest.AbuserAddr))
		cancel()
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("dial %d took %v: a session waited", len(held), el)
		}
		if err != nil {
			return held, drop, err
		}
		held = append(held, c)
	}
	return held, drop, nil
}

// TestAdmissionLanesPerPeer: one peer opening sessions of many lanes gets
// its lane budget (the last session fewer lanes), then ResourceExhausted
// at once; a client from another host still connects on tcp and works.
func TestAdmissionLanesPerPeer(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), rpc.WithLanes(rpc.MaxLanes))
	s.Handle("echo", echo(s))
	held, _, err := abuseLanes(t, addr, 12, 100)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("after %d sessions of 12 lanes from one peer: %v, want ResourceExhausted", len(held), err)
	}
	t.Logf("refused after %d sessions: %v", len(held), err)
	total := 0
	for _, c := range held {
		total += rpc.SessionLanes(c)
	}
	if total != rpc.DefaultAdmission.LanesPerPeer {
		t.Errorf("one peer holds %d lanes, want its budget of %d (the last session fewer lanes)", total, rpc.DefaultAdmission.LanesPerPeer)
	}
	if st := s.Stats(); st.RefusedLanes < 12 {
		t.Errorf("Stats.RefusedLanes = %d, want at least the 12 of the refused session", st.RefusedLanes)
	}
	dialVictim(t, s, addr, rpc.TransportTCP, "while a peer holds its lanes")
}

// TestAdmissionSessionsPerPeer: one peer opening sessions (no data plane)
// until refused gets ResourceExhausted at once past its budget, and a
// client from another host still connects.
func TestAdmissionSessionsPerPeer(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC))
	s.Handle("echo", echo(s))
	opened, refused := rpctest.AbuseSessions(t, rpctest.RawConnFrom(t, addr, rpctest.AbuserAddr), rpc.ProtocolVersion, 200)
	if status.Code(refused) != codes.ResourceExhausted {
		t.Fatalf("after %d sessions from one peer: %v, want ResourceExhausted", opened, refused)
	}
	t.Logf("refused after %d sessions: %v", opened, refused)
	if opened != rpc.DefaultAdmission.SessionsPerPeer {
		t.Errorf("%d sessions opened, want the budget of %d", opened, rpc.DefaultAdmission.SessionsPerPeer)
	}
	if st := s.Stats(); st.RefusedSessions != 1 {
		t.Errorf("Stats.RefusedSessions = %d, want 1", st.RefusedSessions)
	}
	dialVictim(t, s, addr, rpc.TransportTCP, "while a peer holds its sessions")
}
