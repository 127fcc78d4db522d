package rpc_test

import (
	"context"
	"strings"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
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
