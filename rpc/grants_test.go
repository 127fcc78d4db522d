package rpc

import (
	"bytes"
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// hostileSetup is a server on transport with a published tensor "secret"
// of n bytes (pattern 1), and a way to dial clients on that transport.
func hostileSetup(t *testing.T, transport string, n int) (*Server, []byte, func() *Client) {
	t.Helper()
	skipWithoutDevice(t, transport)
	t.Cleanup(func() { leakcheck.Check(t) })
	ts := WithTransports(transport, TransportGRPC)
	s, addr, _ := serveOn(t, "127.0.0.1:0", ts)
	ctx := ctxT(t)
	pub, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
	if err != nil {
		t.Fatal(err)
	}
	pattern(pub.Bytes(), 1)
	secret := bytes.Clone(pub.Bytes())
	if err := s.Publish(ctx, "secret", pub); err != nil {
		t.Fatal(err)
	}
	pub.Release()
	dial := func() *Client {
		t.Helper()
		c, err := Dial(ctx, addr, ts, testPool(), insecureCreds())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if err := c.Connect(ctx); err != nil {
			t.Fatal(err)
		}
		if c.Transport() != transport {
			t.Fatalf("negotiated %s, want %s", c.Transport(), transport)
		}
		return c
	}
	return s, secret, dial
}

// rawSession is a client's session with the raw protocol over its own
// gRPC connection, for driving the server as a hostile client would.
func rawSession(t *testing.T, c *Client) (*clientSession, pb.TensorRPCClient) {
	t.Helper()
	s, err := c.session(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	return s, pb.NewTensorRPCClient(c.cc)
}

// scratch is a buffer of c's pool registered on its session's data plane.
func scratch(t *testing.T, c *Client, s *clientSession, n int, seed byte) (*mempool.Buffer, verbs.Local) {
	t.Helper()
	buf, err := allocBuffer(ctxT(t), c.pool, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { buf.Release() })
	pattern(buf.Bytes(), seed)
	local, err := s.link.dev.reg.Local(buf)
	if err != nil {
		t.Fatal(err)
	}
	return buf, local
}

// TestHostileClientGetsOnlyItsGrants: a second session that presents the
// keys, addresses and lengths of the first session's tensor and
// destination (as if copied out of the first client's memory) is refused
// with PermissionDenied before any byte moves; so is a session that stretches
// its own grant over a neighbouring buffer, and the first session after it
// released its grant. The first session's transfers, the published tensor
// and the server's pool stay as they were.
func TestHostileClientGetsOnlyItsGrants(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			const n = 256 << 10
			_, secret, dial := hostileSetup(t, tr, n)
			ctx := ctxT(t)
			victim := dial()
			vs, vapi := rawSession(t, victim)

			// The victim's read grant on "secret", and a write grant on a
			// destination for "dest"; neither is released yet.
			fr, err := vapi.Fetch(ctx, &pb.FetchRequest{SessionId: vs.id, Key: "secret", ClientRef: 1001})
			if err != nil || fr.Meta.GetLocation() == nil {
				t.Fatalf("victim's Fetch: %v, %v", fr, err)
			}
			rloc := fr.Meta.Location
			meta := &pb.TensorMeta{Key: "dest", Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}
			sr, err := vapi.Send(ctx, &pb.SendRequest{SessionId: vs.id, Meta: meta, ClientRef: 1002})
			if err != nil || sr.Destination == nil {
				t.Fatalf("victim's Send: %v, %v", sr, err)
			}
			wloc := sr.Destination

			// Another session reads the victim's tensor with its key.
			thief := dial()
			ts, _ := rawSession(t, thief)
			buf, local := scratch(t, thief, ts, n, 5)
			before := bytes.Clone(buf.Bytes())
			err = ts.link.post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: verbs.Remote{Addr: rloc.Address, Key: rloc.RemoteKey}}, nil)
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("another session's Read with the victim's grant: %v, want PermissionDenied", err)
			}
			if !bytes.Equal(buf.Bytes(), before) {
				t.Errorf("a refused Read changed the thief's buffer")
			}

			// Another session writes into the victim's destination.
			vandal := dial()
			vds, _ := rawSession(t, vandal)
			_, vlocal := scratch(t, vandal, vds, n, 9)
			err = vds.link.post(ctx, writeImm(vlocal, wloc.Address, wloc.RemoteKey, sr.Immediate), nil)
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("another session's WriteImm into the victim's destination: %v, want PermissionDenied", err)
			}

			// A session stretches its own read grant past its end, and aims
			// it at the victim's destination (a fresh session each: a refused
			// access ends the data plane that made it).
			for i, tc := range []struct {
				name  string
				bytes int
				addr  func(own *pb.Location) uint64
			}{
				{"past its end", 2 * n, func(own *pb.Location) uint64 { return own.Address }},
				{"at the victim's destination", n, func(*pb.Location) uint64 { return wloc.Address }},
			} {
				c := dial()
				cs, capi := rawSession(t, c)
				own, err := capi.Fetch(ctx, &pb.FetchRequest{SessionId: cs.id, Key: "secret", ClientRef: uint64(2001 + i)})
				if err != nil || own.Meta.GetLocation() == nil {
					t.Fatalf("Fetch: %v, %v", own, err)
				}
				cbuf, clocal := scratch(t, c, cs, tc.bytes, 3)
				cbefore := bytes.Clone(cbuf.Bytes())
				remote := verbs.Remote{Addr: tc.addr(own.Meta.Location), Key: own.Meta.Location.RemoteKey}
				err = cs.link.post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: clocal, Remote: remote}, nil)
				if status.Code(err) != codes.PermissionDenied {
					t.Errorf("own grant %s: %v, want PermissionDenied", tc.name, err)
				}
				if !bytes.Equal(cbuf.Bytes(), cbefore) {
					t.Errorf("own grant %s: a refused Read changed the reader's buffer", tc.name)
				}
			}

			// The victim's session is untouched: its own Read works and
			// returns the published bytes, and its destination still takes
			// its write.
			if sessionGone(victim) {
				t.Fatal("the victim's session ended because of another session's accesses")
			}
			rbuf, rlocal := scratch(t, victim, vs, n, 0)
			if err := vs.link.post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: rlocal, Remote: verbs.Remote{Addr: rloc.Address, Key: rloc.RemoteKey}}, nil); err != nil {
				t.Fatalf("the victim's own Read: %v", err)
			}
			if !bytes.Equal(rbuf.Bytes(), secret) {
				t.Errorf("the victim read something else than the published tensor")
			}
			wbuf, wlocal := scratch(t, victim, vs, n, 42)
			if err := vs.link.post(ctx, writeImm(wlocal, wloc.Address, wloc.RemoteKey, sr.Immediate), nil); err != nil {
				t.Fatalf("the victim's own WriteImm: %v", err)
			}
			got, err := victim.Fetch(ctx, "dest")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), wbuf.Bytes()) {
				t.Errorf("\"dest\" does not hold the victim's bytes")
			}
			got.Release()
			check, err := victim.Fetch(ctx, "secret")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(check.Bytes(), secret) {
				t.Errorf("the published tensor changed")
			}
			check.Release()

			// Released, the victim's read grant is revoked: its next Read
			// with it is refused (which ends its data plane).
			if _, err := vapi.Release(ctx, &pb.ReleaseRequest{SessionId: vs.id, TransferIds: []uint64{fr.TransferId}}); err != nil {
				t.Fatal(err)
			}
			err = vs.link.post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: rlocal, Remote: verbs.Remote{Addr: rloc.Address, Key: rloc.RemoteKey}}, nil)
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("Read with a released grant: %v, want PermissionDenied", err)
			}
		})
	}
}

