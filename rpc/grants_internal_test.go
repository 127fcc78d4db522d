// White-box: a hostile client posts one-sided operations on its session's link against grants.

package rpc

import (
	"bytes"
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
	local, err := s.link.Domain.Reg.Local(buf)
	if err != nil {
		t.Fatal(err)
	}
	return buf, local
}

// TestHostileClientGetsOnlyItsGrants: a second session that presents the
// keys, addresses and lengths of the first session's tensors (as if copied
// out of the first client's memory), to read or to write, is refused with
// PermissionDenied before any byte moves; so is a session that stretches
// its own grant over a neighbouring buffer, and the first session after it
// released its grant. The first session's transfers, the published tensor
// and the server's pool stay as they were.
func TestHostileClientGetsOnlyItsGrants(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			const n = 256 << 10
			s, secret, dial := hostileSetup(t, tr, n)
			publishBytes(t, s, "other", n, 4)
			ctx := ctxT(t)
			victim := dial()
			vs, vapi := rawSession(t, victim)

			// The victim's read grants on "secret" and "other", not yet
			// released.
			fr, err := victim.askFrame(ctx, vs, vs.link, "secret", fetchOptions{})
			if err != nil || fr.Meta.GetLocation() == nil {
				t.Fatalf("victim's Fetch: %v, %v", fr, err)
			}
			rloc := fr.Meta.Location
			or, err := victim.askFrame(ctx, vs, vs.link, "other", fetchOptions{})
			if err != nil || or.Meta.GetLocation() == nil {
				t.Fatalf("victim's Fetch: %v, %v", or, err)
			}
			oloc := or.Meta.Location

			// Another session reads the victim's tensor with its key.
			thief := dial()
			ts, _ := rawSession(t, thief)
			buf, local := scratch(t, thief, ts, n, 5)
			before := bytes.Clone(buf.Bytes())
			err = ts.link.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: verbs.Remote{Addr: rloc.Address, Key: rloc.RemoteKey}}, nil)
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("another session's Read with the victim's grant: %v, want PermissionDenied", err)
			}
			if !bytes.Equal(buf.Bytes(), before) {
				t.Errorf("a refused Read changed the thief's buffer")
			}

			// Another session writes into the victim's tensor.
			vandal := dial()
			vds, _ := rawSession(t, vandal)
			_, vlocal := scratch(t, vandal, vds, n, 9)
			err = vds.link.Post(ctx, write(vlocal, rloc.Address, rloc.RemoteKey), nil)
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("another session's Write into the victim's tensor: %v, want PermissionDenied", err)
			}

			// A session stretches its own read grant past its end, and aims
			// it at the victim's other tensor (a fresh session each: a
			// refused access ends the data plane that made it).
			for _, tc := range []struct {
				name  string
				bytes int
				addr  func(own *pb.Location) uint64
			}{
				{"past its end", 2 * n, func(own *pb.Location) uint64 { return own.Address }},
				{"at the victim's other tensor", n, func(*pb.Location) uint64 { return oloc.Address }},
			} {
				c := dial()
				cs, _ := rawSession(t, c)
				own, err := c.askFrame(ctx, cs, cs.link, "secret", fetchOptions{})
				if err != nil || own.Meta.GetLocation() == nil {
					t.Fatalf("Fetch: %v, %v", own, err)
				}
				cbuf, clocal := scratch(t, c, cs, tc.bytes, 3)
				cbefore := bytes.Clone(cbuf.Bytes())
				remote := verbs.Remote{Addr: tc.addr(own.Meta.Location), Key: own.Meta.Location.RemoteKey}
				err = cs.link.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: clocal, Remote: remote}, nil)
				if status.Code(err) != codes.PermissionDenied {
					t.Errorf("own grant %s: %v, want PermissionDenied", tc.name, err)
				}
				if !bytes.Equal(cbuf.Bytes(), cbefore) {
					t.Errorf("own grant %s: a refused Read changed the reader's buffer", tc.name)
				}
			}

			// The victim's session is untouched: its own Read works and
			// returns the published bytes.
			if sessionGone(victim) {
				t.Fatal("the victim's session ended because of another session's accesses")
			}
			rbuf, rlocal := scratch(t, victim, vs, n, 0)
			if err := vs.link.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: rlocal, Remote: verbs.Remote{Addr: rloc.Address, Key: rloc.RemoteKey}}, nil); err != nil {
				t.Fatalf("the victim's own Read: %v", err)
			}
			if !bytes.Equal(rbuf.Bytes(), secret) {
				t.Errorf("the victim read something else than the published tensor")
			}
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
			err = vs.link.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: rlocal, Remote: verbs.Remote{Addr: rloc.Address, Key: rloc.RemoteKey}}, nil)
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("Read with a released grant: %v, want PermissionDenied", err)
			}
		})
	}
}
