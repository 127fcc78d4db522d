// White-box: attackers send hand-made frames on a session's links and read the server's session state.

package rpc

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Attacks on the server's frame handling, by a hostile client that speaks
// the frame protocol itself: it sends the frames it likes, returns the
// credits it likes and reads what it likes.

// attacker is a hostile client's lane: a real session whose link's
// creditor and releaser are stopped, so the frames it sends, and the
// credits they return, are the test's choice.
type attacker struct {
	t *testing.T
	c *Client
	s *clientSession
	l *engine.Link
}

func newAttacker(t *testing.T, c *Client) *attacker {
	t.Helper()
	s, err := c.session(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if s.link == nil || s.link.Frames == nil {
		t.Fatal("no frames on the attacker's session")
	}
	return newAttackerOn(t, c, s, s.link)
}

// newAttackerOn is an attacker on lane l of session s.
func newAttackerOn(t *testing.T, c *Client, s *clientSession, l *engine.Link) *attacker {
	l.Frames.Cancel() // no credit-only frames, no RELEASE frames: only ours
	return &attacker{t: t, c: c, s: s, l: l}
}

// owed takes n of the credits the client owes the server (all with n < 0).
func (a *attacker) owed(n int) uint32 {
	f := a.l.Frames
	f.Mu.Lock()
	defer f.Mu.Unlock()
	k := f.Unreturned
	if n >= 0 && uint32(n) < k {
		k = uint32(n)
	}
	f.Unreturned -= k
	return k
}

// credits is how many frames the attacker may send now (its reserve not
// counted).
func (a *attacker) credits() int {
	f := a.l.Frames
	f.Mu.Lock()
	defer f.Mu.Unlock()
	return f.Credits
}

// send sends one frame of h with body and releases, as given: it takes a
// credit of its own (the reserve for a CREDIT frame), so the server's
// slots are never overrun, and waits for the Send's completion.
func (a *attacker) send(ctx context.Context, h wire.FrameHeader, body []byte, releases []uint64) error {
	l := a.l
	if err := l.Acquire(ctx, h.Type == wire.FrameCredit); err != nil {
		return err
	}
	payload := engine.AppendReleases(slices.Clone(body), releases)
	h.Releases = uint16(len(releases))
	buf, err := l.CtlPool.Alloc(ctx, wire.FrameHeaderLen+len(payload))
	if err != nil {
		l.Frames.Refund(0, nil, nil)
		return err
	}
	b := buf.Bytes()[:wire.FrameHeaderLen+len(payload)]
	engine.PutFrameHeader(b, h, len(payload))
	copy(b[wire.FrameHeaderLen:], payload)
	local, err := l.Domain.Ctl.Local(buf)
	if err != nil {
		buf.Release()
		l.Frames.Refund(0, nil, nil)
		return err
	}
	local.Length = len(b)
	err = l.PostWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, func() { buf.Release() }, false, func() { l.Frames.Refund(0, nil, nil) })
	if err == nil {
		buf.Release()
	}
	return err
}

// request sends a request frame returning every credit owed, with a
// pending entry for its response.
func (a *attacker) request(ctx context.Context, typ uint8, flags uint16, ref uint64, body []byte, releases []uint64) (*engine.PendingCall, error) {
	pc := a.l.Frames.Expect(ref, responseTo[typ], func(flags uint16) proto.Message {
		switch {
		case typ == wire.FrameFetchReq:
			return &pb.FetchResponse{}
		case typ == wire.FrameSendReq:
			return &pb.SendResponse{}
		case flags&wire.FlagIndirect != 0:
			return &pb.TensorMeta{}
		}
		return &pb.CallResponse{}
	})
	err := a.send(ctx, wire.FrameHeader{Type: typ, Flags: flags, Ref: ref, Credits: a.owed(-1)}, body, releases)
	if err != nil {
		a.l.Frames.Forget(ref)
	}
	return pc, err
}

// reply waits for a response.
func (a *attacker) reply(pc *engine.PendingCall, within time.Duration) (engine.FrameReply, bool) {
	select {
	case <-pc.Ch:
		r := pc.Reply()
		return r, true
	case <-time.After(within):
		return engine.FrameReply{}, false
	}
}

// replyCrediting is reply by an attacker that, while it waits, returns
// the server the credits it owes (a CREDIT frame), as a client that takes
// its answers does.
func (a *attacker) replyCrediting(ctx context.Context, pc *engine.PendingCall, within time.Duration) (engine.FrameReply, bool) {
	deadline := time.After(within)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-pc.Ch:
			r := pc.Reply()
			return r, true
		case <-deadline:
			return engine.FrameReply{}, false
		case <-tick.C:
			if n := a.owed(-1); n > 0 {
				if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameCredit, Credits: n}, nil, nil); err != nil {
					a.t.Fatalf("returning %d credits: %v", n, err)
				}
			}
		}
	}
}

