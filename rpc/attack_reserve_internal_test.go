// White-box: a hostile client plays with reserved Sends (SendRequest.reserve and commit).

package rpc

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func reserveMeta(key string, n int) *pb.TensorMeta {
	return &pb.TensorMeta{Key: key, Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{int64(n)}, ByteLength: uint64(n)}
}

// TestAttackReserveWithoutCommit: a client that speaks the frames itself
// reserves and never commits, reserves past its quota, commits what is
// not a reservation, commits another tensor than it reserved, commits
// without writing, and writes past its reservation. The server holds a
// reservation only as a charged transfer of the session, refuses past the
// quota, never publishes what it should not (nor what the pool held
// before), frees a reservation whose commit failed, ends the session on
// the stray write and then holds nothing; another session works
// throughout.
func TestAttackReserveWithoutCommit(t *testing.T) {
	const quota = 8 << 20
	s, dial := attackServer(t, WithSessionQuota(quota))
	s.Handle("echo", echo(s))
	ctx := ctxT(t)
	victim, thief := dial(), dial()
	cs, err := thief.session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	l := cs.lane()
	ss := serverSessionByID(t, s, thief.SessionID())
	charged := func() int64 {
		ss.mu.Lock()
		defer ss.mu.Unlock()
		return ss.reserved
	}
	if !cs.reservations {
		t.Fatal("the server did not announce reserved Sends")
	}

	// Stale bytes in the pool: a tensor published, then dropped.
	stale := wrapped(t, 1<<20, 0x5a)
	if err := thief.Send(ctx, "stale", stale); err != nil {
		t.Fatal(err)
	}
	stale.Release()
	s.Unpublish("stale")

	// A reservation never committed is a charged transfer, unpublished.
	const held = 4 << 20
	if _, _, err := thief.reserve(ctx, cs, l, reserveMeta("held", held)); err != nil {
		t.Fatal(err)
	}
	if h := ss.Holding(); h.Transfers != 1 || charged() != held {
		t.Fatalf("after a reserve: %+v, %d bytes charged", h, charged())
	}
	if _, err := s.Fetch(ctx, "held"); status.Code(err) != codes.NotFound {
		t.Fatalf("a reservation is published: %v", err)
	}

	// Past the quota: refused, nothing more held.
	if _, _, err := thief.reserve(ctx, cs, l, reserveMeta("over", quota-held+1)); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a reserve past the quota: %v", err)
	}
	if h := ss.Holding(); h.Transfers != 1 || charged() != held {
		t.Fatalf("after a refused reserve: %+v, %d bytes charged", h, charged())
	}

	// A fetched tensor's transfer is no reservation: the commit fails and
	// the transfer stays the client's to release.
	pub := wrapped(t, 1<<20, 3)
	if err := s.Publish(ctx, "pub", pub); err != nil {
		t.Fatal(err)
	}
	pub.Release()
	_, resp, err := framePlane{thief, cs}.ask(ctx, "pub", fetchOptions{})
	if err != nil || resp.TransferId == 0 {
		t.Fatalf("fetching: %v", err)
	}
	if err := thief.commit(ctx, cs, l, reserveMeta("pub2", 1<<20), resp.TransferId); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("committing a fetched transfer: %v", err)
	}
	if !ss.Has(resp.TransferId) {
		t.Fatal("a failed commit took a fetched transfer")
	}
	thief.releaseTransfer(cs, resp.TransferId)

	// A commit of another tensor than reserved fails and frees it.
	_, id, err := thief.reserve(ctx, cs, l, reserveMeta("k", 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	if err := thief.commit(ctx, cs, l, reserveMeta("other", 1<<20), id); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("committing another key: %v", err)
	}
	if ss.Has(id) || charged() != held {
		t.Fatalf("a failed commit left its reservation (%d bytes charged)", charged())
	}
	if err := thief.commit(ctx, cs, l, reserveMeta("k", 1<<20), id); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("committing a freed reservation: %v", err)
	}

	// A commit without writes publishes zeros, never what the pool held.
	_, id, err = thief.reserve(ctx, cs, l, reserveMeta("unwritten", 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	if err := thief.commit(ctx, cs, l, reserveMeta("unwritten", 1<<20), id); err != nil {
		t.Fatal(err)
	}
	got, err := s.Fetch(ctx, "unwritten")
	if err != nil || !bytes.Equal(got.Bytes(), make([]byte, 1<<20)) {
		t.Fatalf("an unwritten reservation published other bytes than zeros (%v)", err)
	}
	got.Release()
	s.Unpublish("unwritten")
	if charged() != held {
		t.Fatalf("after a commit, %d bytes charged, want %d", charged(), held)
	}

	// The Send method takes no reservation.
	if _, err := (service{Server: s}).Send(ctx, &pb.SendRequest{Meta: reserveMeta("m", 1<<20), Reserve: true}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a reserve by the Send method: %v", err)
	}

	// A Write past the reservation's end is refused and ends the session,
	// which frees the reservation held.
	loc, _, err := thief.reserve(ctx, cs, l, reserveMeta("edge", 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	src, err := thief.NewTensor(ctx, zerocopy.Uint8, []int64{4096})
	if err != nil {
		t.Fatal(err)
	}
	local, err := l.Domain.Reg.Local(src.buf)
	if err != nil {
		t.Fatal(err)
	}
	local.Length = 4096
	err = engine.WriteLanes(ctx, l, nil, local, verbs.Remote{Addr: loc.Address + loc.Length - 100, Key: loc.RemoteKey}, nil, func() {})
	if err == nil {
		t.Fatal("a Write past the reservation's end completed")
	}
	src.Release()
	s.Unpublish("pub")
	waitFor(t, "the session's end", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.sessions[ss.id] == nil
	})
	waitFor(t, "the server to free the reservations", func() bool { return s.Pool().Stats().InUse == 0 })
	for _, key := range []string{"held", "over", "pub2", "k", "other", "edge"} {
		if got, err := s.Fetch(ctx, key); err == nil {
			got.Release()
			t.Fatalf("%q published", key)
		}
	}
	victimWorks(t, s, victim, "after a hostile reserver")
}
