package engine

import (
	"context"
	"testing"
	"time"
)

// TestAcquireWaitsForCredits: an Acquire that finds no credit waits until
// one comes back, past a return that only refills the reserved slot, and
// one whose context ends stops waiting; a return with nobody waiting
// leaves the wake-up channel as it is (no new one a frame).
func TestAcquireWaitsForCredits(t *testing.T) {
	l := &Link{Dead: make(chan struct{})}
	l.EnableFrames(4096, nil, nil)
	f := l.Frames
	f.Mu.Lock()
	f.Credits, f.reserve, f.Outstanding = 0, 0, 3
	f.Mu.Unlock()
	waiting := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			f.Mu.Lock()
			w := f.waiting
			f.Mu.Unlock()
			if w == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d Acquires waiting, want %d", w, n)
			}
		}
	}
	got := make(chan error, 1)
	go func() { got <- l.Acquire(context.Background(), false) }()
	waiting(1)
	f.Refund(0, nil, nil) // refills the reserved slot only
	waiting(1)
	select {
	case err := <-got:
		t.Fatalf("Acquire returned (%v) with only the reserved slot back", err)
	default:
	}
	f.Refund(0, nil, nil) // a credit
	if err := <-got; err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	waiting(0)

	ctx, cancel := context.WithCancel(context.Background())
	go func() { got <- l.Acquire(ctx, false) }()
	waiting(1)
	cancel()
	if err := <-got; err == nil {
		t.Fatal("Acquire with its context ended: nil error")
	}
	waiting(0)

	f.Mu.Lock()
	wake := f.wake
	f.Mu.Unlock()
	f.Refund(0, nil, nil)
	f.Mu.Lock()
	same := f.wake == wake
	f.Mu.Unlock()
	if !same {
		t.Error("a credit returned with nobody waiting made a new wake-up channel")
	}
}
