package verbstest

import (
	"errors"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// The granted range of the suite's grant tests: grantLen bytes at grantOff
// of a grantRegion-byte region registered with local write only, inside
// guard pages.
const (
	grantRegion = 4096
	grantOff    = 1000
	grantLen    = 513
)

// grantSetup is a connected pair whose b side granted a range of a guarded
// region to a.
type grantSetup struct {
	p      *pair
	target *guarded    // b's region, AccessLocalWrite only
	lbuf   *guarded    // a's local buffer
	g      verbs.Grant // b's grant to a
	rbuf   verbs.MemoryRegion
}

// newGrant makes the pair, the regions and a grant of access, and posts one
// receive (id 7) at b so that the flush of b's queue can be checked.
func newGrant(t *testing.T, env Env, access verbs.Access) *grantSetup {
	t.Helper()
	p := newPair(t, env, options{})
	gs := &grantSetup{p: p}
	gs.target = p.guardedRegion(p.b, grantRegion, verbs.AccessLocalWrite)
	gs.lbuf = p.guardedRegion(p.a, grantRegion, local)
	gs.lbuf.refill(69)
	gs.rbuf = p.region(p.b, 64, local)
	g, err := p.b.qp.Grant(gs.target.mr, grantOff, grantLen, access)
	if err != nil {
		p.close()
		t.Fatalf("%s: Grant(%d bytes at %d, %v): %v", env.Name, grantLen, grantOff, access, err)
	}
	gs.g = g
	if g.Len() != grantLen || g.Access() != access {
		p.close()
		t.Fatalf("%s: grant has Len %d and Access %v, want %d and %v", env.Name, g.Len(), g.Access(), grantLen, access)
	}
	p.postRecv(p.b, recv(7, gs.rbuf, 0, 64))
	return gs
}

// close revokes the grant (which must succeed, and again) and closes the
// pair.
func (gs *grantSetup) close() {
	gs.p.t.Helper()
	for i := range 2 {
		if err := gs.g.Revoke(); err != nil {
			gs.p.t.Errorf("%s: Revoke (call %d): %v (Revoke is idempotent: want nil)", gs.p.env.Name, i+1, err)
		}
	}
	gs.p.close()
}

// at is the grant's Remote moved by delta bytes.
func (gs *grantSetup) at(delta int) verbs.Remote {
	r := gs.g.Remote()
	r.Addr += uint64(delta)
	return r
}

// testGrants checks grants: accesses through a grant's key within its range
// and right succeed; any other use of the key is refused with
// StatusRemoteAccess, touches no byte of the target buffer (the granted
// range, the rest of the region and the guard pages), and moves both queue
// pairs to ERR.
func testGrants(t *testing.T, env Env) {
	t.Run("Read", func(t *testing.T) {
		defer leakcheck.Check(t)
		gs := newGrant(t, env, verbs.AccessRemoteRead)
		defer gs.close()
		p := gs.p
		if r := gs.g.Remote(); r.Addr == 0 && r.Key == 0 {
			t.Fatalf("%s: grant's Remote is zero", env.Name)
		}
		want := gs.target.mr.Bytes()[grantOff : grantOff+grantLen]
		// The whole range, then its last 13 bytes.
		rd := verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: seg(gs.lbuf.mr, 0, grantLen), Remote: gs.at(0)}
		rd2 := verbs.SendRequest{ID: 2, Op: verbs.OpRead, Local: seg(gs.lbuf.mr, 2048, 13), Remote: gs.at(grantLen - 13)}
		p.postSend(p.a, rd, rd2)
		cs := p.wait(p.a.scq, 2, "reads through a read grant")
		p.expectOK(cs, verbs.OpRead, "read through a read grant")
		checkBytes(t, "read through a grant", gs.lbuf.mr.Bytes()[:grantLen], want)
		checkBytes(t, "read of the grant's last bytes", gs.lbuf.mr.Bytes()[2048:2048+13], want[grantLen-13:])
		gs.target.checkUntouched(t, "target after reads through a grant")
	})

	t.Run("Write", func(t *testing.T) {
		defer leakcheck.Check(t)
		gs := newGrant(t, env, verbs.AccessRemoteWrite)
		defer gs.close()
		p := gs.p
		fill(gs.lbuf.mr.Bytes(), 70)
		src := gs.lbuf.mr.Bytes()
		wr := verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: seg(gs.lbuf.mr, 0, grantLen), Remote: gs.at(0)}
		// A WriteImm of the last byte, which consumes receive 7.
		wi := verbs.SendRequest{ID: 2, Op: verbs.OpWriteImm, Local: seg(gs.lbuf.mr, 4000, 1), Remote: gs.at(grantLen - 1), Imm: 77}
		p.postSend(p.a, wr, wi)
		cs := p.wait(p.a.scq, 2, "writes through a write grant")
		if cs[0].ID != 1 || cs[1].ID != 2 {
			t.Fatalf("%s: completions %v, want write 1 then write-with-immediate 2", env.Name, describe(cs))
		}
		p.expectOK(cs[:1], verbs.OpWrite, "write through a write grant")
		p.expectOK(cs[1:], verbs.OpWriteImm, "write-with-immediate through a write grant")
		rc := p.wait(p.b.rcq, 1, "receive of the write-with-immediate")
		if rc[0].ID != 7 || rc[0].Op != verbs.OpRecvImm || rc[0].Imm != 77 {
			t.Fatalf("%s: receive %v, want id 7 RecvImm imm 77", env.Name, describe(rc))
		}
		want := append(append([]byte(nil), src[:grantLen-1]...), src[4000])
		gs.target.checkOnly(t, "target after writes through a grant", grantOff, want)
	})

	type refusal struct {
		name   string
		access verbs.Access // the grant's right
		op     verbs.Opcode
		delta  int // the access starts delta bytes from the grant's start
		length int
		revoke bool // revoke the grant first
	}
	refusals := []refusal{
		{"WriteThroughReadGrant", verbs.AccessRemoteRead, verbs.OpWrite, 0, grantLen, false},
		{"WriteImmThroughReadGrant", verbs.AccessRemoteRead, verbs.OpWriteImm, 0, 1, false},
		{"ReadThroughWriteGrant", verbs.AccessRemoteWrite, verbs.OpRead, 0, grantLen, false},
		{"WriteOneBytePastEnd", verbs.AccessRemoteWrite, verbs.OpWrite, 1, grantLen, false},
		{"WriteLastBytePlusOne", verbs.AccessRemoteWrite, verbs.OpWrite, grantLen - 1, 2, false},
		{"WriteByteAfterEnd", verbs.AccessRemoteWrite, verbs.OpWrite, grantLen, 1, false},
		{"WriteOneByteBefore", verbs.AccessRemoteWrite, verbs.OpWrite, -1, 2, false},
		{"WriteByteBefore", verbs.AccessRemoteWrite, verbs.OpWrite, -1, 1, false},
		{"ReadOneBytePastEnd", verbs.AccessRemoteRead, verbs.OpRead, 1, grantLen, false},
		{"ReadByteAfterEnd", verbs.AccessRemoteRead, verbs.OpRead, grantLen, 1, false},
		{"ReadOneByteBefore", verbs.AccessRemoteRead, verbs.OpRead, -1, 2, false},
		{"WholeRegionWrite", verbs.AccessRemoteWrite, verbs.OpWrite, -grantOff, grantRegion, false},
		{"WholeRegionRead", verbs.AccessRemoteRead, verbs.OpRead, -grantOff, grantRegion, false},
		{"WriteRevoked", verbs.AccessRemoteWrite, verbs.OpWrite, 0, grantLen, true},
		{"ReadRevoked", verbs.AccessRemoteRead, verbs.OpRead, 0, grantLen, true},
	}
	for _, rf := range refusals {
		t.Run(rf.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			gs := newGrant(t, env, rf.access)
			defer gs.close()
			p := gs.p
			gs.lbuf.refill(72)
			if rf.revoke {
				if err := gs.g.Revoke(); err != nil {
					t.Fatalf("%s: Revoke: %v", env.Name, err)
				}
			}
			p.postSend(p.a, verbs.SendRequest{ID: 1, Op: rf.op, Local: seg(gs.lbuf.mr, 0, rf.length), Remote: gs.at(rf.delta), Imm: 5})
			p.expectRefused(p.a, 1, rf.name)
			gs.target.checkUntouched(t, "target buffer after a refused access through a grant")
			gs.lbuf.checkUntouched(t, "local buffer after a refused access through a grant")
			p.expectPeerFlushed(7)
		})
	}

	t.Run("RegionKeyOfGrantedRegion", func(t *testing.T) {
		// The grant does not widen the region's own key: the region has
		// no remote right.
		defer leakcheck.Check(t)
		gs := newGrant(t, env, verbs.AccessRemoteWrite)
		defer gs.close()
		p := gs.p
		mr := gs.target.mr
		p.postSend(p.a, verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: seg(gs.lbuf.mr, 0, grantLen),
			Remote: verbs.Remote{Addr: mr.Addr() + grantOff, Key: mr.RemoteKey()}})
		p.expectRefused(p.a, 1, "write with the granted region's own key")
		gs.target.checkUntouched(t, "target buffer after a refused access with the region's key")
		p.expectPeerFlushed(7)
	})

	t.Run("OtherQueuePair", func(t *testing.T) {
		defer leakcheck.Check(t)
		gs := newGrant(t, env, verbs.AccessRemoteWrite)
		defer gs.close()
		p := gs.p
		if k := p.attrs(p.b).Grants; k == verbs.GrantRegistration {
			t.Skipf("%s: Grants is %v: this RDMA device has no type-2 memory windows, so a grant is a per-range registration valid on every queue pair of the domain (documented); binding a key to one queue pair needs a NIC with memory windows", env.Name, k)
		}
		a2, b2 := p.addPair(verbs.QueuePairConfig{})
		rb2 := p.region(b2, 64, local)
		p.postRecv(b2, recv(8, rb2, 0, 64))
		gs.lbuf.refill(71)
		// The key granted to a's queue pair, used from a2 to b2.
		p.postSend(a2, verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: seg(gs.lbuf.mr, 0, grantLen), Remote: gs.at(0)})
		p.expectRefused(a2, 1, "write through a grant of another queue pair")
		gs.target.checkUntouched(t, "target buffer after a write through another queue pair's grant")
		p.waitState(b2, verbs.QPError)
		if c := p.wait(b2.rcq, 1, "b2's receive after the refusal"); c[0].ID != 8 || c[0].Status != verbs.StatusFlushed {
			t.Fatalf("%s: b2's receive: %v, want id 8 flushed", env.Name, describe(c))
		}
		// The grant still works on its own queue pair.
		p.postSend(p.a, verbs.SendRequest{ID: 2, Op: verbs.OpWrite, Local: seg(gs.lbuf.mr, 0, grantLen), Remote: gs.at(0)})
		p.expectOK(p.wait(p.a.scq, 1, "write through the grant on its own queue pair"), verbs.OpWrite, "write through the grant")
		gs.target.checkOnly(t, "target after the write through the grant", grantOff, gs.lbuf.mr.Bytes()[:grantLen])
	})

	t.Run("Arguments", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		mr := p.region(p.b, grantRegion, verbs.AccessLocalWrite)
		foreign := p.region(p.a, grantRegion, verbs.AccessLocalWrite)
		cases := []struct {
			name   string
			region verbs.MemoryRegion
			off, n int
			access verbs.Access
		}{
			{"TwoRights", mr, 0, 64, verbs.AccessRemoteRead | verbs.AccessRemoteWrite},
			{"NoRight", mr, 0, 64, 0},
			{"LocalWrite", mr, 0, 64, verbs.AccessLocalWrite},
			{"ReadAndLocalWrite", mr, 0, 64, verbs.AccessRemoteRead | verbs.AccessLocalWrite},
			{"UnknownRight", mr, 0, 64, 1 << 7},
			{"PastRegionEnd", mr, grantRegion - 10, 11, verbs.AccessRemoteRead},
			{"LongerThanRegion", mr, 0, grantRegion + 1, verbs.AccessRemoteWrite},
			{"OffsetPastRegionEnd", mr, grantRegion + 1, 1, verbs.AccessRemoteWrite},
			{"NegativeOffset", mr, -1, 64, verbs.AccessRemoteRead},
			{"NegativeLength", mr, 0, -1, verbs.AccessRemoteRead},
			{"RegionOfAnotherDomain", foreign, 0, 64, verbs.AccessRemoteRead},
			{"NilRegion", nil, 0, 64, verbs.AccessRemoteRead},
		}
		for _, c := range cases {
			g, err := p.b.qp.Grant(c.region, c.off, c.n, c.access)
			if !errors.Is(err, verbs.ErrInvalidMemory) {
				t.Errorf("%s: Grant %s (%d bytes at %d, %v): got %v, want an error wrapping ErrInvalidMemory", env.Name, c.name, c.n, c.off, c.access, err)
			}
			if err == nil && g != nil {
				g.Revoke()
			}
		}
		// The whole region, and the last byte, are fine.
		for _, c := range []struct{ off, n int }{{0, grantRegion}, {grantRegion - 1, 1}} {
			g, err := p.b.qp.Grant(mr, c.off, c.n, verbs.AccessRemoteRead)
			if err != nil {
				t.Fatalf("%s: Grant of %d bytes at %d: %v", env.Name, c.n, c.off, err)
			}
			if err := g.Revoke(); err != nil {
				t.Fatalf("%s: Revoke: %v", env.Name, err)
			}
		}
		// A closed queue pair grants nothing.
		if err := p.b.qp.Close(); err != nil {
			t.Fatalf("%s: Close: %v", env.Name, err)
		}
		if _, err := p.b.qp.Grant(mr, 0, 64, verbs.AccessRemoteRead); !errors.Is(err, verbs.ErrClosed) {
			t.Fatalf("%s: Grant on a closed queue pair: got %v, want an error wrapping ErrClosed", env.Name, err)
		}
	})
}
