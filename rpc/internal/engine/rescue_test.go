package engine

import (
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// detacher is a verbs.Detacher whose deliveries are numbered, and which
// records a Detach of the one under way.
type detacher struct {
	tok      atomic.Uint64
	from     atomic.Uint64 // the first token whose Detach closes detached
	detached chan struct{}
}

func (d *detacher) DeliveryToken() uint64 { return d.tok.Add(1) }

func (d *detacher) Detach(tok uint64) bool {
	if tok != d.tok.Load() {
		return false
	}
	if tok >= d.from.Load() {
		close(d.detached)
	}
	return true
}

// TestRescueCheck: the watchdog's look at a link sees whether a call
// began since its previous look, how long the running one has run, and
// leaves behind one that has run RescueAfter.
func TestRescueCheck(t *testing.T) {
	d := &detacher{detached: make(chan struct{})}
	r := &rescue{det: d}
	now := time.Now().UnixNano()
	if began, ran := r.check(now); began || ran != 0 {
		t.Fatalf("no call yet: began %v, ran %v", began, ran)
	}
	// A call begins and ends between two looks.
	r.armed.Store(now + 1)
	if began, ran := r.check(now + 2); !began || ran != 0 {
		t.Fatalf("a call that began and ended: began %v, ran %v", began, ran)
	}
	if began, _ := r.check(now + 3); began {
		t.Fatal("the same call seen as begun twice")
	}
	// One runs: seen young, then left behind.
	r.tok.Store(d.DeliveryToken())
	r.armed.Store(now + 10)
	r.state.Store(rescueRunning)
	if began, ran := r.check(now + 10 + int64(time.Microsecond)); !began || ran != time.Microsecond {
		t.Fatalf("a running call: began %v, ran %v", began, ran)
	}
	if _, ran := r.check(now + 10 + int64(RescueAfter)); ran != 0 || r.detaches.Load() != 1 || r.state.Load() != rescueDetached {
		t.Fatalf("a call past RescueAfter: ran %v, %d detaches, state %d", ran, r.detaches.Load(), r.state.Load())
	}
	select {
	case <-d.detached:
	default:
		t.Fatal("the call past RescueAfter was not detached")
	}
}

// TestWatchdogAfterShortCalls: after a steady run of short calls, when
// the watchdog looks least often, a call that blocks is still left
// behind, within dogEvery and RescueAfter.
func TestWatchdogAfterShortCalls(t *testing.T) {
	defer leakcheck.Check(t)
	d := &detacher{detached: make(chan struct{})}
	d.from.Store(math.MaxUint64) // a short call left behind (a loaded machine) closes nothing
	l := &Link{}
	l.lastOfBatch.Store(true)
	l.rescue = newRescue(d)
	defer dog.drop(l.rescue)
	for end := time.Now().Add(4 * dogEvery); time.Now().Before(end); {
		short := func() { // 20 µs of work (a sleep that short takes a millisecond or so)
			for t0 := time.Now(); time.Since(t0) < 20*time.Microsecond; {
			}
		}
		if !l.runHere(short, nil) {
			t.Fatal("a short call was not run here")
		}
	}
	// (A short call the machine held up past RescueAfter is left behind
	// too: counted before.)
	before := l.Detaches()
	d.from.Store(d.tok.Load() + 1)
	start := time.Now()
	ran := l.runHere(func() {
		select {
		case <-d.detached:
		case <-time.After(10 * time.Second):
		}
	}, nil)
	if !ran {
		t.Fatal("the blocking call was not run here")
	}
	// The watchdog counts the detach right after Detach returns, which
	// may be after the blocking call saw it.
	for deadline := time.Now().Add(10 * time.Second); l.Detaches() == before && time.Now().Before(deadline); {
		time.Sleep(100 * time.Microsecond)
	}
	if l.Detaches() != before+1 {
		t.Fatalf("the blocking call was not left behind in %v (%d detaches, %d before it)", time.Since(start), l.Detaches(), before)
	}
	t.Logf("left behind after %v", time.Since(start))
}
