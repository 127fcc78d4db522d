package rpc

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestMisdirectedWriteImmPublishesNothing: a client holds two
// destinations, X and Y, of the same size, and writes all n bytes into Y's
// grant with X's immediate value. X was never written: publishing it would
// hand the client whatever its pool buffer held before (here a tensor the
// server released; it could be another session's). The server sees that
// the write did not go through X's grant and publishes nothing. (Found by
// a review; the same test then showed the released tensor's bytes.)
func TestMisdirectedWriteImmPublishesNothing(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			const n = 64 << 10
			s, _, dial := hostileSetup(t, tr, 4096)
			ctx := ctxT(t)

			// Some other tenant's data passes through the server's pool and is
			// released.
			old, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{n})
			if err != nil {
				t.Fatal(err)
			}
			pattern(old.Bytes(), 77)
			secret := bytes.Clone(old.Bytes())
			old.Release()

			c := dial()
			cs, api := rawSession(t, c)
			mx := &pb.TensorMeta{Key: "X", Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}
			rx, err := api.Send(ctx, &pb.SendRequest{SessionId: cs.id, Meta: mx, ClientRef: 4001})
			if err != nil {
				t.Fatal(err)
			}
			my := &pb.TensorMeta{Key: "Y", Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}
			ry, err := api.Send(ctx, &pb.SendRequest{SessionId: cs.id, Meta: my, ClientRef: 4002})
			if err != nil {
				t.Fatal(err)
			}
			_, local := scratch(t, c, cs, n, 9)
			// n bytes into Y's grant, naming X.
			if err := cs.link.post(ctx, writeImm(local, ry.Destination.Address, ry.Destination.RemoteKey, rx.Immediate), nil); err != nil {
				t.Fatalf("misdirected WriteImm: %v", err)
			}
			got, err := c.Fetch(ctx, "X")
			if err == nil {
				defer got.Release()
				if bytes.Equal(got.Bytes(), secret) {
					t.Fatalf("X was published with a released tensor's bytes: the client read stale pool memory it never wrote")
				}
				t.Fatalf("X was published although nothing was written into it")
			}
			if status.Code(err) != codes.NotFound {
				t.Fatalf("Fetch X: %v, want NotFound", err)
			}
		})
	}
}

// TestNoWriteLandsAfterPublish (tcp): a client posts, back to back, a
// WriteImm that fills its destination and then a large Write through the
// same grant. The Write may pass the key check before the server revokes
// the grant (it is the client's own destination until then), but Revoke
// waits for it, so the published tensor never changes after it is
// published (nor after its checksum was verified). Before the fix, tcp's
// Revoke only removed the key and the bytes kept landing.
func TestNoWriteLandsAfterPublish(t *testing.T) {
	const n = 32 << 20
	s, _, dial := hostileSetup(t, TransportTCP, 4096)
	ctx := ctxT(t)
	c := dial()
	cs, api := rawSession(t, c)
	meta := &pb.TensorMeta{Key: "late", Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}
	sr, err := api.Send(ctx, &pb.SendRequest{SessionId: cs.id, Meta: meta, ClientRef: 5001})
	if err != nil {
		t.Fatal(err)
	}
	a, la := scratch(t, c, cs, n, 1)
	b, lb := scratch(t, c, cs, n, 2)
	dst := verbs.Remote{Addr: sr.Destination.Address, Key: sr.Destination.RemoteKey}

	l := cs.link
	w1 := &waiter{ch: make(chan verbs.Completion, 1)}
	w2 := &waiter{ch: make(chan verbs.Completion, 1)}
	id1, id2 := l.nextID.Add(1), l.nextID.Add(1)
	l.mu.Lock()
	l.waiters[id1], l.waiters[id2] = w1, w2
	l.mu.Unlock()

	// Watch for the publish from the server side.
	published := make(chan []byte, 1)
	go func() {
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
			s.rv.mu.Lock()
			e, ok := s.rv.entries["late"]
			var snap []byte
			if ok {
				snap = bytes.Clone(e.buf.Bytes())
			}
			s.rv.mu.Unlock()
			if ok {
				published <- snap
				return
			}
			time.Sleep(20 * time.Microsecond)
		}
		close(published)
	}()

	err = l.qp.PostSend(
		verbs.SendRequest{ID: id1, Op: verbs.OpWriteImm, Local: la, Remote: dst, Imm: sr.Immediate, HasImm: true},
		verbs.SendRequest{ID: id2, Op: verbs.OpWrite, Local: lb, Remote: dst},
	)
	if err != nil {
		t.Fatal(err)
	}
	c1, c2 := <-w1.ch, <-w2.ch
	t.Logf("WriteImm: %v; Write after it: %v", c1.Status, c2.Status)
	snap, ok := <-published
	if !ok {
		t.Fatal("never published")
	}
	if c2.Status != verbs.StatusSuccess {
		return // the revoke came before the Write's key check: refused, as it should be
	}
	s.rv.mu.Lock()
	now := bytes.Clone(s.rv.entries["late"].buf.Bytes())
	s.rv.mu.Unlock()
	if !bytes.Equal(snap, now) {
		t.Errorf("the published tensor changed after it was published: a Write through the revoked grant kept landing (at publish: A %v, B prefix %v; now equal to B: %v)",
			bytes.Equal(snap, a.Bytes()), bytes.Equal(snap[:4096], b.Bytes()[:4096]), bytes.Equal(now, b.Bytes()))
	}
}

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
	resp, err := api.Call(ctx, &pb.CallRequest{SessionId: cs.id, Method: "big", ClientRef: 6001})
	if err != nil || len(resp.TransferIds) != 1 {
		t.Fatalf("Call: %v, %v", resp, err)
	}
	loc := resp.Tensors[0].Location
	buf, local := scratch(t, c, cs, n, 3)
	l := cs.link
	w := &waiter{ch: make(chan verbs.Completion, 1)}
	id := l.nextID.Add(1)
	l.mu.Lock()
	l.waiters[id] = w
	l.mu.Unlock()
	if err := l.qp.PostSend(verbs.SendRequest{ID: id, Op: verbs.OpRead, Local: local, Remote: verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}}); err != nil {
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
	cpl := <-w.ch
	other.Release()
	if cpl.Status != verbs.StatusSuccess {
		return // refused: the Release came before the Read's key check
	}
	leaked := bytes.Count(buf.Bytes(), []byte{0xAB})
	if leaked > 0 {
		t.Errorf("the Read, started before Release, returned %d bytes the server wrote into the buffer after Release returned", leaked)
	}
}
