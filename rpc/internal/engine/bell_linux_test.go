package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/callhint"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// heldServer is a framed pair whose server answers a request only when
// the test says so: answer(ref) sends the Fetch answer "bytes" for ref.
func heldServer(t *testing.T) (client *Link, answer func(ref uint64)) {
	t.Helper()
	var mu sync.Mutex
	refs := map[uint64]bool{}
	var answers sync.WaitGroup
	client, server := framedPair(t, func(srv *Link, h frameHeader, body []byte) {
		mu.Lock()
		refs[h.Ref] = true
		mu.Unlock()
	})
	t.Cleanup(answers.Wait) // before the links close
	return client, func(ref uint64) {
		for {
			mu.Lock()
			got := refs[ref]
			mu.Unlock()
			if got {
				break
			}
			time.Sleep(time.Millisecond)
		}
		answers.Go(func() {
			server.SendFrame(context.Background(), frameFetchResp, 0, ref, okAnswer(t, &pb.FetchResponse{InlineData: []byte("bytes")}), nil)
		})
	}
}

func askFetch(t *testing.T, client *Link, ref uint64) *PendingCall {
	t.Helper()
	pc := client.Frames.Expect(ref, frameFetchResp, fetchAnswer())
	if _, err := client.SendFrame(context.Background(), frameFetchReq, 0, ref, []byte("key"), nil); err != nil {
		t.Fatal(err)
	}
	return pc
}

