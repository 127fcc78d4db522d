package engine

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/pooltest"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

const testSession = "session-1"

// testLanes makes n lanes in role on a tcp device of their own, frames
// enabled, closed when the test ends.
func testLanes(t *testing.T, role verbs.ConnectRole, n int) []*Link {
	t.Helper()
	ctl := pooltest.New(t, 1<<20)
	dev, err := OpenDomain(tcp.New(), pooltest.New(t, 1<<20), ctl)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dev.Close)
	lanes, err := NewLanes(context.Background(), dev, ctl, netip.AddrFrom4([4]byte{127, 0, 0, 1}), role, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { CloseLanes(lanes, errors.New("test over")) })
	for _, l := range lanes {
		l.EnableFrames(SlotSizeFor(0), nil, nil)
	}
	return lanes
}

// infos is the connection info of every lane.
func infos(lanes []*Link) [][]byte {
	return append([][]byte{lanes[0].QP.LocalInfo()}, LaneInfos(lanes[1:])...)
}

// stream stands for a session's gRPC stream: the connect results each
// side sends, and the order in which both sides sent them.
type stream struct {
	toAccept, toDial chan *pb.ConnectResult
	mu               sync.Mutex
	sent             []string // "dial 0", "accept 1": who sent a result of which step
}

func newStream() *stream {
	return &stream{toAccept: make(chan *pb.ConnectResult, 4), toDial: make(chan *pb.ConnectResult, 4)}
}