// marshal is a protobuf request body.
func marshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// frameCallGoroutines counts the goroutines the server started for frame
// calls (runFrameCall's), from a dump of every goroutine's stack.
func frameCallGoroutines() int {
	buf := make([]byte, 64<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), "created by github.com/tensorrpc/tensorrpc/rpc.(*Server).runFrameCall")
}

// TestAttackWithheldCreditsBoundGoroutines: a client that returns the
// server only the credit that restores its reserved slot (so the server's
// credit-only frames keep giving the client credits back) and never one
// for a response keeps sending requests: the calls that cannot answer
// pile up on the server, and their number must stay bounded (the calls
// under way, MaxFrameCalls, and as many refusals), whatever the client
// sends: past that the server ends the session.
func TestAttackWithheldCreditsBoundGoroutines(t *testing.T) {
	_, c, _ := framedPair(t, TransportTCP)
	a := newAttacker(t, c)
	ctx := ctxT(t)
	const requests = engine.MaxFrameCalls + 3000
	sent := 0
	deadline := time.Now().Add(30 * time.Second)
	for sent < requests && time.Now().Before(deadline) {
		if a.credits() > 0 {
			// A Fetch of a key nobody publishes: NotFound at once, if it
			// could answer.
			ref := uint64(sent + 1)
			if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameFetchReq, Ref: ref}, []byte("absent"), nil); err != nil {
				// The server ended the session (a defence too) when the send
				// failed because it closed the connection; the client learns
				// of the session's end a moment after its link does.
				if engine.PeerClosed(err) || strings.Contains(err.Error(), "peer closed") {
					waitFor(t, "the session's end after the server closed the connection", func() bool { return sessionGone(c) })
					break
				}
				if sessionGone(c) {
					break
				}
				t.Fatalf("request %d: %v", sent, err)
			}
			sent++
			continue
		}
		// Out of credits: one credit back, in a CREDIT frame on our
		// reserved slot, restores the server's reserved slot, on which its
		// creditor sends us the credits it owes.
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := a.send(cctx, wire.FrameHeader{Type: wire.FrameCredit, Credits: a.owed(1)}, nil, nil)
		cancel()
		if err != nil {
			if sessionGone(c) {
				break
			}
			t.Fatalf("after %d requests, a credit frame: %v", sent, err)
		}
		for wait := time.Now().Add(time.Second); a.credits() == 0 && time.Now().Before(wait); {
			time.Sleep(time.Millisecond)
		}
	}
	n := frameCallGoroutines()
	t.Logf("%d requests sent; %d frame-call goroutines on the server", sent, n)
	if n > 2*engine.MaxFrameCalls+64 {
		t.Fatalf("%d requests whose answers wait for credits hold %d goroutines on the server; want at most about 2×MaxFrameCalls (%d)", sent, n, 2*engine.MaxFrameCalls)
	}
	if !sessionGone(c) {
		t.Fatalf("%d requests without taking an answer (more than 2×MaxFrameCalls), and the session goes on", sent)
	}
}

// serverSessionByID is the server's session of a client.
func serverSessionByID(t *testing.T, s *Server, id string) *serverSession {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	ss := s.sessions[id]
	if ss == nil {
		t.Fatalf("no server session %s", id)
	}
	return ss
}

// alive fails the test when the attacker's session has ended.
func (a *attacker) alive(what string) {
	a.t.Helper()
	a.l.Mu.Lock()
	failure := a.l.Failure
	a.l.Mu.Unlock()
	if failure != nil || sessionGone(a.c) {
		a.t.Fatalf("%s: the session ended: %v", what, failure)
	}
}

// answer waits for pc's response and returns its status (nil for OK),
// failing the test when none comes or the server broke the format.
func (a *attacker) answer(what string, pc *engine.PendingCall) (engine.FrameReply, error) {
	a.t.Helper()
	r, ok := a.reply(pc, 20*time.Second)
	if !ok {
		a.t.Fatalf("%s: no response", what)
	}
	if r.Bad != nil {
		a.t.Fatalf("%s: a broken response: %v", what, r.Bad)
	}
	return r, r.Status
}

func refsBody(refs ...uint64) []byte { return engine.AppendReleases(nil, refs) }

