package engine

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/pooltest"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// newTransfer is a transfer of a fresh buffer of p, with no grant.
func newTransfer(t *testing.T, p *mempool.Pool) *Transfer {
	t.Helper()
	buf, err := p.TryAlloc(64)
	if err != nil {
		t.Fatal(err)
	}
	return &Transfer{Buf: buf}
}

// mustAdd adds a transfer of ref and returns its id.
func mustAdd(t *testing.T, s *Session, p *mempool.Pool, ref uint64) uint64 {
	t.Helper()
	tr := newTransfer(t, p)
	if err := s.Add(context.Background(), tr, ref); err != nil {
		tr.Finish()
		t.Fatal(err)
	}
	return tr.ID
}

// wantRefused adds a transfer of ref, which must fail with want; the
// caller still owns the buffer, which it releases.
func wantRefused(t *testing.T, ctx context.Context, s *Session, p *mempool.Pool, ref uint64, want codes.Code) {
	t.Helper()
	tr := newTransfer(t, p)
	err := s.Add(ctx, tr, ref)
	tr.Finish()
	if status.Code(err) != want {
		t.Fatalf("Add of ref %d: %v, want %v", ref, err, want)
	}
}

// TestSessionReleaseRef: releasing a ref frees every transfer of it and
// no other, and a transfer its call adds afterwards (the release overtook
// the call) is refused with Canceled.
func TestSessionReleaseRef(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	p := pooltest.New(t, 1<<20)
	s := NewSession(context.Background(), 0, nil)
	defer s.Close(nil, errors.New("test over"))
	mustAdd(t, s, p, 7)
	mustAdd(t, s, p, 7)
	other := mustAdd(t, s, p, 8)
	plain := mustAdd(t, s, p, 0)
	last := mustAdd(t, s, p, 7)
	if got := s.Remove(last); got == nil || got.Ref != 7 {
		t.Fatalf("Remove(%d) = %+v, want the transfer of ref 7", last, got)
	} else {
		got.Finish()
	}
	done := s.ReleaseRef(7)
	if len(done) != 2 {
		t.Fatalf("ReleaseRef(7) freed %d transfers, want 2", len(done))
	}
	FinishAll(done)
	if h := s.Holding(); h.Transfers != 2 || h.Released != 1 {
		t.Fatalf("after the release: %+v, want 2 transfers and 1 released ref", h)
	}
	if !s.Has(other) || !s.Has(plain) {
		t.Fatal("releasing ref 7 freed another ref's transfer")
	}
	wantRefused(t, context.Background(), s, p, 7, codes.Canceled)
	if len(s.ReleaseRef(7)) != 0 {
		t.Fatal("a refused transfer was added")
	}
	FinishAll(s.RemoveAll([]uint64{other, plain, 12345}))
	if s.Remove(other) != nil {
		t.Fatal("a transfer removed twice")
	}
	if h := s.Holding(); h.Transfers != 0 || h.Busy() {
		t.Fatalf("after every release: %+v, want nothing held", h)
	}
}

// TestSessionForgetsOldReleases: a session remembers the last
// MaxReleasedRefs released refs, no more.
func TestSessionForgetsOldReleases(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	p := pooltest.New(t, 1<<20)
	s := NewSession(context.Background(), 0, nil)
	defer s.Close(nil, errors.New("test over"))
	for ref := uint64(1); ref <= MaxReleasedRefs+10; ref++ {
		s.ReleaseRef(ref)
	}
	s.ReleaseRef(MaxReleasedRefs + 10) // again: remembered once
	if n := s.Holding().Released; n != MaxReleasedRefs {
		t.Fatalf("%d released refs remembered, want %d", n, MaxReleasedRefs)
	}
	s.Remove(mustAdd(t, s, p, 1)).Finish() // the oldest release is forgotten
	wantRefused(t, context.Background(), s, p, MaxReleasedRefs+10, codes.Canceled)
}

