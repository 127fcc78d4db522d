// White-box: how a Send's or Call's grants end once answered.

package rpc

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// fakeGrant is a grant whose revocation the test completes: Revoke
// counts a synchronous one; asyncGrant's RevokeAsync keeps done for the
// test to run, as a peer's confirmation would.
type fakeGrant struct {
	revokes atomic.Int32
	pending chan func()
}

func (*fakeGrant) Remote() verbs.Remote      { return verbs.Remote{} }
func (*fakeGrant) Len() int                  { return 0 }
func (*fakeGrant) Access() verbs.Access      { return verbs.AccessRemoteRead }
func (g *fakeGrant) Revoke() error           { g.revokes.Add(1); return nil }
func (g *fakeGrant) revokeAsync(done func()) { g.pending <- done }

// asyncGrant is a fakeGrant that is a verbs.AsyncRevoker.
type asyncGrant struct{ *fakeGrant }

func (g asyncGrant) RevokeAsync(done func()) { g.revokeAsync(done) }

// TestGrantFreeLaterDoesNotWait: once answered, a Send's grants end
// without waiting for the peer's confirmation where the provider can
// revoke so (shm's, one message each way); the buffer goes back when the
// last confirmation comes; a now (a Send that failed with its caller's
// memory granted in place) waits for that; grants that cannot be revoked
// so are revoked at once.
func TestGrantFreeLaterDoesNotWait(t *testing.T) {
	g1 := asyncGrant{&fakeGrant{pending: make(chan func(), 1)}}
	g2 := asyncGrant{&fakeGrant{pending: make(chan func(), 1)}}
	var released atomic.Int32
	f := &grantFree{ended: make(chan struct{}), g: g1, extra: []verbs.Grant{g2}, release: func() { released.Add(1) }}
	f.later() // returns at once: nothing confirmed yet
	f.later() // once
	if released.Load() != 0 || g1.revokes.Load() != 0 {
		t.Fatalf("released %d times, %d synchronous revokes, before any confirmation", released.Load(), g1.revokes.Load())
	}
	nowDone := make(chan struct{})
	go func() {
		f.now() // waits for the revocations later began
		close(nowDone)
	}()
	(<-g1.pending)()
	select {
	case <-nowDone:
		t.Fatal("now returned with a revocation unconfirmed")
	case <-time.After(20 * time.Millisecond):
	}
	if released.Load() != 0 {
		t.Fatal("released before the last confirmation")
	}
	(<-g2.pending)()
	<-nowDone
	if released.Load() != 1 {
		t.Fatalf("released %d times, want 1", released.Load())
	}

	// A grant that cannot be revoked without waiting: later revokes
	// every grant at once, and releases.
	s1, s2 := &fakeGrant{}, asyncGrant{&fakeGrant{pending: make(chan func(), 1)}}
	released.Store(0)
	f = &grantFree{ended: make(chan struct{}), g: s1, extra: []verbs.Grant{s2}, release: func() { released.Add(1) }}
	f.later()
	if s1.revokes.Load() != 1 || s2.revokes.Load() != 1 || released.Load() != 1 {
		t.Fatalf("revokes %d, %d, released %d: want 1, 1, 1", s1.revokes.Load(), s2.revokes.Load(), released.Load())
	}
	f.now() // already ended
}