// TestAttackReleaseStorm: RELEASE frames full of refs, and frames whose
// piggybacked releases name transfer ids the attacker does not hold (the
// ids another session holds among them), its own ids many times over, and
// refs of calls that never existed: the attacker's own transfer goes,
// nothing else; its session, and another one, go on; the released refs
// the server remembers stay bounded.
func TestAttackReleaseStorm(t *testing.T) {
	s, secret, dial := hostileSetup(t, TransportTCP, 1<<20)
	ctx := ctxT(t)
	victim, thief := dial(), dial()
	vs, err := victim.session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	vresp, err := victim.askFrame(ctx, vs, vs.link, "secret", fetchOptions{})
	if err != nil || vresp.TransferId == 0 {
		t.Fatalf("victim's fetch: %v, transfer %d", err, vresp.GetTransferId())
	}
	a := newAttacker(t, thief)
	pc, err := a.request(ctx, wire.FrameFetchReq, 0, 7, []byte("secret"), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.answer("attacker's fetch", pc)
	if err != nil {
		t.Fatal(err)
	}
	own := r.Msg.(*pb.FetchResponse).TransferId
	if own == 0 {
		t.Fatal("the attacker's fetch made no transfer")
	}
	tss := serverSessionByID(t, s, thief.SessionID())
	vss := serverSessionByID(t, s, victim.SessionID())

	ids := []uint64{own, own, vresp.TransferId, 0, ^uint64(0)}
	for i := range 59 {
		ids = append(ids, uint64(i+1))
	}
	maxRefs := (a.l.Frames.SlotSize - wire.FrameHeaderLen - 8*len(ids)) / 8
	for i := range 100 {
		refs := make([]uint64, maxRefs)
		for j := range refs {
			refs[j] = uint64(i*maxRefs + j)
		}
		refs[0] = 7
		if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameRelease, Credits: a.owed(-1)}, refsBody(refs...), ids); err != nil {
			t.Fatalf("RELEASE frame %d: %v", i, err)
		}
		// And on a request.
		pc, err := a.request(ctx, wire.FrameFetchReq, 0, uint64(1<<40+i), []byte("absent"), ids)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.answer("a fetch with releases", pc); status.Code(err) != codes.NotFound {
			t.Fatalf("a fetch with releases: %v, want NotFound", err)
		}
	}
	a.alive("after the storm")
	kept := tss.Has(own)
	remembered := tss.Holding().Released
	if kept {
		t.Error("the attacker's own released transfer is still held")
	}
	if remembered > engine.MaxReleasedRefs {
		t.Errorf("the server remembers %d released refs, want at most %d", remembered, engine.MaxReleasedRefs)
	}
	kept = vss.Has(vresp.TransferId)
	if !kept {
		t.Fatal("another session's releases freed the victim's transfer")
	}
	got, err := victim.receive(ctx, vs, vs.link, vresp.Meta, nil, vresp.TransferId, fetchOptions{})
	if err != nil {
		t.Fatalf("the victim reads its transfer after the storm: %v", err)
	}
	if !bytes.Equal(got.Bytes(), secret) {
		t.Fatal("the victim read other bytes")
	}
	got.Release()

	a.alive("after the storm")
}

// TestAttackRefReuse: requests that share a ref while the first is under
// way, and a RELEASE of a ref that never existed and then a request with
// it: the request whose ref was released is answered Canceled; calls a
// reused ref no longer names end when they can and hold nothing made
// under the released ref.
func TestAttackRefReuse(t *testing.T) {
	s, c, _ := framedPair(t, TransportTCP)
	ctx := ctxT(t)
	publishBytes(t, s, "big", 1<<20, 3)
	a := newAttacker(t, c)
	ss := serverSessionOf(t, s)

	// Released before it was ever used, then used.
	if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameRelease, Credits: a.owed(-1)}, refsBody(99), nil); err != nil {
		t.Fatal(err)
	}
	pc, err := a.request(ctx, wire.FrameFetchReq, wire.FlagWait, 99, []byte("never"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.answer("a waiting fetch with a released ref", pc); status.Code(err) != codes.Canceled {
		t.Fatalf("a waiting fetch with a released ref: %v, want Canceled", err)
	}

	// Two waiting calls under one ref; the client expects one answer per
	// request, so count what comes.
	const ref = 1234
	answers := make(chan engine.FrameReply, 8)
	pcs := make([]*engine.PendingCall, 0, 3)
	for i := range 3 {
		pc, err := a.request(ctx, wire.FrameFetchReq, wire.FlagWait, ref, fmt.Appendf(nil, "never%d", i), nil)
		if err != nil {
			t.Fatal(err)
		}
		pcs = append(pcs, pc)
	}
	// The pending entry is the last one's; answers to the others are
	// dropped by the client, so watch the server's calls instead.
	waitFor(t, "three calls under one ref", func() bool {
		return ss.Holding().InFlight == 3
	})
	if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameRelease, Credits: a.owed(-1)}, refsBody(ref), nil); err != nil {
		t.Fatal(err)
	}
	go func() {
		if r, ok := a.reply(pcs[2], 10*time.Second); ok {
			answers <- r
		}
	}()
	select {
	case r := <-answers:
		if status.Code(r.Status) != codes.Canceled {
			t.Fatalf("a released call: %v, want Canceled", r.Status)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the released call was not answered")
	}
	// The calls the ref named before are no longer the ref's; they end
	// when their keys come, and the ref being released, they hold nothing.
	for i := range 2 {
		publishBytes(t, s, fmt.Sprintf("never%d", i), 1<<20, byte(i))
	}
	waitFor(t, "every call under the reused ref to end", func() bool {
		h := ss.Holding()
		return h.InFlight == 0 && h.Calls == 0
	})
	held := ss.Holding().Transfers
	if held != 0 {
		t.Fatalf("%d transfers made under a released ref", held)
	}
	a.alive("after reused refs")
}

