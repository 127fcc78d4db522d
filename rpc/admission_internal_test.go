// White-box: abusive peers speak the raw protocol and the tests read the server's admission accounting.

package rpc

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// fromAddr makes a Client's gRPC connection leave from the local address
// host (gRPC options keep calls on frames).
func fromAddr(host string) DialOption { return WithGRPCDialOptions(rpctest.DialFrom(host)) }

// abuseLanes dials clients from rpctest.AbuserAddr, each offering lanes lanes on
// tcp, until the server refuses one or max have opened; it returns the
// clients that opened, a func that closes and drops them, and the
// refusal. No dial may wait on anything: each
// returns within a few seconds (generous, for a loaded 2-core machine;
// before admission, a session past the control pool waited for its whole
// connect timeout).
func abuseLanes(t *testing.T, addr string, lanes, max int) ([]*Client, func(), error) {
	t.Helper()
	var held []*Client
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
		c, err := Dial(ctx, addr, WithTransports(TransportTCP), WithLanes(lanes), testPool(), insecureCreds(), fromAddr(rpctest.AbuserAddr))
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

// TestAdmissionControlPoolFull: when the control pool cannot hold a new
// session's receive slots, the session is refused with ResourceExhausted
// at once; it never waits on the pool for its connect timeout.
func TestAdmissionControlPoolFull(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP))
	hog, err := s.ctl.Alloc(ctxT(t), engine.ControlPoolLimit-(1<<20))
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

// stallSendStreams opens n SendStreams on api, each declaring a tensor of
// size bytes and sending one byte of it, then stalling; it returns each
// stream's verdict as it comes, and a func that ends them all.
func stallSendStreams(t *testing.T, api pb.TensorRPCClient, n, size int) (<-chan error, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	verdicts := make(chan error, n)
	in := wrapped(t, size, 1)
	defer in.Release()
	for i := range n {
		st, err := api.SendStream(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&pb.Chunk{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf(fmt.Sprint("stall", i), in.Tensor, false)}}}); err != nil {
			t.Fatal(err)
		}
		st.Send(&pb.Chunk{Data: in.Bytes()[:1]}) // an error here is the server's refusal, read below
		go func() { verdicts <- st.RecvMsg(new(pb.SendResponse)) }()
	}
	return verdicts, cancel
}

// verdictsWithin counts the verdicts that arrive within d, by code.
func verdictsWithin(ch <-chan error, d time.Duration) map[codes.Code]int {
	out := map[codes.Code]int{}
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case err := <-ch:
			out[status.Code(err)]++
		case <-timer.C:
			return out
		}
	}
}

// TestAdmissionStalledStreams: a peer that opens sessionless SendStreams,
// sends a byte of each and stalls gets its stream budget, past it
// ResourceExhausted at once; a new client on the grpc fallback still
// fetches, sends and calls, and the server's pool is back to empty once
// the abuser goes.
func TestAdmissionStalledStreams(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportGRPC))
	s.Handle("echo", echo(s))
	const streams = 80
	verdicts, stop := stallSendStreams(t, rpctest.RawConnFrom(t, addr, rpctest.AbuserAddr), streams, 8<<20)
	got := verdictsWithin(verdicts, 3*time.Second)
	if want := streams - DefaultAdmission.StreamsPerPeer; got[codes.ResourceExhausted] != want || len(got) != 1 {
		t.Fatalf("verdicts of %d stalled streams: %v, want %d ResourceExhausted and no other", streams, got, want)
	}
	dialVictim(t, s, addr, TransportGRPC, "while a peer stalls its streams")
	stop()
	waitFor(t, "the stalled streams' memory to be freed", func() bool { return s.Pool().Stats().InUse <= 1<<20 })
}

// streamUse is how many fallback streams peer has under way and what
// they hold against the budget.
func streamUse(s *Server, peer string) (streams int, bytes int64) {
	s.adm.mu.Lock()
	defer s.adm.mu.Unlock()
	if u := s.adm.peers[peer]; u != nil {
		return u.streams, u.streamBytes
	}
	return 0, 0
}

