package verbstest

import (
	"math"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// testSendTooLarge sends more bytes than the posted receive holds: the
// receive completes with StatusLocalLength and the send with an error.
func testSendTooLarge(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, local)
	p.postRecv(p.b, recv(50, dst, 0, 16))
	p.postSend(p.a, send(1, src, 0, 64))
	rc := p.wait(p.b.rcq, 1, "receive completion")[0]
	if rc.ID != 50 || rc.Status != verbs.StatusLocalLength {
		t.Fatalf("%s: receive completion %v, want id 50 with %v", env.Name, describe([]verbs.Completion{rc}), verbs.StatusLocalLength)
	}
	sc := p.wait(p.a.scq, 1, "send completion")[0]
	if sc.ID != 1 || sc.Status == verbs.StatusSuccess {
		t.Fatalf("%s: send completion %v, want id 1 with an error", env.Name, describe([]verbs.Completion{sc}))
	}
	if sc.Err == nil && verbs.CompletionError(sc) == nil {
		t.Fatalf("%s: failed send completion gives no error", env.Name)
	}
}

// accessCase is one remote access the target must refuse.
type accessCase struct {
	name   string
	op     verbs.Opcode
	access verbs.Access // rights of the target region
	// target computes the remote address and key from the target region.
	target func(mr verbs.MemoryRegion) verbs.Remote
	length int
	dereg  bool // deregister the target region before the access
}

func inRegion(off int) func(verbs.MemoryRegion) verbs.Remote {
	return func(mr verbs.MemoryRegion) verbs.Remote {
		return verbs.Remote{Addr: mr.Addr() + uint64(off), Key: mr.RemoteKey()}
	}
}

var accessCases = []accessCase{
	{name: "WriteBadKey", op: verbs.OpWrite, access: remote, length: 64,
		target: func(mr verbs.MemoryRegion) verbs.Remote {
			return verbs.Remote{Addr: mr.Addr(), Key: mr.RemoteKey() ^ 0x5ec7e7}
		}},
	{name: "WritePastEnd", op: verbs.OpWrite, access: remote, length: 16, target: inRegion(4096 - 8)},
	{name: "WriteBeforeStart", op: verbs.OpWrite, access: remote, length: 16, target: inRegion(-8)},
	{name: "WriteAddressOverflow", op: verbs.OpWrite, access: remote, length: 64,
		target: func(mr verbs.MemoryRegion) verbs.Remote {
			return verbs.Remote{Addr: math.MaxUint64 - 7, Key: mr.RemoteKey()}
		}},
	{name: "WriteWithoutRemoteWrite", op: verbs.OpWrite, access: verbs.AccessLocalWrite | verbs.AccessRemoteRead, length: 64, target: inRegion(0)},
	{name: "WriteImmWithoutRemoteWrite", op: verbs.OpWriteImm, access: verbs.AccessLocalWrite | verbs.AccessRemoteRead, length: 64, target: inRegion(0)},
	{name: "WriteDeregistered", op: verbs.OpWrite, access: remote, length: 64, target: inRegion(0), dereg: true},
	{name: "ReadBadKey", op: verbs.OpRead, access: remote, length: 64,
		target: func(mr verbs.MemoryRegion) verbs.Remote {
			return verbs.Remote{Addr: mr.Addr(), Key: mr.RemoteKey() ^ 0x5ec7e7}
		}},
	{name: "ReadPastEnd", op: verbs.OpRead, access: remote, length: 4097, target: inRegion(0)},
	{name: "ReadWithoutRemoteRead", op: verbs.OpRead, access: verbs.AccessLocalWrite | verbs.AccessRemoteWrite, length: 64, target: inRegion(0)},
	{name: "ReadDeregistered", op: verbs.OpRead, access: remote, length: 64, target: inRegion(0), dereg: true},
}

// testRemoteAccess runs accesses the target must refuse. Each one completes
// with StatusRemoteAccess, touches no byte of the target buffer (the region
// and the guard pages around it) nor of the local buffer, and moves the
// requester's queue pair to the error state.
func testRemoteAccess(t *testing.T, env Env) {
	for _, ac := range accessCases {
		t.Run(ac.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			p := newPair(t, env, options{})
			defer p.close()
			target := p.guardedRegion(p.b, 4096, ac.access)
			lbuf := p.guardedRegion(p.a, 8192, local)
			rbuf := p.region(p.b, 64, local)
			p.postRecv(p.b, recv(7, rbuf, 0, 64))
			remote := ac.target(target.mr)
			if ac.dereg {
				if err := target.mr.Deregister(); err != nil {
					t.Fatalf("%s: Deregister: %v", env.Name, err)
				}
			}
			wr := verbs.SendRequest{
				ID:     1,
				Op:     ac.op,
				Local:  verbs.Local{Region: lbuf.mr, Offset: 0, Length: ac.length},
				Remote: remote,
				Imm:    99,
			}
			p.postSend(p.a, wr)
			c := p.wait(p.a.scq, 1, "completion of the refused access")[0]
			if c.ID != 1 || c.Status != verbs.StatusRemoteAccess {
				t.Fatalf("%s: completion %v, want id 1 with %v", env.Name, describe([]verbs.Completion{c}), verbs.StatusRemoteAccess)
			}
			if verbs.CompletionError(c) == nil {
				t.Fatalf("%s: failed completion gives no error", env.Name)
			}
			target.checkUntouched(t, "target buffer after a refused access")
			lbuf.checkUntouched(t, "local buffer after a refused access")
			p.waitState(p.a, verbs.QPError)
			if ac.op == verbs.OpWriteImm {
				// The refused WriteImm must not complete a receive successfully.
				cs := make([]verbs.Completion, 4)
				time.Sleep(50 * time.Millisecond)
				for _, c := range cs[:p.b.rcq.Poll(cs)] {
					if c.Status == verbs.StatusSuccess {
						t.Fatalf("%s: a refused WriteImm completed a receive: %v", env.Name, describe([]verbs.Completion{c}))
					}
				}
			}
		})
	}
}