// TestAttackMalformedRequests: SEND_REQ and CALL_REQ whose bodies break
// the rules each get one response with the error, and the session goes on.
func TestAttackMalformedRequests(t *testing.T) {
	s, c, _ := framedPair(t, TransportTCP)
	ctx := ctxT(t)
	s.Handle("count", func(ctx context.Context, in *Message) (*Message, error) {
		return &Message{Metadata: fmt.Appendf(nil, "%d", len(in.Tensors))}, nil
	})
	publishBytes(t, s, "big", 1<<20, 3)
	a := newAttacker(t, c)
	const n = 1 << 20
	src := wrapped(t, n, 4)
	defer src.Release()
	meta := func() *pb.TensorMeta { return metaOf("k", src.Tensor, false) }
	loc, free, err := c.grantSource(ctx, a.s, a.l, outgoing{meta: meta(), t: src})
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	located := func(f func(m *pb.TensorMeta)) *pb.TensorMeta {
		m := meta()
		m.Location = proto.Clone(loc).(*pb.Location)
		if f != nil {
			f(m)
		}
		return m
	}
	// A transfer the attacker holds (a fetch's), to name as a held one.
	pc, err := a.request(ctx, wire.FrameFetchReq, 0, 5, []byte("big"), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.answer("fetch", pc)
	if err != nil {
		t.Fatal(err)
	}
	fetched := r.Msg.(*pb.FetchResponse).TransferId
	idx := func(i uint32) *uint32 { return &i }
	small := metaOf("", wrapped(t, 8, 1).Tensor, false)
	small.InlineIndex = idx(0)

	cases := []struct {
		name string
		typ  uint8
		body []byte
		want codes.Code
	}{
		{"send/garbage", wire.FrameSendReq, []byte{0xff, 0xff, 0xff}, codes.InvalidArgument},
		{"send/no-meta", wire.FrameSendReq, nil, codes.InvalidArgument},
		{"send/location-length", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) { m.Location.Length = 2 * n })}), codes.InvalidArgument},
		{"send/location-short", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) { m.Location.Length = 1 })}), codes.InvalidArgument},
		{"send/shape", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) { m.Shape = []int64{10} })}), codes.InvalidArgument},
		{"send/negative-shape", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) { m.Shape = []int64{-n} })}), codes.InvalidArgument},
		{"send/transport", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) { m.Location.Transport = pb.Transport_TRANSPORT_SHM })}), codes.InvalidArgument},
		{"send/huge", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) {
			m.Shape, m.ByteLength, m.Location.Length = []int64{1 << 50}, 1<<50, 1<<50
		})}), codes.ResourceExhausted},
		{"send/inline-and-location", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(nil), InlineData: []byte{1}}), codes.InvalidArgument},
		{"send/inline-length", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: metaOf("k", wrapped(t, 100, 1).Tensor, false), InlineData: make([]byte, 10)}), codes.InvalidArgument},
		{"send/lanes-on-one-lane", wire.FrameSendReq, marshal(t, &pb.SendRequest{Meta: located(func(m *pb.TensorMeta) {
			m.Location.Lanes = []*pb.LaneRemote{{Address: 1, RemoteKey: 2}, {Address: ^uint64(0), RemoteKey: 3}, {}}
		})}), codes.OK},
		{"call/garbage", wire.FrameCallReq, []byte{0x0a, 0xff}, codes.InvalidArgument},
		{"call/unknown-method", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "nope"}), codes.Unimplemented},
		{"call/inline-index", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "count", Tensors: []*pb.TensorMeta{small}}), codes.InvalidArgument},
		{"call/location-length", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "count", Tensors: []*pb.TensorMeta{located(func(m *pb.TensorMeta) { m.Location.Length = n - 1 })}}), codes.InvalidArgument},
		{"call/unknown-transfer", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "count", Tensors: []*pb.TensorMeta{{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n, TransferId: 12345}}}), codes.InvalidArgument},
		{"call/fetched-transfer", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "count", Tensors: []*pb.TensorMeta{{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n, TransferId: fetched}}}), codes.InvalidArgument},
		{"call/location-and-transfer", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "count", Tensors: []*pb.TensorMeta{located(func(m *pb.TensorMeta) { m.TransferId = fetched })}}), codes.InvalidArgument},
		{"call/nil-tensor", wire.FrameCallReq, marshal(t, &pb.CallRequest{Method: "count", Tensors: []*pb.TensorMeta{nil}}), codes.InvalidArgument},
	}
	for i, tc := range cases {
		pc, err := a.request(ctx, tc.typ, 0, uint64(100+i), tc.body, nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		_, err = a.answer(tc.name, pc)
		if status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		a.alive(tc.name)
	}
	a.send(ctx, wire.FrameHeader{Type: wire.FrameRelease, Credits: a.owed(-1)}, nil, []uint64{fetched})
	ss := serverSessionOf(t, s)
	waitFor(t, "the attacker's transfers to go", func() bool {
		if ss.Holding().Transfers != 0 {
			return false
		}
		ss.mu.Lock()
		defer ss.mu.Unlock()
		return ss.reserved == 0
	})
}