func streamsOf(s *Server, peer string) int {
	n, _ := streamUse(s, peer)
	return n
}

func streamBytesOf(s *Server, peer string) int64 {
	_, b := streamUse(s, peer)
	return b
}

// TestAdmissionStreamBytes: the tensors stalled SendStreams declare and
// the replies of unread FetchStreams are charged to the peer's stream byte
// budget: past it, ResourceExhausted at once, and another peer's streams
// go on.
func TestAdmissionStreamBytes(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportGRPC), WithAdmission(Admission{StreamBytesPerPeer: 32 << 20}))
	s.Handle("echo", echo(s))
	publishBytes(t, s, "big", 8<<20, 3)
	api := rpctest.RawConnFrom(t, addr, rpctest.AbuserAddr)
	verdicts, stop := stallSendStreams(t, api, 5, 8<<20)
	got := verdictsWithin(verdicts, 2*time.Second)
	if got[codes.ResourceExhausted] != 1 || len(got) != 1 {
		t.Fatalf("verdicts of 5 stalled streams of 8 MiB under a 32 MiB budget: %v, want 1 ResourceExhausted", got)
	}
	dialVictim(t, s, addr, TransportGRPC, "while a peer holds its stream bytes")
	stop()
	waitFor(t, "the stalled streams' charge to go", func() bool { return streamBytesOf(s, rpctest.AbuserAddr) == 0 })

	// Unread FetchStreams of an 8 MiB tensor: four fit.
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	for i := range 4 {
		if _, err := api.FetchStream(ctx, &pb.FetchRequest{Key: "big"}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, fmt.Sprint("FetchStream ", i, " to be charged"), func() bool { return streamBytesOf(s, rpctest.AbuserAddr) == int64(i+1)<<23 })
	}
	fs, err := api.FetchStream(ctx, &pb.FetchRequest{Key: "big"})
	if err == nil {
		_, err = fs.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fifth unread FetchStream of 8 MiB under a 32 MiB budget: %v, want ResourceExhausted", err)
	}
	dialVictim(t, s, addr, TransportGRPC, "while a peer leaves its FetchStreams unread")
	if st := s.Stats(); st.RefusedStreams != 2 {
		t.Errorf("Stats.RefusedStreams = %d, want 2", st.RefusedStreams)
	}
	cancel()
	waitFor(t, "the unread streams' charge to go", func() bool { return streamBytesOf(s, rpctest.AbuserAddr) == 0 })
}

// TestAdmissionTransfersPerSession: a session that fetches and never
// releases holds at most its TransfersPerSession transfers (each with a
// grant); the next Fetch fails with ResourceExhausted, the session goes
// on, and another session works.
func TestAdmissionTransfersPerSession(t *testing.T) {
	const limit = 8
	s, dial := attackServer(t, WithAdmission(Admission{TransfersPerSession: limit}))
	s.Handle("echo", echo(s))
	ctx := ctxT(t)
	publishBytes(t, s, "big", 1<<20, 3)
	victim, thief := dial(), dial()
	a := newAttacker(t, thief)
	ss := serverSessionByID(t, s, thief.SessionID())
	for i := range limit + 1 {
		pc, err := a.request(ctx, wire.FrameFetchReq, 0, uint64(100+i), []byte("big"), nil)
		if err != nil {
			t.Fatal(err)
		}
		r, ok := a.replyCrediting(ctx, pc, 10*time.Second)
		if !ok {
			t.Fatalf("fetch %d: no answer", i)
		}
		switch {
		case i < limit && r.Status != nil:
			t.Fatalf("fetch %d of %d: %v", i, limit, r.Status)
		case i == limit && status.Code(r.Status) != codes.ResourceExhausted:
			t.Fatalf("fetch %d past the session's %d transfers: %v, want ResourceExhausted", i, limit, r.Status)
		}
	}
	held := ss.Holding().Transfers
	if held != limit {
		t.Errorf("the session holds %d transfers, want %d", held, limit)
	}
	// (A FETCH_REQ may try twice: at once in the polling goroutine, then
	// on the call path; each refused attempt counts.)
	if st := s.Stats(); st.RefusedTransfers < 1 {
		t.Errorf("Stats.RefusedTransfers = %d, want the refusal counted", st.RefusedTransfers)
	}
	a.alive("past its transfers")
	victimWorks(t, s, victim, "while a session holds its transfers")
}

