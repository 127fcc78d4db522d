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