// attackServer is a server on tcp (and grpc) with opts, and a way to dial
// clients to it; every client is closed and the server stopped (its pool
// checked) at the end, and no goroutine may be left.
func attackServer(t *testing.T, opts ...ServerOption) (*Server, func(...DialOption) *Client) {
	t.Helper()
	t.Cleanup(func() { leakcheck.Check(t) })
	ts := WithTransports(TransportTCP, TransportGRPC)
	s, addr, _ := serveOn(t, "127.0.0.1:0", append([]ServerOption{ts}, opts...)...)
	dial := func(extra ...DialOption) *Client {
		t.Helper()
		c, err := Dial(ctxT(t), addr, append([]DialOption{ts, testPool(), insecureCreds()}, extra...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if err := c.Connect(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if c.Transport() != TransportTCP {
			t.Fatalf("negotiated %s", c.Transport())
		}
		return c
	}
	return s, dial
}

// victimWorks checks that another session's Fetch, Send and Call work.
func victimWorks(t *testing.T, s *Server, v *Client, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in := wrapped(t, 1<<20, 6)
	defer in.Release()
	if err := v.Send(ctx, "victim", in); err != nil {
		t.Fatalf("%s: the victim's Send: %v", what, err)
	}
	got, err := v.Fetch(ctx, "victim")
	if err != nil {
		t.Fatalf("%s: the victim's Fetch: %v", what, err)
	}
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatalf("%s: the victim fetched other bytes", what)
	}
	got.Release()
	reply, err := v.Call(ctx, "echo", &Message{Metadata: []byte("hi"), Tensors: []*Tensor{in}})
	if err != nil {
		t.Fatalf("%s: the victim's Call: %v", what, err)
	}
	if !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
		t.Fatalf("%s: the victim's Call answered other bytes", what)
	}
	reply.Release()
}

// TestAttackStalledClientAndGracefulStop: a client whose calls cannot be
// answered (it returns no credits, or its polling stops and it reads
// nothing more) leaves the server's calls waiting for credits: another
// session's calls go on, and GracefulStop still returns in bounded time,
// freeing everything.
func TestAttackStalledClientAndGracefulStop(t *testing.T) {
	for _, mode := range []string{"no-credits", "stopped-reader"} {
		t.Run(mode, func(t *testing.T) {
			s, dial := attackServer(t, WithGracefulStopTimeout(300*time.Millisecond))
			s.Handle("echo", echo(s))
			ctx := ctxT(t)
			publishBytes(t, s, "big", 1<<20, 2)
			victim, thief := dial(), dial()
			a := newAttacker(t, thief)
			ss := serverSessionByID(t, s, thief.SessionID())
			// Waiting Fetches, answered all at once later: more than the
			// server has credits for.
			const waiting = 100
			for i := range waiting {
				credits := uint32(0)
				if mode == "stopped-reader" {
					credits = a.owed(-1)
				}
				if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameFetchReq, Flags: wire.FlagWait, Ref: uint64(i + 1), Credits: credits}, []byte("later"), nil); err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
			}
			waitFor(t, "the waiting calls", func() bool {
				return ss.Holding().InFlight == waiting
			})
			if mode == "stopped-reader" {
				// The client's polling goroutine blocks on the answer to
				// this one: from then on it reads and reposts nothing.
				block := &engine.PendingCall{Ch: make(chan struct{}), Want: wire.FrameFetchResp, Into: func(uint16) proto.Message { return &pb.FetchResponse{} }}
				a.l.Frames.Mu.Lock()
				a.l.Frames.Pending[1<<50] = block
				a.l.Frames.Mu.Unlock()
				t.Cleanup(func() {
					select {
					case <-block.Ch: // let it go before the client closes
					case <-time.After(10 * time.Second):
					}
				})
				if err := a.send(ctx, wire.FrameHeader{Type: wire.FrameFetchReq, Ref: 1 << 50, Credits: a.owed(-1)}, []byte("big"), nil); err != nil {
					t.Fatal(err)
				}
			}
			publishBytes(t, s, "later", 100, 1)
			waitFor(t, "the server to run out of credits", func() bool {
				l := ss.lanes[0]
				l.Frames.Mu.Lock()
				defer l.Frames.Mu.Unlock()
				return l.Frames.Credits == 0
			})
			victimWorks(t, s, victim, "while a client stalls")
			stuck := ss.Holding().InFlight
			if stuck == 0 {
				t.Fatal("no call waits for credits: the attack did not take")
			}
			start := time.Now()
			done := make(chan struct{})
			go func() {
				s.GracefulStop()
				close(done)
			}()
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				t.Fatalf("GracefulStop with %d calls waiting for credits did not return in 15 s", stuck)
			}
			t.Logf("GracefulStop with %d calls waiting for credits: %v", stuck, time.Since(start))
			if n := s.Pool().Stats().InUse; n != 0 {
				t.Fatalf("after GracefulStop, %d bytes of the pool in use", n)
			}
		})
	}
}

