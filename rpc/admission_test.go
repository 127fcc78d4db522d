package rpc

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// abuserAddr is the loopback address the abusive clients of these tests
// connect from, so that the server tells them from the well-behaved
// clients on 127.0.0.1: a peer is a host (and TLS identity).
const abuserAddr = "127.0.0.2"

// fromAddr makes a Client's gRPC connection leave from the local address
// host, keeping its calls on frames (see options.observe).
func fromAddr(host string) DialOption {
	return dialOption(func(o *options) { o.observe = append(o.observe, dialFrom(host)) })
}

func dialFrom(host string) grpc.DialOption {
	return grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(host)}}
		return d.DialContext(ctx, "tcp", addr)
	})
}

// rawConnFrom is rawConn from the local address host.
func rawConnFrom(t *testing.T, addr, host string) pb.TensorRPCClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), dialFrom(host))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return pb.NewTensorRPCClient(cc)
}

// abuseLanes dials clients from abuserAddr, each offering lanes lanes on
// tcp, until the server refuses one or max have opened; it returns the
// clients that opened and the refusal. No dial may wait on anything: each
// returns within a few seconds (generous, for a loaded 2-core machine;
// before admission, a session past the control pool waited for its whole
// connect timeout).
func abuseLanes(t *testing.T, addr string, lanes, max int) ([]*Client, error) {
	t.Helper()
	var held []*Client
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	for range max {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		start := time.Now()
		c, err := Dial(ctx, addr, WithTransports(TransportTCP), WithLanes(lanes), testPool(), insecureCreds(), fromAddr(abuserAddr))
		cancel()
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("dial %d took %v: a session waited", len(held), el)
		}
		if err != nil {
			return held, err
		}
		held = append(held, c)
	}
	return held, nil
}

// TestAdmissionLanesPerPeer: one peer opening sessions of many lanes gets
// its lane budget (the last session fewer lanes), then ResourceExhausted
// at once; a client from another host still connects on tcp and works.
func TestAdmissionLanesPerPeer(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP, TransportGRPC), WithLanes(MaxLanes))
	s.Handle("echo", echo(s))
	held, err := abuseLanes(t, addr, 12, 100)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("after %d sessions of 12 lanes from one peer: %v, want ResourceExhausted", len(held), err)
	}
	t.Logf("refused after %d sessions: %v", len(held), err)
	total := 0
	for _, c := range held {
		total += len(c.sess.lanes)
	}
	if total != DefaultAdmission.LanesPerPeer {
		t.Errorf("one peer holds %d lanes, want its budget of %d (the last session fewer lanes)", total, DefaultAdmission.LanesPerPeer)
	}
	if st := s.Stats(); st.RefusedLanes < 12 {
		t.Errorf("Stats.RefusedLanes = %d, want at least the 12 of the refused session", st.RefusedLanes)
	}
	victim, err := Dial(ctxT(t), addr, WithTransports(TransportTCP), testPool(), insecureCreds())
	if err != nil {
		t.Fatalf("a new client on tcp: %v", err)
	}
	defer victim.Close()
	victimWorks(t, s, victim, "while a peer holds its lanes")
}

// TestAdmissionSessionsPerPeer: one peer opening sessions (no data plane)
// until refused gets ResourceExhausted at once past its budget, and a
// client from another host still connects.
func TestAdmissionSessionsPerPeer(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP, TransportGRPC))
	s.Handle("echo", echo(s))
	raw := rawConnFrom(t, addr, abuserAddr)
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	var refused error
	opened := 0
	for opened < 200 {
		st, err := raw.Session(ctx)
		if err == nil {
			err = st.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{ProtocolVersion: ProtocolVersion}}})
		}
		if err == nil {
			_, err = st.Recv()
		}
		if err != nil {
			refused = err
			break
		}
		opened++
	}
	if status.Code(refused) != codes.ResourceExhausted {
		t.Fatalf("after %d sessions from one peer: %v, want ResourceExhausted", opened, refused)
	}
	t.Logf("refused after %d sessions: %v", opened, refused)
	if opened != DefaultAdmission.SessionsPerPeer {
		t.Errorf("%d sessions opened, want the budget of %d", opened, DefaultAdmission.SessionsPerPeer)
	}
	if st := s.Stats(); st.RefusedSessions != 1 {
		t.Errorf("Stats.RefusedSessions = %d, want 1", st.RefusedSessions)
	}
	victim, err := Dial(ctxT(t), addr, WithTransports(TransportTCP), testPool(), insecureCreds())
	if err != nil {
		t.Fatalf("a new client on tcp: %v", err)
	}
	defer victim.Close()
	victimWorks(t, s, victim, "while a peer holds its sessions")
}

// TestAdmissionControlPoolFull: when the control pool cannot hold a new
// session's receive slots, the session is refused with ResourceExhausted
// at once; it never waits on the pool for its connect timeout.
func TestAdmissionControlPoolFull(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP))
	hog, err := s.ctl.Alloc(ctxT(t), controlPoolLimit-(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer hog.Release()
	start := time.Now()
	c, err := Dial(ctxT(t), addr, WithTransports(TransportTCP), testPool(), insecureCreds())
	if err == nil {
		c.Close()
	}
	el := time.Since(start)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a session with the control pool full: %v, want ResourceExhausted", err)
	}
	// Generous for a loaded machine; the connect timeout is 5 s.
	if el > 3*time.Second {
		t.Errorf("the refusal took %v", el)
	}
	t.Logf("refused in %v: %v", el, err)
}