// TestSessionMaxTransfers: a transfer past the session's bound is refused
// with ResourceExhausted, and refused hears of each; one fits again once
// another is released.
func TestSessionMaxTransfers(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	p := pooltest.New(t, 1<<20)
	var mu sync.Mutex
	var heard []error
	s := NewSession(context.Background(), 2, func(err error) {
		mu.Lock()
		heard = append(heard, err)
		mu.Unlock()
	})
	defer s.Close(nil, errors.New("test over"))
	first := mustAdd(t, s, p, 1)
	mustAdd(t, s, p, 2)
	wantRefused(t, context.Background(), s, p, 3, codes.ResourceExhausted)
	wantRefused(t, context.Background(), s, p, 0, codes.ResourceExhausted)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	wantRefused(t, ctx, s, p, 3, codes.Canceled) // not over the bound: not heard
	mu.Lock()
	n := len(heard)
	mu.Unlock()
	if n != 2 {
		t.Fatalf("refused heard of %d refusals, want 2", n)
	}
	s.Remove(first).Finish()
	mustAdd(t, s, p, 3)
}

// TestSessionClose: closing a session finishes what it holds, and refuses
// further transfers (Unavailable) and work (Go).
func TestSessionClose(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	p := pooltest.New(t, 1<<20)
	s := NewSession(context.Background(), 0, nil)
	mustAdd(t, s, p, 1)
	mustAdd(t, s, p, 0)
	ran := make(chan struct{})
	if !s.Go(func() { close(ran) }) {
		t.Fatal("Go refused on an open session")
	}
	s.Close(nil, errors.New("closed"))
	select {
	case <-ran:
	default:
		t.Fatal("Close returned before the session's goroutine")
	}
	if s.Context().Err() == nil {
		t.Fatal("the session's context outlived Close")
	}
	if st := p.Stats(); st.Allocs != 0 {
		t.Fatalf("%d buffers still held after Close", st.Allocs)
	}
	wantRefused(t, context.Background(), s, p, 2, codes.Unavailable)
	if s.Go(func() { t.Error("ran after Close") }) {
		t.Fatal("Go ran work on a closed session")
	}
	s.FinishAside([]*Transfer{newTransfer(t, p)}) // at once, here
	if st := p.Stats(); st.Allocs != 0 {
		t.Fatalf("FinishAside on a closed session left %d buffers", st.Allocs)
	}
}

// TestSessionStalePulls: a Read of the client's memory is stale once it
// has been under way longer than the timeout, and no longer once it ends.
func TestSessionStalePulls(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	s := NewSession(context.Background(), 0, nil)
	defer s.Close(nil, errors.New("test over"))
	if s.StaleReservation(0) {
		t.Fatal("stale with no pull under way")
	}
	done := s.Pulling()
	other := s.Pulling()
	if h := s.Holding(); h.Pulls != 2 || !h.Busy() {
		t.Fatalf("two pulls under way: %+v", h)
	}
	if s.StaleReservation(time.Hour) {
		t.Fatal("a fresh pull is stale")
	}
	time.Sleep(2 * time.Millisecond)
	if !s.StaleReservation(time.Millisecond) {
		t.Fatal("a pull under way past the timeout is not stale")
	}
	done()
	other()
	if s.StaleReservation(0) || s.Holding().Pulls != 0 {
		t.Fatal("ended pulls still count")
	}
}

