package softrc

import "testing"

// TestTakeFront: the entries taken are cleared (no reference kept), and a
// queue taken whole keeps its memory, so that appending to it after an
// exchange needs none new.
func TestTakeFront(t *testing.T) {
	a, b, c := &SendWR{ID: 1}, &SendWR{ID: 2}, &SendWR{ID: 3}
	q := append(make([]*SendWR, 0, 4), a, b, c)
	rest := TakeFront(q, 1)
	if len(rest) != 2 || rest[0] != b || q[0] != nil {
		t.Fatalf("TakeFront(q, 1) = %v, q[0] %v: want [b c], q[0] cleared", rest, q[0])
	}
	empty := TakeFront(rest, 2)
	if len(empty) != 0 || rest[0] != nil || rest[1] != nil {
		t.Fatalf("TakeFront(rest, 2) = %v, rest %v: want empty, rest cleared", empty, rest)
	}
	if cap(empty) != cap(rest) {
		t.Errorf("a queue taken whole kept cap %d, want its own %d", cap(empty), cap(rest))
	}
	// One request at a time, sent and acknowledged: the queue never moves.
	q = make([]*SendWR, 0, 1)
	allocs := testing.AllocsPerRun(100, func() {
		q = append(q, a)
		q = TakeFront(q, 1)
	})
	if allocs != 0 {
		t.Errorf("a queue appended to and emptied allocated %.1f times a turn, want 0", allocs)
	}
}