// tenSeconds bounds a wait that a broken bell would make endless.
func tenSeconds(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantBytes(t *testing.T, r FrameReply, ok bool) {
	t.Helper()
	if !ok {
		t.Fatal("AwaitAnswer gave up with the answer on its way")
	}
	if r.Bad != nil || r.Status != nil || string(r.Msg.(*pb.FetchResponse).InlineData) != "bytes" {
		t.Fatalf("answer: %+v", r)
	}
}

// whenBelled runs f once a caller waits on client's bell.
func whenBelled(client *Link, f func()) {
	go func() {
		for !client.belled.Load() {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(5 * time.Millisecond) // most likely parked in the bell's read by now
		f()
	}()
}

// TestAwaitBellAnswers: on tcp (no verbs.Poller) a caller waits on the
// link's bell and gets its answer, one call after another, including
// answers that came before it waited.
func TestAwaitBellAnswers(t *testing.T) {
	client, answer := heldServer(t)
	if client.bell == nil {
		t.Fatal("a tcp link on Linux has no answer bell")
	}
	for ref := uint64(1); ref <= 20; ref++ {
		pc := askFetch(t, client, ref)
		if ref%2 == 0 {
			answer(ref) // may well be in pc.Ch before AwaitAnswer looks
		} else {
			whenBelled(client, func() { answer(ref) })
		}
		r, ok := client.AwaitAnswer(tenSeconds(t), pc, PollSpin, false)
		wantBytes(t, r, ok)
		if client.belled.Load() {
			t.Fatal("the bell stays taken after its caller got the answer")
		}
	}
}

// TestAwaitBellOneCaller: while one caller waits on the bell, another is
// told to wait on its own channel at once, and both get their answers.
func TestAwaitBellOneCaller(t *testing.T) {
	client, answer := heldServer(t)
	first, second := askFetch(t, client, 1), askFetch(t, client, 2)
	type result struct {
		r  FrameReply
		ok bool
	}
	done := make(chan result)
	go func() {
		r, ok := client.AwaitAnswer(tenSeconds(t), first, PollSpin, false)
		done <- result{r, ok}
	}()
	for !client.belled.Load() {
		time.Sleep(time.Millisecond)
	}
	if _, ok := client.AwaitAnswer(context.Background(), second, PollSpin, false); ok {
		t.Fatal("a second caller took the bell while the first waited on it")
	}
	answer(2)
	select {
	case <-second.Ch:
		r := second.Reply()
		wantBytes(t, r, true)
	case <-time.After(10 * time.Second):
		t.Fatal("the second caller's answer never came")
	}
	answer(1)
	res := <-done
	wantBytes(t, res.r, res.ok)
}

// TestAwaitBellContextEnds: a caller waiting on the bell returns when its
// context ends, and the bell it leaves (rung by the context, and later by
// the late answer) serves the next caller.
func TestAwaitBellContextEnds(t *testing.T) {
	client, answer := heldServer(t)
	pc := askFetch(t, client, 1)
	ctx, cancel := context.WithCancel(context.Background())
	whenBelled(client, cancel)
	if r, ok := client.AwaitAnswer(ctx, pc, PollSpin, false); ok {
		t.Fatalf("AwaitAnswer answered %+v with no answer sent", r)
	}
	answer(1) // late: it lands in pc.Ch and rings the bell with nobody waiting
	<-pc.Ch
	next := askFetch(t, client, 2)
	whenBelled(client, func() { answer(2) })
	r, ok := client.AwaitAnswer(tenSeconds(t), next, PollSpin, false)
	wantBytes(t, r, ok)
}

// TestAwaitBellLinkFails: a caller waiting on the bell returns when the
// link fails.
func TestAwaitBellLinkFails(t *testing.T) {
	client, _ := heldServer(t)
	pc := askFetch(t, client, 1)
	whenBelled(client, func() { client.Fail(errors.New("test: the link failed")) })
	if r, ok := client.AwaitAnswer(context.Background(), pc, PollSpin, false); ok {
		t.Fatalf("AwaitAnswer answered %+v on a failed link", r)
	}
	select {
	case <-client.Dead:
	default:
		t.Fatal("AwaitAnswer returned before the link failed")
	}
}

// TestAwaitBellLocked: a caller marked as locked to its thread
// (callhint.Locked) gets its answer whether it comes while it watches
// pc.Ch or after the watch, on the bell.
func TestAwaitBellLocked(t *testing.T) {
	spareP(t)
	client, answer := heldServer(t)
	for ref := uint64(1); ref <= 6; ref++ {
		pc := askFetch(t, client, ref)
		if ref%2 == 0 {
			go answer(ref) // while it watches, most likely
		} else {
			whenBelled(client, func() {
				time.Sleep(10 * PollSpin) // past the watch: on the bell
				answer(ref)
			})
		}
		r, ok := client.AwaitAnswer(callhint.Locked(tenSeconds(t)), pc, PollSpin, false)
		wantBytes(t, r, ok)
	}
	// Half the answers came 10 spins late: the link's moving average of
	// the waits is longer than one spin, and the next watch longer too.
	if lately := time.Duration(client.answerWait.Load()); lately <= PollSpin || watchFor(PollSpin, lately) <= PollSpin {
		t.Errorf("after waits of up to %v: the waits lately %v, the next watch %v; want both over one spin (%v)", 10*PollSpin, lately, watchFor(PollSpin, lately), PollSpin)
	}
}

// TestWatchFor: a locked caller watches twice as long as such callers
// waited lately, at least its spin and at most maxWatchFactor spins; with
// no spin, not at all.
func TestWatchFor(t *testing.T) {
	const us = time.Microsecond
	for _, c := range []struct{ spin, lately, want time.Duration }{
		{50 * us, 0, 50 * us},
		{50 * us, 10 * us, 50 * us},
		{50 * us, 60 * us, 120 * us},
		{50 * us, 10 * time.Millisecond, maxWatchFactor * 50 * us},
		{0, 60 * us, 0},
	} {
		if got := watchFor(c.spin, c.lately); got != c.want {
			t.Errorf("watchFor(%v, %v) = %v, want %v", c.spin, c.lately, got, c.want)
		}
	}
}

// TestBellRings: the bell, which is never read, still wakes each waiter:
// a ring before the wait (which ready reports, as a caller's channel
// does), a ring during it, many rings in a row; and a closed bell ends a
// wait with an error.
func TestBellRings(t *testing.T) {
	b := newBell()
	if b == nil {
		t.Fatal("no eventfd")
	}
	var rang atomic.Bool // what the ringer did before ringing
	waited := func(what string, ring func()) {
		t.Helper()
		waitEnds(t, what, func() error { return b.wait(func() bool { return rang.Load() }) }, ring)
	}
	ring := func() { rang.Store(true); b.ring() }
	ring()
	waited("rung before the wait", func() {})
	for i := range 100 {
		rang.Store(false)
		waited(fmt.Sprint("rung during wait ", i), ring)
	}
	for range 1000 {
		ring()
	}
	waited("after many rings", func() {})
	done := make(chan error, 1)
	go func() {
		for {
			if err := b.wait(func() bool { return false }); err != nil {
				done <- err
				return
			}
		}
	}()
	b.close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a closed bell's wait ended without an error")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("closing the bell did not end the wait")
	}
}

// TestBellWaitAllocatesNothing: waiting for an answer on the bell (found
// at once, or after a ring) allocates nothing: the bell keeps what the
// waiter waits for, and its netpoller callback is made once.
func TestBellWaitAllocatesNothing(t *testing.T) {
	b := newBell()
	if b == nil {
		t.Fatal("no eventfd")
	}
	defer b.close()
	pc := &PendingCall{Ch: make(chan struct{}, 1)}
	ctx := context.Background()
	dead := make(chan struct{})
	allocs := testing.AllocsPerRun(200, func() {
		pc.Deliver(FrameReply{})
		b.ring()
		if err := b.waitAnswer(pc, ctx, dead); err != nil {
			t.Fatal(err)
		}
		<-pc.Ch
	})
	if allocs != 0 {
		t.Errorf("waitAnswer allocated %.1f times a wait, want 0", allocs)
	}
}

// TestThreadBellRings: a thread bell's blocking wait ends for an answer
// there before it waits, for a ring during it (100 times), after many
// rings, for its context's end and its link's death; closing it ends a
// blocked wait with an error, and a ring after the close writes nothing.
func TestThreadBellRings(t *testing.T) {
	b := newThreadBell()
	if b == nil {
		t.Fatal("no eventfd")
	}
	pc := &PendingCall{Ch: make(chan struct{}, 1)}
	dead := make(chan struct{})
	waited := func(what string, ctx context.Context, dead <-chan struct{}, during func()) {
		t.Helper()
		waitEnds(t, what, func() error { return b.waitAnswer(pc, ctx, dead) }, during)
	}
	answer := func() { pc.Deliver(FrameReply{}); b.ring() }
	ctx := context.Background()
	pc.Deliver(FrameReply{})
	waited("answered before the wait", ctx, dead, func() {})
	<-pc.Ch
	for i := range 100 {
		waited(fmt.Sprint("answered during wait ", i), ctx, dead, func() {
			if i%2 == 0 {
				blockedOn(b) // in read(2), most likely
			}
			answer()
		})
		<-pc.Ch
	}
	for range 1000 {
		b.ring()
	}
	waited("after many rings", ctx, dead, answer) // the stale rings end a read or two early
	<-pc.Ch
	cctx, cancel := context.WithCancel(ctx)
	waited("context ends", cctx, dead, func() { blockedOn(b); cancel(); b.ring() })
	died := make(chan struct{})
	waited("link dies", ctx, died, func() { blockedOn(b); close(died); b.ring() })

	done := make(chan error, 1)
	go func() { done <- b.waitAnswer(pc, ctx, dead) }()
	blockedOn(b)
	b.close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a closed thread bell's wait ended without an error")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("closing the thread bell did not end the wait")
	}
	b.mu.Lock()
	fd := b.fd
	b.mu.Unlock()
	if fd != -1 {
		t.Fatalf("the thread bell's descriptor %d stays open after its waiter left", fd)
	}
	b.ring() // closed: nothing to write to
	if err := b.waitAnswer(pc, ctx, dead); err == nil {
		t.Fatal("a wait on a closed thread bell did not fail")
	}
}

