// White-box: hostile FETCH_REQ frames with the LANDING flag.

package rpc

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestAttackLandings: landing requests that break the format are refused
// with InvalidArgument; landings the server cannot use (too short, on
// another plane, striped) get the answer any Fetch gets; the attacker's
// session goes on after each, and the server holds nothing at the end.
func TestAttackLandings(t *testing.T) {
	s, c, _ := framedPair(t, TransportTCP)
	ctx := ctxT(t)
	const n = 256 << 10
	publishBytes(t, s, "big", n, 3)
	a := newAttacker(t, c)
	buf, err := c.pool.TryAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Release()
	g, err := a.l.Grant(buf, n, verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Revoke()
	r := g.Remote()
	landing := func(f func(*pb.Location)) *pb.Location {
		l := &pb.Location{Transport: pb.Transport_TRANSPORT_TCP, RemoteKey: r.Key, Address: r.Addr, Length: n}
		if f != nil {
			f(l)
		}
		return l
	}
	cases := []struct {
		name   string
		flags  uint16
		body   []byte
		want   codes.Code
		landed bool
	}{
		{"garbage", wire.FlagLanding, []byte{0xff, 0xff, 0xff}, codes.InvalidArgument, false},
		{"no-landing", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big"}), codes.InvalidArgument, false},
		{"rows", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Rows: []int64{0}, Landing: landing(nil)}), codes.InvalidArgument, false},
		{"with-rows-flag", wire.FlagLanding | wire.FlagRows, marshal(t, &pb.FetchRequest{Key: "big", Rows: []int64{0}, Landing: landing(nil)}), codes.InvalidArgument, false},
		{"with-lease", wire.FlagLanding | wire.FlagLease, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(nil)}), codes.InvalidArgument, false},
		{"unknown-key", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "nope", Landing: landing(nil)}), codes.NotFound, false},
		{"too-short", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(func(l *pb.Location) { l.Length = n - 1 })}), codes.OK, false},
		{"other-plane", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(func(l *pb.Location) { l.Transport = pb.Transport_TRANSPORT_SHM })}), codes.OK, false},
		{"striped", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(func(l *pb.Location) { l.Lanes = []*pb.LaneRemote{{RemoteKey: r.Key, Address: r.Addr}} })}), codes.OK, false},
		{"huge", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(func(l *pb.Location) { l.Length = 1 << 62 })}), codes.OK, true},
		{"into-other-shape", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(nil), LandingInto: &pb.TensorMeta{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n / 2, 2}, ByteLength: n}}), codes.OK, false},
		{"into-other-dtype", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(nil), LandingInto: &pb.TensorMeta{Dtype: pb.DType(zerocopy.Int8), Shape: []int64{n}, ByteLength: n}}), codes.OK, false},
		{"into-same", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(nil), LandingInto: &pb.TensorMeta{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n}}), codes.OK, true},
		{"fits", wire.FlagLanding, marshal(t, &pb.FetchRequest{Key: "big", Landing: landing(nil)}), codes.OK, true},
	}
	for i, tc := range cases {
		clear(buf.Bytes())
		pc, err := a.request(ctx, wire.FrameFetchReq, tc.flags, uint64(100+i), tc.body, nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		rep, err := a.answer(tc.name, pc)
		if status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		a.alive(tc.name)
		if err != nil {
			continue
		}
		resp := rep.Msg.(*pb.FetchResponse)
		if resp.Landed != tc.landed {
			t.Errorf("%s: landed %v, want %v", tc.name, resp.Landed, tc.landed)
		}
		if resp.Landed {
			if resp.TransferId != 0 || resp.Meta.GetLocation() != nil || resp.Meta.GetByteLength() != n {
				t.Errorf("%s: a landed answer with transfer %d, location %v, %d bytes", tc.name, resp.TransferId, resp.Meta.GetLocation(), resp.Meta.GetByteLength())
			}
			want := make([]byte, n)
			pattern(want, 3)
			if string(buf.Bytes()) != string(want) {
				t.Errorf("%s: the landing does not hold the tensor", tc.name)
			}
			continue
		}
		if resp.TransferId == 0 {
			t.Errorf("%s: neither landed nor a transfer", tc.name)
			continue
		}
		a.send(ctx, wire.FrameHeader{Type: wire.FrameRelease, Credits: a.owed(-1)}, nil, []uint64{resp.TransferId})
	}
	ss := serverSessionOf(t, s)
	waitFor(t, "the attacker's transfers to go", func() bool { return ss.Holding().Transfers == 0 })
}

// TestAttackLandingNamesNothing: a landing whose key the attacker never
// granted makes the server's Write fail on the attacker's side: its
// session ends, another one goes on, and the server frees what the Write
// held.
func TestAttackLandingNamesNothing(t *testing.T) {
	s, dial := attackServer(t)
	s.Handle("echo", echo(s))
	publishBytes(t, s, "big", 256<<10, 3)
	victim := dial()
	c := dial()
	a := newAttacker(t, c)
	body := marshal(t, &pb.FetchRequest{Key: "big", Landing: &pb.Location{Transport: pb.Transport_TRANSPORT_TCP, RemoteKey: 0xdead, Address: 1 << 40, Length: 1 << 20}})
	if _, err := a.request(ctxT(t), wire.FrameFetchReq, wire.FlagLanding, 7, body, nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the attacker's lane to fail", func() bool {
		select {
		case <-a.l.Dead:
			return true
		default:
			return false
		}
	})
	victimWorks(t, s, victim, "after a landing that names nothing")
	waitFor(t, "the server to free the Write's source", func() bool {
		for _, info := range s.Sessions() {
			if info.ID == a.s.id {
				return false
			}
		}
		return true
	})
}

// TestLandedReplyIndexes: a reply tensor that names a landing the call
// did not grant, none, or one another tensor took is refused.
func TestLandedReplyIndexes(t *testing.T) {
	_, c, _ := framedPair(t, TransportTCP)
	const n = 64 << 10
	buf, err := c.pool.TryAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	revoked := make(chan struct{})
	close(revoked)
	d := &landing{buf: buf, loc: &pb.Location{Length: n}, revoked: revoked}
	d.ends.Store(1) // as if its grant were revoked: the answer came
	lands := []*landing{nil, d}
	idx := func(i uint32) *pb.TensorMeta {
		return &pb.TensorMeta{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{n}, ByteLength: n, LandingIndex: &i}
	}
	for _, i := range []uint32{0, 2, 1 << 30} {
		if _, err := c.landedReply(ctxT(t), lands, idx(i)); status.Code(err) != codes.InvalidArgument {
			t.Errorf("landing %d of a call that granted only landing 1: %v, want InvalidArgument", i, err)
		}
	}
	got, err := c.landedReply(ctxT(t), lands, idx(1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.landedReply(ctxT(t), lands, idx(1)); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a second tensor in landing 1: %v, want InvalidArgument", err)
	}
	got.Release()
	doneAll(lands)
}