// testLocalErrors posts requests whose local side is wrong. A provider may
// refuse them when they are posted (then no completion may follow) or
// complete them with an error.
func testLocalErrors(t *testing.T, env Env) {
	type localCase struct {
		name string
		// wr builds the request from a local region without local write,
		// a writable local region, a region of the other domain and the
		// peer's target region.
		wr func(ro, rw, foreign, target verbs.MemoryRegion) verbs.SendRequest
		// want is the acceptable error statuses.
		want []verbs.Status
	}
	cases := []localCase{
		{"PastRegionEnd", func(ro, rw, foreign, target verbs.MemoryRegion) verbs.SendRequest {
			return write(1, rw, 4000, 200, target, 0)
		}, []verbs.Status{verbs.StatusLocalLength, verbs.StatusLocalProtection}},
		{"NegativeOffset", func(ro, rw, foreign, target verbs.MemoryRegion) verbs.SendRequest {
			return write(1, rw, -1, 16, target, 0)
		}, []verbs.Status{verbs.StatusLocalLength, verbs.StatusLocalProtection}},
		{"ReadIntoReadOnly", func(ro, rw, foreign, target verbs.MemoryRegion) verbs.SendRequest {
			return read(1, ro, 0, 64, target, 0)
		}, []verbs.Status{verbs.StatusLocalProtection}},
		{"ForeignRegion", func(ro, rw, foreign, target verbs.MemoryRegion) verbs.SendRequest {
			return write(1, foreign, 0, 64, target, 0)
		}, []verbs.Status{verbs.StatusLocalProtection}},
		{"NilRegion", func(ro, rw, foreign, target verbs.MemoryRegion) verbs.SendRequest {
			return verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Length: 64},
				Remote: verbs.Remote{Addr: target.Addr(), Key: target.RemoteKey()}}
		}, []verbs.Status{verbs.StatusLocalProtection, verbs.StatusLocalLength}},
	}
	for _, lc := range cases {
		t.Run(lc.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			p := newPair(t, env, options{})
			defer p.close()
			ro := p.region(p.a, 4096, 0)
			rw := p.region(p.a, 4096, local)
			foreign := p.region(p.b, 4096, local)
			target := p.region(p.b, 4096, remote)
			wr := lc.wr(ro, rw, foreign, target)
			if err := p.a.qp.PostSend(wr); err != nil {
				p.expectQuiet(p.a.scq, 50*time.Millisecond, "a refused post must not complete")
				return
			}
			c := p.wait(p.a.scq, 1, "completion of the bad local request")[0]
			ok := c.ID == 1
			if ok {
				ok = false
				for _, s := range lc.want {
					ok = ok || c.Status == s
				}
			}
			if !ok {
				t.Fatalf("%s: completion %v, want id 1 with one of %v", env.Name, describe([]verbs.Completion{c}), lc.want)
			}
		})
	}

	t.Run("InvalidOpcode", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		rw := p.region(p.a, 64, local)
		for _, op := range []verbs.Opcode{0, verbs.OpRecv, verbs.OpRecvImm, 200} {
			wr := send(1, rw, 0, 8)
			wr.Op = op
			if err := p.a.qp.PostSend(wr); err == nil {
				t.Fatalf("%s: PostSend with opcode %v succeeded, want an error", env.Name, op)
			}
		}
		p.expectQuiet(p.a.scq, 20*time.Millisecond, "refused posts must not complete")
	})

	t.Run("RecvIntoReadOnly", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		src := p.region(p.a, 64, local)
		ro := p.region(p.b, 64, 0)
		if err := p.b.qp.PostRecv(recv(1, ro, 0, 64)); err != nil {
			p.expectQuiet(p.b.rcq, 20*time.Millisecond, "a refused receive must not complete")
			return
		}
		p.postSend(p.a, send(2, src, 0, 64))
		c := p.wait(p.b.rcq, 1, "receive into a region without local write")[0]
		if c.ID != 1 || c.Status != verbs.StatusLocalProtection {
			t.Fatalf("%s: receive completion %v, want id 1 with %v", env.Name, describe([]verbs.Completion{c}), verbs.StatusLocalProtection)
		}
		if s := p.wait(p.a.scq, 1, "send to a bad receive")[0]; s.Status == verbs.StatusSuccess {
			t.Fatalf("%s: send into a refused receive succeeded", env.Name)
		}
	})
}