// TestShortWriteImmPublishesNothing: a WriteImm that carries fewer bytes
// than its destination completes nothing: a Send's key is not published
// (no stale pool memory is), and a Call that names such a tensor fails
// with InvalidArgument without running its handler.
func TestShortWriteImmPublishesNothing(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			const n = 64 << 10
			s, _, dial := hostileSetup(t, tr, 4096)
			ran := make(chan struct{}, 1)
			s.Handle("sum", func(ctx context.Context, m *Message) (*Message, error) {
				ran <- struct{}{}
				return nil, nil
			})
			ctx := ctxT(t)
			c := dial()
			cs, api := rawSession(t, c)
			_, local := scratch(t, c, cs, n, 7)
			short := local
			short.Length = 4096

			meta := &pb.TensorMeta{Key: "short", Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}
			sr, err := api.Send(ctx, &pb.SendRequest{SessionId: cs.id, Meta: meta, ClientRef: 3001})
			if err != nil {
				t.Fatal(err)
			}
			if err := cs.link.post(ctx, writeImm(short, sr.Destination.Address, sr.Destination.RemoteKey, sr.Immediate), nil); err != nil {
				t.Fatalf("short WriteImm: %v", err)
			}
			if _, err := c.Fetch(ctx, "short"); status.Code(err) != codes.NotFound {
				t.Errorf("Fetch after a short WriteImm: %v, want NotFound", err)
			}

			hmeta := &pb.TensorMeta{Key: "", Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}
			hr, err := api.Send(ctx, &pb.SendRequest{SessionId: cs.id, Meta: hmeta, Hold: true, ClientRef: 3002})
			if err != nil {
				t.Fatal(err)
			}
			if err := cs.link.post(ctx, writeImm(short, hr.Destination.Address, hr.Destination.RemoteKey, hr.Immediate), nil); err != nil {
				t.Fatalf("short WriteImm: %v", err)
			}
			hmeta.TransferId = hr.TransferId
			_, err = api.Call(ctx, &pb.CallRequest{SessionId: cs.id, Method: "sum", Tensors: []*pb.TensorMeta{hmeta}, ClientRef: 3003})
			if status.Code(err) != codes.InvalidArgument {
				t.Errorf("Call with a short-written tensor: %v, want InvalidArgument", err)
			}
			select {
			case <-ran:
				t.Errorf("the handler ran on a short-written tensor")
			default:
			}
		})
	}
}