// TestAdmissionIdleSessionReaped: a session that makes no call and holds
// nothing for Admission.IdleSession is ended, and its Client opens a new
// one on its next call; a session waiting for a call's answer, or holding
// a transfer, is not idle.
func TestAdmissionIdleSessionReaped(t *testing.T) {
	const idle = 200 * time.Millisecond
	s, dial := attackServer(t, WithAdmission(Admission{IdleSession: idle}))
	ctx := ctxT(t)
	c := dial()
	first := c.SessionID()

	// A Fetch waiting for its key, over several idle periods.
	waited := make(chan error, 1)
	go func() {
		got, err := c.Fetch(ctx, "later", WaitForKey())
		if err == nil {
			got.Release()
		}
		waited <- err
	}()
	time.Sleep(5 * idle)
	publishBytes(t, s, "later", 1<<20, 1)
	if err := <-waited; err != nil {
		t.Fatalf("a Fetch waiting over the idle timeout: %v", err)
	}
	if c.SessionID() != first {
		t.Fatal("the session was ended while a call waited")
	}

	// A transfer held (fetched and never released), over several idle
	// periods.
	holder := dial()
	a := newAttacker(t, holder)
	pc, err := a.request(ctx, wire.FrameFetchReq, 0, 7, []byte("later"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := a.replyCrediting(ctx, pc, 10*time.Second); !ok || r.Status != nil {
		t.Fatalf("the holder's fetch: %v", r.Status)
	}

	// Nothing held: ended.
	waitFor(t, "the idle session to be ended", func() bool {
		for _, si := range s.Sessions() {
			if si.ID == first {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * idle)
	if slicesIndexFunc(s.Sessions(), func(si SessionInfo) bool { return si.ID == holder.SessionID() }) < 0 {
		t.Fatal("a session holding a transfer was ended as idle")
	}
	got, err := c.Fetch(ctx, "later")
	if err != nil {
		t.Fatalf("the next call after the idle session's end: %v", err)
	}
	got.Release()
	if c.SessionID() == first {
		t.Fatal("the call used the ended session")
	}
}

func slicesIndexFunc[T any](s []T, f func(T) bool) int {
	for i, v := range s {
		if f(v) {
			return i
		}
	}
	return -1
}

// TestHostileServerWithholdsCreditsBoundsReleases: a server that returns
// no credits leaves the client's releases queued; past maxQueuedReleases
// the client ends the session (which frees everything on the server)
// rather than let the queue grow, and its next call opens a new session.
func TestHostileServerWithholdsCreditsBoundsReleases(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	hs.ss.lanes[0].Frames.Cancel() // the server's creditor: no CREDIT frames
	s := c.last
	for i := range 2 * maxQueuedReleases {
		c.releaseRef(s, uint64(2*i+1))
	}
	deadline := time.Now().Add(10 * time.Second)
	for !sessionGone(c) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	queued := s.link.Frames.QueuedReleases()
	if !sessionGone(c) {
		t.Fatalf("the session goes on with %d releases queued", queued)
	}
	// (A RELEASE frame that could not go once the lane failed puts its
	// releases back: up to maxReleases more.)
	if queued > maxQueuedReleases+1+engine.MaxReleases {
		t.Errorf("%d releases queued, over the bound of %d", queued, maxQueuedReleases)
	}
	hs.serve.Store(true)
	w := wrapped(t, 100, 1)
	hs.s.Publish(ctxT(t), "k", w)
	w.Release()
	got, err := fetchBytes(ctxT(t), c, "k")
	if err != nil || len(got) != 100 {
		t.Fatalf("the next call: %d bytes, %v", len(got), err)
	}
}

// heapInUse is the process's live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestAdmissionAbusiveClient is the attack, all at once: one peer
// opens sessions of many lanes until refused, then bare sessions until
// refused, and stalls sessionless SendStreams and unread FetchStreams;
// meanwhile a new client on each plane (tcp, shm, the grpc fallback)
// connects and completes a Send, a Fetch and a Call. Once the abuser goes,
// the server's pools and heap are back to their baseline.
//
// Each victim's connect-and-calls is measured and logged; the test allows
// 5 s (the bound that matters is "promptly, not after a connect timeout
// or never"; a loaded 2-core CI machine needs the margin). It typically
// takes a few milliseconds.
func TestAdmissionAbusiveClient(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	planes := []string{TransportTCP, TransportSHM, TransportGRPC}
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(planes...), WithLanes(MaxLanes))
	s.Handle("echo", echo(s))
	publishBytes(t, s, "big", 8<<20, 3)
	baseHeap, basePool, baseCtl := heapInUse(), s.Pool().Stats().InUse, s.ctl.Stats().InUse

	// Sessions of 16 lanes (on tcp; shm alike) until refused.
	held, dropHeld, err := abuseLanes(t, addr, MaxLanes, 100)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("after %d sessions of %d lanes: %v, want ResourceExhausted", len(held), MaxLanes, err)
	}
	// Bare sessions until refused.
	api, closeAPI := rpctest.RawConnFromClosing(t, addr, rpctest.AbuserAddr)
	if n, err := rpctest.AbuseSessions(t, api, ProtocolVersion, 200); status.Code(err) != codes.ResourceExhausted || len(held)+n != DefaultAdmission.SessionsPerPeer {
		t.Fatalf("after %d more sessions: %v, want ResourceExhausted at %d in all", n, err, DefaultAdmission.SessionsPerPeer)
	}
	// Stalled SendStreams, then unread FetchStreams, until refused.
	streams := DefaultAdmission.StreamsPerPeer - 8
	verdicts, stopStreams := stallSendStreams(t, api, streams, 8<<20)
	waitFor(t, "the stalled streams to be admitted", func() bool { return streamsOf(s, rpctest.AbuserAddr) == streams })
	if got := verdictsWithin(verdicts, 100*time.Millisecond); len(got) != 0 {
		t.Fatalf("stalled streams within the budget: %v", got)
	}
	fctx, stopFetches := context.WithCancel(context.Background())
	defer stopFetches()
	unread := 0
	for ; unread < 100; unread++ {
		fs, err := api.FetchStream(fctx, &pb.FetchRequest{Key: "big"})
		if err != nil {
			t.Fatal(err)
		}
		if unread == 8 {
			// Past the stream budget: refused at once.
			if _, err := fs.Recv(); status.Code(err) != codes.ResourceExhausted {
				t.Fatalf("FetchStream %d past the stream budget: %v, want ResourceExhausted", unread, err)
			}
			break
		}
		waitFor(t, "the unread stream to be admitted", func() bool { return streamsOf(s, rpctest.AbuserAddr) == streams+unread+1 })
	}
	st := s.Stats()
	t.Logf("the abuser holds %d sessions (%d with lanes), %d streams; refused: %d sessions, %d lanes, %d streams; control pool %d MiB, pool %d MiB",
		DefaultAdmission.SessionsPerPeer, len(held), streams+8, st.RefusedSessions, st.RefusedLanes, st.RefusedStreams, s.ctl.Stats().InUse>>20, s.Pool().Stats().InUse>>20)

	for _, tr := range planes {
		if tr == TransportSHM {
			if p := defaultProvider(tr, slog.New(slog.DiscardHandler)); p != nil {
				if _, err := p.Devices(); err != nil {
					t.Logf("no shm device: %v", err)
					continue
				}
			}
		}
		start := time.Now()
		v, err := Dial(ctxT(t), addr, WithTransports(tr), testPool(), insecureCreds())
		if err != nil {
			t.Fatalf("a new client on %s under attack: %v", tr, err)
		}
		if v.Transport() != tr {
			t.Fatalf("a new client negotiated %s, want %s", v.Transport(), tr)
		}
		victimWorks(t, s, v, "a new client on "+tr+" under attack")
		el := time.Since(start)
		t.Logf("a new client on %s connected and made a Send, Fetch and Call in %v", tr, el)
		if el > 5*time.Second {
			t.Errorf("a new client on %s took %v under attack", tr, el)
		}
		if err := v.Close(); err != nil {
			t.Fatal(err)
		}
	}

	// The abuser goes.
	dropHeld()
	held = nil
	stopStreams()
	stopFetches()
	closeAPI()
	s.Unpublish("victim")
	waitFor(t, "the abuser's sessions to end", func() bool { return len(s.Sessions()) == 0 })
	waitFor(t, "the pools to be back to their baseline", func() bool {
		return s.Pool().Stats().InUse == basePool && s.ctl.Stats().InUse == baseCtl
	})
	waitFor(t, "the budgets to be free", func() bool {
		s.adm.mu.Lock()
		defer s.adm.mu.Unlock()
		return s.adm.total == usage{} && len(s.adm.peers) == 0
	})
	// The heap: what the attack made the server (and, in this process,
	// the abusive clients) allocate is garbage once they are gone.
	var heap uint64
	for range 50 {
		if heap = heapInUse(); heap <= baseHeap+8<<20 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("heap %d MiB at the baseline, %d MiB after the abuser went", baseHeap>>20, heap>>20)
	if heap > baseHeap+8<<20 {
		t.Errorf("heap %d MiB after the abuser went, baseline %d MiB", heap>>20, baseHeap>>20)
	}
}

// TestDripStreamIsDropped: a sessionless SendStream that sends a byte at a
// time, each well within the idle timeout, makes no progress that counts:
// it fails with DeadlineExceeded like a silent one and its memory is
// freed.
func TestDripStreamIsDropped(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	const idle = 300 * time.Millisecond
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportGRPC), WithStreamIdleTimeout(idle))
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	stream, err := rpctest.RawConn(t, addr).SendStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	in := wrapped(t, 64<<20, 1)
	defer in.Release()
	if err := stream.Send(&pb.Chunk{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf("drip", in.Tensor, false)}}}); err != nil {
		t.Fatal(err)
	}
	verdict := make(chan error, 1)
	go func() { verdict <- stream.RecvMsg(new(pb.SendResponse)) }()
	tick := time.NewTicker(idle / 4)
	defer tick.Stop()
	deadline := time.After(20 * idle)
	for {
		select {
		case err := <-verdict:
			if status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("a dripping stream: %v, want DeadlineExceeded", err)
			}
			waitFor(t, "the dripping stream's memory to be freed", func() bool { return s.Pool().Stats().InUse == 0 })
			return
		case <-tick.C:
			stream.Send(&pb.Chunk{Data: in.Bytes()[:1]})
		case <-deadline:
			t.Fatalf("a stream sending a byte every %v still runs after %v", idle/4, 20*idle)
		}
	}
}

// dialVictim dials a new, well-behaved client on plane from the test's
// own address and checks with victimWorks that it can Send, Fetch and
// Call (what: under which attack).
func dialVictim(t *testing.T, s *Server, addr, plane, what string) {
	t.Helper()
	victim, err := Dial(ctxT(t), addr, WithTransports(plane), testPool(), insecureCreds())
	if err != nil {
		t.Fatalf("a new client on %s %s: %v", plane, what, err)
	}
	defer victim.Close()
	victimWorks(t, s, victim, what)
}