// TestAttackSessionEndsMidPull: a client that ends its session, or revokes
// the grant, while the server Reads the tensor its SEND_REQ or CALL_REQ
// named: nothing is published or run with it, the server frees what it
// allocated, and another session goes on.
func TestAttackSessionEndsMidPull(t *testing.T) {
	for _, mode := range []string{"close", "revoke", "kill-lane"} {
		for _, typ := range []uint8{wire.FrameSendReq, wire.FrameCallReq} {
			t.Run(fmt.Sprintf("%s/%d", mode, typ), func(t *testing.T) {
				s, dial := attackServer(t)
				ran := make(chan struct{}, 1)
				s.Handle("echo", func(ctx context.Context, in *Message) (*Message, error) {
					ran <- struct{}{}
					return echo(s)(ctx, in)
				})
				ctx := ctxT(t)
				victim, thief := dial(), dial()
				a := newAttacker(t, thief)
				const n = 64 << 20
				src, err := thief.NewTensor(ctx, zerocopy.Uint8, []int64{n})
				if err != nil {
					t.Fatal(err)
				}
				defer src.Release()
				meta := metaOf("midpull", src.Tensor, false)
				loc, free, err := thief.grantSource(ctx, a.s, a.l, outgoing{meta: meta, t: src})
				if err != nil {
					t.Fatal(err)
				}
				meta.Location = loc
				body := marshal(t, &pb.SendRequest{Meta: meta})
				if typ == wire.FrameCallReq {
					body = marshal(t, &pb.CallRequest{Method: "echo", Tensors: []*pb.TensorMeta{meta}})
				}
				ss := serverSessionByID(t, s, thief.SessionID())
				pc, err := a.request(ctx, typ, 0, 1, body, nil)
				if err != nil {
					t.Fatal(err)
				}
				waitFor(t, "the server's Read", func() bool { return ss.lanes[0].Reads.Load() > 0 })
				switch mode {
				case "close":
					thief.Close()
					free()
				case "revoke":
					free()
				case "kill-lane":
					a.l.Close(fmt.Errorf("the attacker pulls the plug"))
					free()
				}
				// The session ends, or (a Read done before the revocation took)
				// the request is answered.
				answer := endedOrAnswered(t, s, ss, pc, "the server to end the session or answer")
				if answer != nil {
					// What the answer holds (a Call's reply) goes with the
					// session.
					t.Logf("answered: %v", answer.Status)
					thief.Close()
					waitFor(t, "the session's end", func() bool {
						s.mu.Lock()
						defer s.mu.Unlock()
						return s.sessions[ss.id] == nil
					})
				}
				if got, err := s.Fetch(ctx, "midpull"); err == nil {
					// The Read may have finished before the end: then it
					// was published whole.
					if !bytes.Equal(got.Bytes(), src.Bytes()) {
						t.Error("a tensor published from a Read cut short")
					}
					got.Release()
					s.Unpublish("midpull")
				}
				select {
				case <-ran:
					t.Log("the handler ran (the Read finished first)")
				default:
				}
				waitFor(t, "the server to free the pulled buffer", func() bool { return s.Pool().Stats().InUse == 0 })
				victimWorks(t, s, victim, "after a session ended mid-pull")
			})
		}
	}
}

