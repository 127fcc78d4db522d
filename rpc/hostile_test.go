package rpc_test

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

var _ = context.Background

// TestArenasShrinkAfterSpike: one 64 MiB request grows the server's pool;
// once the tensor is gone, the trimmer gives the memory back.
func TestArenasShrinkAfterSpike(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithTrimInterval(20 * time.Millisecond)}, nil)
	ctx := ctxT(t)
	before := s.Pool().Stats().Reserved
	spike := wrapped(t, 64<<20, 5)
	if err := c.Send(ctx, "spike", spike); err != nil {
		t.Fatal(err)
	}
	grown := s.Pool().Stats().Reserved
	if grown < 64<<20 {
		t.Fatalf("reserved %d → %d: the spike did not grow the pool", before, grown)
	}
	got, err := s.Take(ctx, "spike")
	if err != nil {
		t.Fatal(err)
	}
	got.Release()
	waitFor(t, "the pool to shrink", func() bool { return s.Pool().Stats().Reserved < grown-32<<20 })
	t.Logf("server pool reserved: %d before, %d at the spike, %d after", before, grown, s.Pool().Stats().Reserved)
}

// TestCrashedFallbackClientLeaksNothing: 20 FetchStreams of a 16 MiB
// tensor that the client never reads, then the client's connection drops
// without cancelling them: the server frees every chunk it had queued.
func TestCrashedFallbackClientLeaksNothing(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, stop := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportGRPC))
	ctx := ctxT(t)
	big, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	s.Publish(ctx, "big", big)
	big.Release()
	published := s.Pool().Stats().InUse
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	api := pb.NewTensorRPCClient(cc)
	for range 20 {
		if _, err := api.FetchStream(context.Background(), &pb.FetchRequest{Key: "big"}, chunkcodec.CallOptions()...); err != nil { // zero-copy chunks, as our clients get
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond) // the streams fill their flow-control windows
	cc.Close()                         // the client "crashes": its connection goes, nothing is cancelled
	s.Unpublish("big")
	waitFor(t, "the server to free the streams' buffers", func() bool { return s.Pool().Stats().InUse == 0 })
	t.Logf("published %d bytes; all freed", published)
	stop()
}

// TestSessionQuota: a session whose Send would bring more into the
// server than its quota fails with ResourceExhausted, for it alone: its
// session and other clients' Sends go on, and nothing stays allocated.
// (A pull that stays unanswered, TestStalePullEndsSession, ends the
// session.)
func TestSessionQuota(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP), rpc.WithPoolOptions(mempool.WithLimit(256<<20)),
		rpc.WithSessionQuota(64<<20), rpc.WithReservationTimeout(time.Second))
	ctx := ctxT(t)
	dial := func() *rpc.Client {
		c, err := rpc.Dial(ctx, addr, rpc.WithTransports(rpc.TransportTCP), testPool(), insecureCreds())
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	hoarder := dial()
	defer hoarder.Close()
	first := hoarder.SessionID()
	err := hoarder.Send(ctx, "hoard", wrapped(t, 80<<20, 1))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "WithSessionQuota") {
		t.Fatalf("a Send past the quota: %v, want ResourceExhausted naming WithSessionQuota", err)
	}
	victim := dial() // a new session opens
	defer victim.Close()
	if err := victim.Send(ctx, "fine", wrapped(t, 16<<20, 2)); err != nil {
		t.Fatalf("another client's Send: %v", err)
	}
	if err := hoarder.Send(ctx, "within", wrapped(t, 16<<20, 3)); err != nil || hoarder.SessionID() != first {
		t.Fatalf("the refused session's next Send: %v (session %s, was %s)", err, hoarder.SessionID(), first)
	}
	if _, err := s.Fetch(ctx, "hoard"); status.Code(err) != codes.NotFound {
		t.Fatalf("the refused tensor: %v, want NotFound", err)
	}
	s.Unpublish("within")
	got, err := s.Take(ctx, "fine")
	if err != nil {
		t.Fatal(err)
	}
	got.Release()
	waitFor(t, "the hoarded memory to be freed", func() bool { return s.Pool().Stats().InUse == 0 })
}

