package ibv

import (
	"math/rand/v2"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestSlotsRandom runs random take/put traces against a map model: a slot
// is never handed out twice, put returns what take stored, and the table
// refuses exactly when it is full.
func TestSlotsRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trace := range 50 {
		n := 1 + r.IntN(64)
		s := newSlots(n)
		live := map[uint32]slot{}
		for step := range 2000 {
			if r.IntN(2) == 0 {
				want := slot{id: r.Uint64(), op: verbs.OpWrite, length: r.IntN(1 << 20)}
				i, ok := s.take(want)
				if ok != (len(live) < n) {
					t.Fatalf("trace %d step %d: take ok=%v with %d of %d live", trace, step, ok, len(live), n)
				}
				if !ok {
					continue
				}
				if _, dup := live[i]; dup || int(i) >= n {
					t.Fatalf("trace %d step %d: take returned slot %d, live or out of range", trace, step, i)
				}
				live[i] = want
			} else {
				for i, want := range live {
					got, ok := s.put(i)
					if !ok || got != want {
						t.Fatalf("trace %d step %d: put(%d) = %+v, %v; want %+v", trace, step, i, got, ok, want)
					}
					delete(live, i)
					break
				}
			}
			if s.outstanding() != len(live) {
				t.Fatalf("trace %d step %d: outstanding %d, want %d", trace, step, s.outstanding(), len(live))
			}
		}
	}
	s := newSlots(1)
	if _, ok := s.put(5); ok {
		t.Fatal("put of an index outside the table succeeded")
	}
	if _, ok := s.put(0); ok {
		t.Fatal("put of a free slot succeeded")
	}
	i, _ := s.take(slot{id: 9})
	s.put(i)
	if _, ok := s.put(i); ok || s.outstanding() != 0 {
		t.Fatal("second put of a slot succeeded")
	}
}

// TestSendSlotsUnsignaled: a completion retires the unsignaled requests
// posted before it, in order, and only those.
func TestSendSlotsUnsignaled(t *testing.T) {
	s := newSendSlots(4)
	a, _ := s.take(slot{id: 1, unsignaled: true})
	b, _ := s.take(slot{id: 2, unsignaled: true})
	c, _ := s.take(slot{id: 3})
	d, _ := s.take(slot{id: 4, unsignaled: true})
	if _, ok := s.take(slot{id: 5}); ok || s.room() != 0 {
		t.Fatal("a full send queue took a fifth request")
	}
	sl, retired, skipped, ok := s.complete(c)
	if !ok || sl.id != 3 || retired != 2 || skipped != 0 {
		t.Fatalf("complete(c) = %+v, %d retired, %d skipped, %v; want id 3 retiring 2", sl, retired, skipped, ok)
	}
	if s.outstanding() != 1 {
		t.Fatalf("outstanding %d after the signaled completion, want 1 (the later unsignaled)", s.outstanding())
	}
	for _, i := range []uint32{a, b, c} {
		if _, _, _, ok := s.complete(i); ok {
			t.Fatalf("slot %d completed twice", i)
		}
	}
	// d fails: its own completion comes.
	if sl, retired, _, ok := s.complete(d); !ok || sl.id != 4 || retired != 0 || s.outstanding() != 0 {
		t.Fatalf("complete(d) = %+v, %d, %v; outstanding %d", sl, retired, ok, s.outstanding())
	}
	// The ring keeps working after wrapping around.
	for round := range 10 {
		x, _ := s.take(slot{id: uint64(round), unsignaled: true})
		y, _ := s.take(slot{id: uint64(round + 100)})
		if sl, retired, _, ok := s.complete(y); !ok || sl.id != uint64(round+100) || retired != 1 {
			t.Fatalf("round %d: complete = %+v, %d, %v", round, sl, retired, ok)
		}
		_ = x
	}
	if s.outstanding() != 0 {
		t.Fatalf("outstanding %d, want 0", s.outstanding())
	}
}

func TestSendSlotsSkippedSignaled(t *testing.T) {
	s := newSendSlots(3)
	s.take(slot{id: 1})
	b, _ := s.take(slot{id: 2})
	if _, retired, skipped, ok := s.complete(b); !ok || retired != 1 || skipped != 1 {
		t.Fatalf("complete out of order: retired %d, skipped %d, %v; want 1, 1", retired, skipped, ok)
	}
}

func TestSendSlotsUnwind(t *testing.T) {
	s := newSendSlots(4)
	a, _ := s.take(slot{id: 1})
	s.take(slot{id: 2})
	s.take(slot{id: 3})
	s.unwindLast(2) // the device refused the last two
	if s.outstanding() != 1 {
		t.Fatalf("outstanding %d after unwinding 2 of 3, want 1", s.outstanding())
	}
	c, _ := s.take(slot{id: 4})
	if _, retired, _, ok := s.complete(c); !ok || retired != 1 {
		t.Fatalf("complete after unwind: retired %d, %v; want 1 (only a)", retired, ok)
	}
	if _, _, _, ok := s.complete(a); ok {
		t.Fatal("a completed after it was retired")
	}
}

func TestInternalOp(t *testing.T) {
	// A waiter that sees the completion.
	op := newInternalOp()
	s := newSendSlots(2)
	i, _ := s.take(slot{wait: op})
	sl, _, _, _ := s.complete(i)
	sl.wait.finish(verbs.StatusSuccess, nil)
	<-op.done
	if st, err := op.result(); st != verbs.StatusSuccess || err != nil {
		t.Fatalf("result = %s, %v", st, err)
	}
	op.finish(verbs.StatusFlushed, nil) // later finishes do not count
	if st, _ := op.result(); st != verbs.StatusSuccess {
		t.Fatal("a second finish changed the result")
	}
	if op.abandon(func() {}) {
		t.Fatal("abandon of a finished op succeeded")
	}

	// A waiter that gives up: the late completion runs the cleanup.
	op = newInternalOp()
	cleaned := 0
	if !op.abandon(func() { cleaned++ }) {
		t.Fatal("abandon of a pending op failed")
	}
	op.finish(verbs.StatusSuccess, nil)
	if cleaned != 1 {
		t.Fatalf("cleanup ran %d times, want 1", cleaned)
	}

	// A destroyed queue pair finishes what is outstanding.
	op = newInternalOp()
	s = newSendSlots(2)
	s.take(slot{id: 9})
	s.take(slot{wait: op})
	s.finishWaiters(verbs.StatusFlushed, verbs.ErrClosed)
	select {
	case <-op.done:
	default:
		t.Fatal("finishWaiters left an op pending")
	}
	if st, err := op.result(); st != verbs.StatusFlushed || err != verbs.ErrClosed {
		t.Fatalf("result = %s, %v", st, err)
	}
}