// TestSessionCalls: a running call is counted and cancelled by
// CancelCall; a call whose ref was released before it ran starts
// cancelled; once FinishCalls drains the session, new calls are refused
// with Unavailable, and FinishCalls returns once the running ones have.
func TestSessionCalls(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	s := NewSession(context.Background(), 0, nil)
	defer s.Close(nil, errors.New("test over"))
	started, release := make(chan struct{}), make(chan struct{})
	ctx, cancel := context.WithCancel(s.Context())
	s.Run(nil, 1, cancel, RunGoroutine, nil, func(refusal error, _ func()) bool {
		if refusal != nil {
			t.Errorf("a call refused on an open session: %v", refusal)
		}
		close(started)
		<-ctx.Done()
		<-release
		return false
	})
	<-started
	if h := s.Holding(); h.InFlight != 1 || h.Calls != 1 || !s.Running(1) || !h.Busy() {
		t.Fatalf("one call under way: %+v", h)
	}
	s.CancelCall(1)
	<-ctx.Done() // the call sees its cancellation

	s.ReleaseRef(2)
	ctx2, cancel2 := context.WithCancel(s.Context())
	overtaken := make(chan error, 1)
	s.Run(nil, 2, cancel2, RunGoroutine, nil, func(error, func()) bool { overtaken <- ctx2.Err(); return false })
	if err := <-overtaken; err == nil {
		t.Fatal("a call whose ref was already released runs uncancelled")
	}

	finished := make(chan struct{})
	go func() {
		s.FinishCalls(context.Background(), time.Minute)
		close(finished)
	}()
	refused := make(chan error, 1)
	for s.Accepts(3) {
		time.Sleep(time.Millisecond) // until FinishCalls drains
	}
	s.Run(nil, 3, func() {}, RunGoroutine, nil, func(refusal error, _ func()) bool { refused <- refusal; return false })
	if err := <-refused; status.Code(err) != codes.Unavailable {
		t.Fatalf("a call while draining: %v, want Unavailable", err)
	}
	select {
	case <-finished:
		t.Fatal("FinishCalls returned while a call was running")
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	<-finished
	if h := s.Holding(); h.InFlight != 0 || h.Calls != 0 || h.Refusing != 0 {
		t.Fatalf("after every call: %+v", h)
	}
}

// TestSessionCallsBounded: past MaxFrameCalls running, calls are refused
// with ResourceExhausted; past as many refusals waiting to answer, the
// link they came on fails and the call does not run.
func TestSessionCallsBounded(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	ctl := pooltest.New(t, 1<<20)
	dom, err := OpenDomain(tcp.New(), pooltest.New(t, 1<<20), ctl)
	if err != nil {
		t.Fatal(err)
	}
	defer dom.Close()
	l, err := NewLink(context.Background(), dom, ctl, netip.Addr{}, verbs.RoleDial)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close(errors.New("test over"))
	s := NewSession(context.Background(), 0, nil)
	defer s.Close(nil, errors.New("test over"))
	hold := make(chan struct{})
	var refusals sync.WaitGroup
	refusals.Add(MaxFrameCalls)
	for ref := range uint64(2 * MaxFrameCalls) {
		s.Run(l, ref+1, func() {}, RunGoroutine, nil, func(refusal error, _ func()) bool {
			if ref >= MaxFrameCalls {
				if status.Code(refusal) != codes.ResourceExhausted {
					t.Errorf("call %d past the bound: %v, want ResourceExhausted", ref, refusal)
				}
				refusals.Done()
			} else if refusal != nil {
				t.Errorf("call %d refused: %v", ref, refusal)
			}
			<-hold
			return false
		})
	}
	refusals.Wait()
	if h := s.Holding(); h.InFlight != MaxFrameCalls || h.Refusing != MaxFrameCalls {
		t.Fatalf("%+v, want %d running and as many refusing", h, MaxFrameCalls)
	}
	cancelled := false
	s.Run(l, 1<<40, func() { cancelled = true }, RunGoroutine, nil, func(error, func()) bool { t.Error("a call past every bound ran"); return false })
	select {
	case <-l.Dead:
	case <-time.After(10 * time.Second):
		t.Fatal("the link did not fail")
	}
	if !cancelled || s.Running(1<<40) {
		t.Fatal("the call past every bound stayed registered")
	}
	close(hold)
	s.FinishCalls(context.Background(), time.Minute)
}

// TestSessionCallHandedOver: a call that hands its end over to its
// answer's Send stays under way after it returns, until that Send runs
// over: FinishCalls waits for it.
func TestSessionCallHandedOver(t *testing.T) {
	defer leakcheck.Check(t)
	s := NewSession(context.Background(), 0, nil)
	defer s.Close(nil, errors.New("test over"))
	overs := make(chan func(), 1)
	_, cancel := context.WithCancel(s.Context())
	s.Run(nil, 1, cancel, RunGoroutine, nil, func(refusal error, over func()) bool {
		overs <- over
		return true
	})
	over := <-overs
	for s.Running(1) {
		time.Sleep(time.Millisecond) // until the call has returned
	}
	if h := s.Holding(); h.InFlight != 1 {
		t.Fatalf("%+v: a handed-over call is no longer under way after it returned", h)
	}
	finished := make(chan struct{})
	go func() {
		s.FinishCalls(context.Background(), time.Minute)
		close(finished)
	}()
	select {
	case <-finished:
		t.Fatal("FinishCalls returned before the handed-over call's Send completed")
	case <-time.After(20 * time.Millisecond):
	}
	over()
	<-finished
	if h := s.Holding(); h.InFlight != 0 {
		t.Fatalf("%+v after over", h)
	}
}

// slowRevoke is a grant whose asynchronous revocation completes only
// when the test says (a peer's access still under way).
type slowRevoke struct {
	verbs.Grant
	done chan func()
}

func (g *slowRevoke) RevokeAsync(done func()) { g.done <- done }

// TestSessionCloseWaitsForTransfersFinishingAside: a transfer finished
// aside whose revocation is still under way is counted among the
// session's goroutines: Close returns only once its buffer went back.
func TestSessionCloseWaitsForTransfersFinishingAside(t *testing.T) {
	defer leakcheck.Check(t)
	p := pooltest.New(t, 1<<20)
	s := NewSession(context.Background(), 0, nil)
	g := &slowRevoke{done: make(chan func(), 1)}
	tr := newTransfer(t, p)
	tr.Grant = g
	s.FinishAside([]*Transfer{tr})
	revoked := <-g.done // the revocation began, and waits
	closed := make(chan struct{})
	go func() {
		s.Close(nil, errors.New("test"))
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while a transfer finishing aside still held its buffer")
	case <-time.After(50 * time.Millisecond):
	}
	if p.Stats().InUse == 0 {
		t.Fatal("the buffer went back before its revocation completed")
	}
	revoked()
	<-closed
	if n := p.Stats().InUse; n != 0 {
		t.Fatalf("%d bytes in use after Close", n)
	}
}

// TestSessionRemoveForLater: RemoveForLater takes the transfers off the
// books at once (the session's bound counts them gone) and frees them
// only when what it returns runs; Close waits for that; unknown ids
// return nothing to run.
func TestSessionRemoveForLater(t *testing.T) {
	defer leakcheck.Check(t) // after the deferred closes
	p := pooltest.New(t, 1<<20)
	s := NewSession(context.Background(), 2, nil)
	a, b := mustAdd(t, s, p, 1), mustAdd(t, s, p, 2)
	if f := s.RemoveForLater([]uint64{a + b + 100}); f != nil {
		t.Fatal("RemoveForLater of an unknown id returned something to run")
	}
	finish := s.RemoveForLater([]uint64{a, b})
	if finish == nil {
		t.Fatal("RemoveForLater of two held transfers returned nothing to run")
	}
	if h := s.Holding(); h.Transfers != 0 {
		t.Fatalf("%d transfers held after RemoveForLater", h.Transfers)
	}
	if st := p.Stats(); st.Allocs != 2 {
		t.Fatalf("%d buffers held before the finish ran, want 2", st.Allocs)
	}
	mustAdd(t, s, p, 3) // under the bound of 2 again
	mustAdd(t, s, p, 4)
	closed := make(chan struct{})
	go func() {
		s.Close(nil, errors.New("test over"))
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned before the finish RemoveForLater returned ran")
	case <-time.After(20 * time.Millisecond):
	}
	finish()
	<-closed
	if st := p.Stats(); st.Allocs != 0 {
		t.Fatalf("%d buffers still held after the finish and Close", st.Allocs)
	}
}