// negotiation is role's side of a negotiation over st.
func (st *stream) negotiation(role verbs.ConnectRole, lanes []*Link, remotes [][]byte) Negotiation {
	out, in, who := st.toAccept, st.toDial, "dial"
	if role == verbs.RoleAccept {
		out, in, who = st.toDial, st.toAccept, "accept"
	}
	return Negotiation{
		Role: role, Session: testSession, Transport: pb.Transport_TRANSPORT_TCP,
		Lanes: lanes, Remotes: remotes, Timeout: 10 * time.Second,
		Send: func(r *pb.ConnectResult) error {
			st.mu.Lock()
			step := "0"
			if r.Verify {
				step = "1"
			}
			st.sent = append(st.sent, who+" "+step)
			st.mu.Unlock()
			out <- r
			return nil
		},
		Recv: func(ctx context.Context) (*pb.ConnectResult, error) {
			select {
			case r := <-in:
				return r, nil
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		},
	}
}

type result struct {
	o   Outcome
	err error
}

// negotiate runs n in a goroutine; a test that ends early cancels ctx.
func negotiate(ctx context.Context, n Negotiation) <-chan result {
	ch := make(chan result, 1)
	go func() {
		o, err := Negotiate(ctx, n)
		ch <- result{o, err}
	}()
	return ch
}

// TestNegotiateBothRoles: a client (RoleDial) and a server (RoleAccept)
// connect and verify two lanes over tcp; the server opens the session
// before it reports its verdict, every lane ends Verified, and the
// connect results went in the .proto's order: each side's step 1, then
// the client's verdict before the server's.
func TestNegotiateBothRoles(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	dial, accept := testLanes(t, verbs.RoleDial, 2), testLanes(t, verbs.RoleAccept, 2)
	st := newStream()
	opened := 0
	an := st.negotiation(verbs.RoleAccept, accept, infos(dial))
	an.Open = func() error {
		opened++
		return nil
	}
	ctx := context.Background()
	a := negotiate(ctx, an)
	d := <-negotiate(ctx, st.negotiation(verbs.RoleDial, dial, infos(accept)))
	s := <-a
	if d.err != nil || d.o.Reason != "" || s.err != nil || s.o.Reason != "" {
		t.Fatalf("client: %v, %v; server: %v, %v", d.o, d.err, s.o, s.err)
	}
	if opened != 1 {
		t.Fatalf("the server opened the session %d times", opened)
	}
	for i, l := range append(dial, accept...) {
		if !l.Verified.Load() {
			t.Errorf("lane %d not verified", i)
		}
	}
	if got := strings.Join(st.sent[2:], ", "); got != "dial 1, accept 1" {
		t.Errorf("connect results sent: %v, want step 1 of each side, then dial 1, accept 1", st.sent)
	}
}

// TestNegotiateOpenFails: when the server cannot open the session on a
// verified plane, both sides reject it for the server's reason; the
// client hears it as the server's.
func TestNegotiateOpenFails(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	dial, accept := testLanes(t, verbs.RoleDial, 1), testLanes(t, verbs.RoleAccept, 1)
	st := newStream()
	an := st.negotiation(verbs.RoleAccept, accept, infos(dial))
	an.Open = func() error { return errors.New("server stopping") }
	ctx := context.Background()
	a := negotiate(ctx, an)
	d := <-negotiate(ctx, st.negotiation(verbs.RoleDial, dial, infos(accept)))
	s := <-a
	if s.err != nil || s.o.Theirs || s.o.String() != "server stopping" {
		t.Fatalf("server: %v, %v", s.o, s.err)
	}
	if d.err != nil || !d.o.Theirs || d.o.Reason != "server stopping" {
		t.Fatalf("client: %v, %v", d.o, d.err)
	}
	if dial[0].Verified.Load() {
		t.Fatal("the client's lane is verified on a rejected plane")
	}
}

// TestNegotiatePeerFailsToConnect: a server that reports at once that it
// could not connect makes the client give up its own attempt and reject
// the plane for the server's reason, without a verifying round trip.
func TestNegotiatePeerFailsToConnect(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	dial := testLanes(t, verbs.RoleDial, 1)
	// An accepting queue pair no one accepts on: the client's dial hangs
	// until it gives up.
	remotes := [][]byte{testLanes(t, verbs.RoleAccept, 1)[0].QP.LocalInfo()}
	st := newStream()
	st.toDial <- &pb.ConnectResult{Transport: pb.Transport_TRANSPORT_TCP, Error: "no route to host"}
	o, err := Negotiate(context.Background(), st.negotiation(verbs.RoleDial, dial, remotes))
	if err != nil || !o.Theirs || o.Reason != "connect: no route to host" {
		t.Fatalf("Negotiate: %v, %v", o, err)
	}
	if r := <-st.toAccept; r.Ok || r.Verify {
		t.Fatalf("the client's step 1 report: %v", r)
	}
	if len(st.sent) != 1 {
		t.Fatalf("the client sent %v, want its step 1 report only", st.sent)
	}
}

// TestNegotiateWrongVerifyingMessage: a client whose verifying message is
// not the session id makes the server reject the plane, not open the
// session, and say why in its verdict, though the client reports success.
func TestNegotiateWrongVerifyingMessage(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	dial, accept := testLanes(t, verbs.RoleDial, 1), testLanes(t, verbs.RoleAccept, 1)
	st := newStream()
	opened := false
	an := st.negotiation(verbs.RoleAccept, accept, infos(dial))
	an.Open = func() error {
		opened = true
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := negotiate(ctx, an)
	// The client, by hand.
	if err := ConnectLanes(ctx, dial, infos(accept)); err != nil {
		t.Fatal(err)
	}
	st.toAccept <- &pb.ConnectResult{Transport: pb.Transport_TRANSPORT_TCP, Ok: true}
	if err := dial[0].SendVerify(ctx, []byte("another session")); err != nil {
		t.Fatal(err)
	}
	st.toAccept <- &pb.ConnectResult{Transport: pb.Transport_TRANSPORT_TCP, Ok: true, Verify: true}
	r := <-s
	const want = `verifying round trip: the client's verifying message "another session" is not the session id`
	if r.err != nil || r.o.Theirs || r.o.Reason != want {
		t.Fatalf("server: %v, %v; want its own rejection %q", r.o, r.err, want)
	}
	<-st.toDial // step 1
	if v := <-st.toDial; v.Ok || !v.Verify || v.Error != want {
		t.Fatalf("the server's verdict: %v", v)
	}
	if opened || accept[0].Verified.Load() {
		t.Fatal("the server opened the session on a plane that failed to verify")
	}
}

// TestNegotiateWrongEcho: a server whose echo is not the session id makes
// the client reject the plane and say why in its own verdict.
func TestNegotiateWrongEcho(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	dial, accept := testLanes(t, verbs.RoleDial, 1), testLanes(t, verbs.RoleAccept, 1)
	st := newStream()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := negotiate(ctx, st.negotiation(verbs.RoleDial, dial, infos(accept)))
	// The server, by hand.
	if err := ConnectLanes(ctx, accept, infos(dial)); err != nil {
		t.Fatal(err)
	}
	st.toDial <- &pb.ConnectResult{Transport: pb.Transport_TRANSPORT_TCP, Ok: true}
	if msg, err := accept[0].RecvVerify(ctx); err != nil || string(msg) != testSession {
		t.Fatalf("the client's verifying message: %q, %v", msg, err)
	}
	if err := accept[0].SendVerify(ctx, []byte("bogus")); err != nil {
		t.Fatal(err)
	}
	<-st.toAccept // step 1
	const want = `verifying round trip: the server's verifying message "bogus" is not the session id`
	if v := <-st.toAccept; v.Ok || !v.Verify || v.Error != want {
		t.Fatalf("the client's verdict: %v", v)
	}
	st.toDial <- &pb.ConnectResult{Transport: pb.Transport_TRANSPORT_TCP, Verify: true, Error: "client: " + want}
	r := <-d
	if r.err != nil || r.o.Theirs || r.o.Reason != want {
		t.Fatalf("client: %v, %v; want its own rejection %q", r.o, r.err, want)
	}
	if dial[0].Verified.Load() {
		t.Fatal("the client's lane is verified on a rejected plane")
	}
}

// TestNegotiateUnexpectedResult: a connect result for another transport
// fails the session: with InvalidArgument on the server, whose own
// attempt stops at once.
func TestNegotiateUnexpectedResult(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	dial, accept := testLanes(t, verbs.RoleDial, 1), testLanes(t, verbs.RoleAccept, 1)
	st := newStream()
	st.toAccept <- &pb.ConnectResult{Transport: pb.Transport_TRANSPORT_SHM, Ok: true}
	_, err := Negotiate(context.Background(), st.negotiation(verbs.RoleAccept, accept, infos(dial)))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "expected the client's connect result") {
		t.Fatalf("Negotiate: %v, want InvalidArgument", err)
	}
}
