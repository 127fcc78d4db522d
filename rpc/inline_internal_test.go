package rpc

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestRefusedTransferRevokesAside: a FETCH_REQ is answered where the
// lane's completions are handled, on shm the provider's receiver
// (fetchNow). When the transfer it made is refused (the session holds its
// TransfersPerSession), the grant it made is revoked; on shm that waits
// for the client to confirm it unmapped the grant, a message that same
// receiver reads: so it is revoked aside, the refusal arrives and the
// session lives on (revoked inline, the wait would end only with the
// deregister timeout, failing the lane).
func TestRefusedTransferRevokesAside(t *testing.T) {
	s, c := pair(t, TransportSHM, []ServerOption{WithAdmission(Admission{TransfersPerSession: 1})}, nil)
	ctx := ctxT(t)
	const n = 4 * DefaultEagerThreshold // a transfer, not inline
	publishBytes(t, s, "big", n, 5)
	a := newAttacker(t, c)

	// The first Fetch's transfer, read on the attacker's lane (which maps
	// the tensor's region there, so that later grants on it are announced
	// to the client and their revocation waits for it) and kept.
	pc, err := a.request(ctx, wire.FrameFetchReq, 0, 100, []byte("big"), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, rerr := a.answer("the first Fetch", pc)
	if rerr != nil {
		t.Fatalf("the first Fetch: %v", rerr)
	}
	loc := r.Msg.(*pb.FetchResponse).GetMeta().GetLocation()
	if loc == nil {
		t.Fatal("the first Fetch's answer names no transfer")
	}
	buf, err := c.pool.Alloc(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Release()
	local, err := a.l.Domain.Reg.Local(buf)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.l.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}}, nil); err != nil {
		t.Fatalf("reading the first transfer: %v", err)
	}

	// The second is refused: the session holds its one transfer.
	pc, err = a.request(ctx, wire.FrameFetchReq, 0, 101, []byte("big"), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, ok := a.replyCrediting(ctx, pc, 20*time.Second)
	if !ok {
		t.Fatal("the second Fetch: no answer")
	}
	if status.Code(r.Status) != codes.ResourceExhausted {
		t.Fatalf("the second Fetch, past the session's transfers: %v, want ResourceExhausted", r.Status)
	}
	a.alive("after a refused transfer's grant was revoked")
}