// TestAttackServerOnlyFrames: frames only a server sends, and a request
// that returns credits never taken, end the attacker's session (the
// frame protocol's rule) and nothing else: its next call opens a new one.
func TestAttackServerOnlyFrames(t *testing.T) {
	ok := engine.AppendStatus(nil, nil, 64)
	cases := []struct {
		name string
		h    wire.FrameHeader
		body []byte
	}{
		{"fetch-resp-indirect", wire.FrameHeader{Type: wire.FrameFetchResp, Flags: wire.FlagIndirect, Ref: 1}, ok},
		{"send-resp", wire.FrameHeader{Type: wire.FrameSendResp, Ref: 1}, ok},
		{"call-resp", wire.FrameHeader{Type: wire.FrameCallResp, Ref: 1}, ok},
		{"call-resp-indirect", wire.FrameHeader{Type: wire.FrameCallResp, Flags: wire.FlagIndirect, Ref: 1}, ok},
		{"request-overpays", wire.FrameHeader{Type: wire.FrameFetchReq, Ref: 1, Credits: 1 << 31}, []byte("big")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, c, _ := framedPair(t, TransportTCP)
			publishBytes(t, s, "big", 1<<20, 1)
			a := newAttacker(t, c)
			a.send(ctxT(t), tc.h, tc.body, nil) // may fail: the server ends the plane
			waitFor(t, "the session to end", func() bool { return sessionGone(c) })
			got, err := c.Fetch(ctxT(t), "big")
			if err != nil {
				t.Fatalf("fetch on a new session: %v", err)
			}
			got.Release()
		})
	}
}