// TestGracefulStopWithStalledPeers: GracefulStop finishes within a bounded
// time with peers that stall every way the protocol allows: a Fetch
// waiting for a key nobody publishes, a Session stream that never sends
// its handshake, a session that never answers the plane choice, and a
// FetchStream whose reader never reads. Waiting calls fail Unavailable.
func TestGracefulStopWithStalledPeers(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), rpc.WithGracefulStopTimeout(2*time.Second))
	ctx := ctxT(t)
	big, err := s.NewTensor(ctx, 6, []int64{64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	s.Publish(ctx, "big", big)
	big.Release()

	c, err := rpc.Dial(ctx, addr, rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), testPool(), insecureCreds())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waiting := make(chan error, 1)
	go func() {
		_, err := c.Fetch(ctx, "never", rpc.WaitForKey())
		waiting <- err
	}()

	raw := rpctest.RawConn(t, addr)
	silent, err := raw.Session(ctx) // never sends its handshake
	if err != nil {
		t.Fatal(err)
	}
	_ = silent
	mute, err := raw.Session(ctx) // offers tcp, then never answers the choice
	if err != nil {
		t.Fatal(err)
	}
	if err := mute.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{
		ProtocolVersion: rpc.ProtocolVersion, Offers: []*pb.TransportOffer{{Transport: pb.Transport_TRANSPORT_TCP, Info: []byte("junk that is never connected")}},
	}}}); err != nil {
		t.Fatal(err)
	}
	stuck, err := raw.FetchStream(ctx, &pb.FetchRequest{Key: "big"}) // never read
	if err != nil {
		t.Fatal(err)
	}
	_ = stuck
	time.Sleep(100 * time.Millisecond) // let the server reach each stall

	done := make(chan struct{})
	start := time.Now()
	go func() { s.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("GracefulStop did not return within 60 s")
	}
	t.Logf("GracefulStop with stalled peers took %v", time.Since(start))
	if err := <-waiting; status.Code(err) != codes.Unavailable {
		t.Fatalf("Fetch waiting across GracefulStop: %v, want Unavailable", err)
	}
	for _, st := range []interface {
		Recv() (*pb.SessionResponse, error)
	}{silent, mute} {
		for {
			if _, err := st.Recv(); err != nil {
				break
			}
		}
	}
	for {
		if _, err := stuck.Recv(); err != nil {
			if err != io.EOF && status.Code(err) == codes.OK {
				t.Fatal(err)
			}
			break
		}
	}
}

// TestServerNeverDialsClientAddresses: a client's tcp offer names another
// host:port (and, as a RoleAny queue pair with the larger secret would
// have, asks to be dialled): the server only accepts, so nothing ever
// connects to that address, and the server's reasons name no address of
// its own network view.
func TestServerNeverDialsClientAddresses(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	victim, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	dialled := make(chan struct{}, 1)
	go func() {
		if c, err := victim.Accept(); err == nil {
			c.Close()
			dialled <- struct{}{}
		}
	}()
	_, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithTransports(rpc.TransportTCP, rpc.TransportGRPC), rpc.WithConnectTimeout(500*time.Millisecond))
	// A queue pair that advertises the victim's address.
	pd, err := tcp.New(tcp.WithAdvertiseAddress(victim.Addr().String())).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	cq, _ := pd.NewCompletionQueue(64)
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 8, MaxRecv: 8})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	st, err := rpctest.RawConn(t, addr).Session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{
		ProtocolVersion: rpc.ProtocolVersion, Offers: []*pb.TransportOffer{{Transport: pb.Transport_TRANSPORT_TCP, Info: qp.LocalInfo()}},
	}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil { // handshake
		t.Fatal(err)
	}
	choice, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if choice.GetChoice().GetTransport() != pb.Transport_TRANSPORT_TCP {
		t.Fatalf("server chose %v", choice.GetChoice())
	}
	// We never connect; the server's attempt times out and it reports.
	res, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	r := res.GetConnectResult()
	if r == nil || r.Ok {
		t.Fatalf("server's connect result: %v", res)
	}
	if strings.Contains(r.Error, victim.Addr().String()) {
		t.Errorf("the server's reason echoes the address: %q", r.Error)
	}
	select {
	case <-dialled:
		t.Fatal("the server dialled the address the client named")
	case <-time.After(200 * time.Millisecond):
	}
	st.CloseSend()
}
