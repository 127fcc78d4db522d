package verbstest

import (
	"math"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// testSendTooLarge sends more bytes than the posted receive holds: the
// receive completes with StatusLocalLength, the send with
// StatusRemoteInvalidRequest, and both queue pairs go to ERR.
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
	if sc.ID != 1 || sc.Status != verbs.StatusRemoteInvalidRequest {
		t.Fatalf("%s: send completion %v, want id 1 with %v", env.Name, describe([]verbs.Completion{sc}), verbs.StatusRemoteInvalidRequest)
	}
	if verbs.CompletionError(sc) == nil {
		t.Fatalf("%s: failed send completion gives no error", env.Name)
	}
	p.waitState(p.a, verbs.QPError)
	p.waitState(p.b, verbs.QPError)
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
// and the guard pages around it) nor of the local buffer, and moves both
// queue pairs to ERR: the receive the target had posted is flushed (a
// refused WriteImm never consumes it), and later posts on either side fail
// with ErrQPError.
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
			p.expectRefused(p.a, 1, "the refused access")
			target.checkUntouched(t, "target buffer after a refused access")
			lbuf.checkUntouched(t, "local buffer after a refused access")
			p.expectPeerFlushed(7)
		})
	}
}

// expectRefused waits for the completion of request id on s and fails the
// test unless it is the only one and has StatusRemoteAccess; then s's queue
// pair must be in ERR, with later posts failing with ErrQPError.
func (p *pair) expectRefused(s *side, id uint64, what string) {
	p.t.Helper()
	cs := p.wait(s.scq, 1, "completion of "+what)
	if c := cs[0]; c.ID != id || c.Status != verbs.StatusRemoteAccess {
		p.t.Fatalf("%s: %s: completion %v, want id %d with %v", p.env.Name, what, describe(cs), id, verbs.StatusRemoteAccess)
	}
	if verbs.CompletionError(cs[0]) == nil {
		p.t.Fatalf("%s: %s: failed completion gives no error", p.env.Name, what)
	}
	if st := s.qp.State(); st != verbs.QPError {
		p.t.Fatalf("%s: %s: side %s is in %v when its error completion is polled, want %v", p.env.Name, what, s.name, st, verbs.QPError)
	}
	p.expectQPErr(s.qp.PostSend(send(1000, p.region(s, 8, local), 0, 8)), verbs.ErrQPError, "PostSend in ERR")
	p.expectQuiet(s.scq, 20*time.Millisecond, "after the refused access")
}

// expectPeerFlushed checks that b's queue pair went to ERR after a fatal
// error on a's, and that the one receive b had posted, id, was flushed.
func (p *pair) expectPeerFlushed(id uint64) {
	p.t.Helper()
	p.waitState(p.b, verbs.QPError)
	cs := p.wait(p.b.rcq, 1, "the peer's receive when the peer went to ERR")
	if c := cs[0]; c.ID != id || c.Status != verbs.StatusFlushed {
		p.t.Fatalf("%s: the peer's receive completed as %v, want id %d flushed", p.env.Name, describe(cs), id)
	}
	p.expectQuiet(p.b.rcq, 20*time.Millisecond, "after the peer's receive was flushed")
	p.expectQPErr(p.b.qp.PostRecv(recv(1001, p.region(p.b, 8, local), 0, 8)), verbs.ErrQPError, "the peer's PostRecv in ERR")
}
