// White-box: a hostile client posts one-sided operations on its session's link against grants.

package rpc

import (
	"bytes"
	"context"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestNoReadAfterRelease (tcp): a client asks for a Call whose reply is a
// large tensor, posts a Read through the reply's read grant and releases
// the transfer at once. Release revokes the grant, and Revoke waits for the
// read response already queued to leave, so the buffer goes back to the
// pool only then: the client never receives bytes the server writes there
// afterwards (before the fix it received about 60 MB of the next tensor).
func TestNoReadAfterRelease(t *testing.T) {
	const n = 64 << 20
	s, _, dial := hostileSetup(t, TransportTCP, 4096)
	ctx := ctxT(t)
	s.Handle("big", func(ctx context.Context, m *Message) (*Message, error) {
		out, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{n})
		if err != nil {
			return nil, err
		}
		clear(out.Bytes())
		return &Message{Tensors: []*Tensor{out}}, nil
	})
	c := dial()
	cs, api := rawSession(t, c)
	r, _, err := c.roundTrip(ctx, cs, cs.link, wire.FrameCallReq, 0, nil, &pb.CallRequest{Method: "big"}, answerOr(func() proto.Message { return &pb.CallResponse{} }), nil)
	resp, _ := r.Msg.(*pb.CallResponse)
	if err != nil || r.Status != nil || len(resp.GetTransferIds()) != 1 {
		t.Fatalf("Call: %+v, %v", r, err)
	}
	loc := resp.Tensors[0].Location
	buf, local := scratch(t, c, cs, n, 3)
	l := cs.link
	w := &engine.Waiter{Ch: make(chan verbs.Completion, 1)}
	id := l.NextID.Add(1)
	l.Mu.Lock()
	l.Waiters[id] = w
	l.Mu.Unlock()
	if err := l.QP.PostSend(verbs.SendRequest{ID: id, Op: verbs.OpRead, Local: local, Remote: verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.Release(ctx, &pb.ReleaseRequest{SessionId: cs.id, TransferIds: resp.TransferIds}); err != nil {
		t.Fatal(err)
	}
	// The server's next tensor reuses the buffer.
	other, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{n})
	if err != nil {
		t.Fatal(err)
	}
	ob := other.Bytes()
	t.Logf("reply buffer reused: %v", s.Pool() != nil && loc.Offset == uint64(other.buf.Offset()) && loc.RegionId == other.buf.Arena().ID())
	blk := bytes.Repeat([]byte{0xAB}, 1<<20)
	for hi := len(ob); hi > 0; hi -= len(blk) { // from the end, to meet the writer
		copy(ob[max(0, hi-len(blk)):hi], blk)
	}
	cpl := <-w.Ch
	other.Release()
	if cpl.Status != verbs.StatusSuccess {
		return // refused: the Release came before the Read's key check
	}
	leaked := bytes.Count(buf.Bytes(), []byte{0xAB})
	if leaked > 0 {
		t.Errorf("the Read, started before Release, returned %d bytes the server wrote into the buffer after Release returned", leaked)
	}
}