// TestAttackForeignLane: on a session with two lanes, a SEND_REQ on one
// lane whose location is a grant made on the other (alone, or as the
// stripes of a striped location): the grant opens the buffer to the other
// queue pair only, so the Read is refused; nothing is published, the
// server frees what it allocated, and another session goes on.
func TestAttackForeignLane(t *testing.T) {
	for _, striped := range []bool{false, true} {
		t.Run(fmt.Sprintf("striped=%v", striped), func(t *testing.T) {
			s, dial := attackServer(t, WithLanes(2))
			s.Handle("echo", echo(s))
			ctx := ctxT(t)
			victim, thief := dial(WithLanes(2)), dial(WithLanes(2))
			ts, err := thief.session(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(ts.lanes) != 2 {
				t.Fatalf("%d lanes negotiated, want 2", len(ts.lanes))
			}
			a := newAttackerOn(t, thief, ts, ts.lanes[1])
			n := 1 << 20
			if striped {
				n = 16 << 20
			}
			src := wrapped(t, n, 3)
			defer src.Release()
			meta := metaOf("foreign", src.Tensor, false)
			// Granted on lane 0, as one grant: no stripes of its own.
			single := &clientSession{lanes: ts.lanes[:1], transport: ts.transport}
			loc, free, err := thief.grantSource(ctx, single, ts.lanes[0], outgoing{meta: meta, t: src})
			if err != nil {
				t.Fatal(err)
			}
			defer free()
			if striped {
				r := &pb.LaneRemote{Address: loc.Address, RemoteKey: loc.RemoteKey}
				loc.Lanes = []*pb.LaneRemote{r, r}
			}
			meta.Location = loc
			ss := serverSessionByID(t, s, thief.SessionID())
			pc, err := a.request(ctx, wire.FrameSendReq, 0, 1, marshal(t, &pb.SendRequest{Meta: meta}), nil)
			if err != nil {
				t.Fatal(err)
			}
			answer := endedOrAnswered(t, s, ss, pc, "the server to refuse")
			if answer != nil && answer.Status == nil {
				t.Fatal("a Read through another lane's grant succeeded")
			}
			if got, err := s.Fetch(ctx, "foreign"); err == nil {
				got.Release()
				t.Fatal("the tensor was published")
			}
			waitFor(t, "the server to free what it allocated", func() bool { return s.Pool().Stats().InUse == 0 })
			victimWorks(t, s, victim, "after a foreign-lane read")
		})
	}
}

// manyTensors is a framed pair whose server counts a call's tensors
// ("count"), an attacker on it, and two CALL_REQ bodies that fill a slot
// with tensors: hundreds located on one grant of the attacker's, and
// thousands inline naming the same inline bytes; with their counts.
func manyTensors(t *testing.T) (*Server, *attacker, []byte, int, []byte, int) {
	s, c, _ := framedPair(t, TransportTCP)
	s.Handle("count", func(ctx context.Context, in *Message) (*Message, error) {
		return &Message{Metadata: fmt.Appendf(nil, "%d", len(in.Tensors))}, nil
	})
	ctx := ctxT(t)
	a := newAttacker(t, c)
	const n = 64
	src := wrapped(t, 1<<20, 3)
	t.Cleanup(src.Release)
	loc, free, err := c.grantSource(ctx, a.s, a.l, outgoing{meta: metaOf("", src.Tensor, false), t: src})
	if err != nil {
		t.Fatal(err)
	}
	tiny := metaOf("", wrapped(t, n, 1).Tensor, false)
	fill := func(next func(i int) *pb.TensorMeta, inline [][]byte) (*pb.CallRequest, []byte) {
		req := &pb.CallRequest{Method: "count", InlineData: inline}
		body := marshal(t, req)
		for i := 0; ; i++ {
			req.Tensors = append(req.Tensors, next(i))
			b := marshal(t, req)
			if wire.FrameHeaderLen+len(b) > a.l.Frames.SlotSize {
				req.Tensors = req.Tensors[:len(req.Tensors)-1]
				return req, body
			}
			body = b
		}
	}
	located, lbody := fill(func(i int) *pb.TensorMeta {
		m := proto.Clone(tiny).(*pb.TensorMeta)
		m.Location = &pb.Location{Transport: loc.Transport, RemoteKey: loc.RemoteKey, Address: loc.Address + uint64(i%(1<<14)*n), Length: n}
		return m
	}, nil)
	inlined, ibody := fill(func(int) *pb.TensorMeta {
		m := proto.Clone(tiny).(*pb.TensorMeta)
		zero := uint32(0)
		m.InlineIndex = &zero
		return m
	}, [][]byte{make([]byte, n)})
	t.Cleanup(free)
	return s, a, lbody, len(located.Tensors), ibody, len(inlined.Tensors)
}

// TestAttackManyTensors: CALL_REQs that fill a slot with tensors (hundreds
// located on one grant, thousands inline naming the same inline bytes):
// each call gets its tensors, and once the calls are answered the server
// holds nothing more.
func TestAttackManyTensors(t *testing.T) {
	s, a, lbody, nl, ibody, ni := manyTensors(t)
	ctx := ctxT(t)
	before := s.Pool().Stats().InUse
	for i, body := range [][]byte{lbody, ibody, lbody, ibody} {
		want := nl
		if i%2 == 1 {
			want = ni
		}
		pc, err := a.request(ctx, wire.FrameCallReq, 0, uint64(i+1), body, nil)
		if err != nil {
			t.Fatal(err)
		}
		r, err := a.answer(fmt.Sprintf("a call of %d tensors", want), pc)
		if err != nil {
			t.Fatalf("a call of %d tensors: %v", want, err)
		}
		if got := string(r.Msg.(*pb.CallResponse).Metadata); got != fmt.Sprint(want) {
			t.Fatalf("the handler got %s tensors, want %d", got, want)
		}
	}
	a.alive("after calls with many tensors")
	waitFor(t, "the calls' tensors to be freed", func() bool { return s.Pool().Stats().InUse == before })
}

// TestAttackFullSendQueueLosesAnswers: calls whose located tensors are
// many (a slot holds hundreds), a few at once, fill the lane's send queue
// with the server's Reads (sendDepth); the response frames of other calls
// of the session, posted meanwhile, must still go: every request is
// answered exactly once, so no caller waits for ever.
func TestAttackFullSendQueueLosesAnswers(t *testing.T) {
	s, a, lbody, nl, ibody, ni := manyTensors(t)
	ctx := ctxT(t)
	before := s.Pool().Stats().InUse
	ss := serverSessionOf(t, s)
	var pcs []*engine.PendingCall
	var want []int
	empty := marshal(t, &pb.CallRequest{Method: "count"})
	calls := 48
	if rpctest.Race {
		calls = 6 // 2 of them still post 1,318 Reads, past sendDepth
	}
	for i := range calls {
		body, k := empty, 0
		switch i % 3 {
		case 0:
			body, k = lbody, nl
		case 1:
			body, k = ibody, ni
		}
		pc, err := a.request(ctx, wire.FrameCallReq, 0, uint64(i+1), body, nil)
		if err != nil {
			t.Fatal(err)
		}
		pcs, want = append(pcs, pc), append(want, k)
	}
	exhausted := 0
	for i, pc := range pcs {
		r, ok := a.replyCrediting(ctx, pc, 20*time.Second)
		if !ok {
			running := ss.Running(uint64(i + 1))
			t.Fatalf("call %d (of %d tensors) was never answered (still running on the server: %v)", i, want[i], running)
		}
		err := r.Status
		if status.Code(err) == codes.ResourceExhausted && i%3 == 0 {
			exhausted++ // the located calls' Reads may fill the send queue
			continue
		}
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if got := string(r.Msg.(*pb.CallResponse).Metadata); got != fmt.Sprint(want[i]) {
			t.Fatalf("call %d: the handler got %s tensors, want %d", i, got, want[i])
		}
	}
	t.Logf("%d calls refused for a full send queue", exhausted)
	a.alive("after calls with many tensors")
	waitFor(t, "the calls' tensors to be freed", func() bool { return s.Pool().Stats().InUse == before })
}

// endedOrAnswered waits until the server has ended ss or pc's response
// has come, and returns the response, nil when the session ended first.
func endedOrAnswered(t *testing.T, s *Server, ss *serverSession, pc *engine.PendingCall, what string) *engine.FrameReply {
	t.Helper()
	var answer *engine.FrameReply
	waitFor(t, what, func() bool {
		select {
		case <-pc.Ch:
			r := pc.Reply()
			answer = &r
		default:
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.sessions[ss.id] == nil || answer != nil
	})
	return answer
}