// blockedOn returns true once a waiter is about to block on b, and most
// likely blocked; false if none did within ten seconds (the test fails
// on its own then, and this helper must not outlive it: the leak check
// would fail every later test too).
func blockedOn(b *threadBell) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		b.mu.Lock()
		w := b.waiting
		b.mu.Unlock()
		if w {
			time.Sleep(time.Millisecond)
			return true
		}
		time.Sleep(100 * time.Microsecond)
	}
	return false
}

// spareP runs the test with at least two Ps: a caller locked to its
// thread watches, and blocks on the thread bell, only while the process
// has a P to spare for the receivers (awaitBell; with one P it parks on
// the netpoller's bell, TestAwaitBellLockedOneP). Under go test -cpu 1,
// or on a machine of one CPU, the test would see that path instead.
func spareP(t *testing.T) {
	if n := runtime.GOMAXPROCS(0); n < 2 {
		runtime.GOMAXPROCS(2)
		t.Cleanup(func() { runtime.GOMAXPROCS(n) })
	}
}

// TestAwaitBellLockedBlocks: a caller locked to its thread whose watch
// ran out waits on the link's thread bell, in a blocking read, not on the
// netpoller's bell, and gets its answer; its context's end and the link's
// failure end that wait too.
func TestAwaitBellLockedBlocks(t *testing.T) {
	spareP(t)
	client, answer := heldServer(t)
	if client.tbell == nil {
		t.Fatal("a tcp link on Linux has no thread bell")
	}
	for ref := uint64(1); ref <= 4; ref++ {
		pc := askFetch(t, client, ref)
		go func() {
			if blockedOn(client.tbell) {
				answer(ref)
			}
		}()
		r, ok := client.AwaitAnswer(callhint.Locked(tenSeconds(t)), pc, 0, false)
		wantBytes(t, r, ok)
		if pc.bell.Load() != nil || pc.tbell.Load() != client.tbell {
			t.Fatal("a locked caller waited on the netpoller's bell, not the thread bell")
		}
	}
	pc := askFetch(t, client, 5)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { blockedOn(client.tbell); cancel() }() // cancelled either way: the wait ends
	if r, ok := client.AwaitAnswer(callhint.Locked(ctx), pc, 0, false); ok {
		t.Fatalf("AwaitAnswer answered %+v with no answer sent", r)
	}
	answer(5) // late: rings the thread bell with nobody waiting
	<-pc.Ch
	pc = askFetch(t, client, 6)
	go func() { blockedOn(client.tbell); client.Fail(errors.New("test: the link failed")) }() // either way
	if r, ok := client.AwaitAnswer(callhint.Locked(context.Background()), pc, 0, false); ok {
		t.Fatalf("AwaitAnswer answered %+v on a failed link", r)
	}
	select {
	case <-client.Dead:
	default:
		t.Fatal("AwaitAnswer returned before the link failed")
	}
}

// waitEnds runs wait in a goroutine and during beside it, and fails the
// test unless wait ends, without an error, within ten seconds.
func waitEnds(t *testing.T, what string, wait func() error, during func()) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- wait() }()
	during()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the wait did not end", what)
	}
}

// TestAwaitBellLockedOneP: with a single P, a caller locked to its thread
// neither watches nor blocks on the thread bell, which would hold the P
// the receiver needs to answer it: it parks on the netpoller's bell, and
// gets its answer.
func TestAwaitBellLockedOneP(t *testing.T) {
	client, answer := heldServer(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	for ref := uint64(1); ref <= 3; ref++ {
		pc := askFetch(t, client, ref)
		whenBelled(client, func() { answer(ref) })
		r, ok := client.AwaitAnswer(callhint.Locked(tenSeconds(t)), pc, PollSpin, false)
		wantBytes(t, r, ok)
		if pc.tbell.Load() != nil || pc.bell.Load() != client.bell {
			t.Fatal("with one P a locked caller waited on the thread bell, not the netpoller's")
		}
	}
	if lockedWaiters.Load() != 0 {
		t.Fatalf("%d locked waiters left counted", lockedWaiters.Load())
	}
}
