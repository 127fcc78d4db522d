package gpudirect

import (
	"math/rand/v2"
	"testing"
)

// TestCarverRandom runs seeded random alloc/free traces and checks the free
// list's invariants and that live runs never overlap.
func TestCarverRandom(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		size := (1 + rng.IntN(64)) * carveGranularity * 16
		c := newCarver(size)
		type run struct{ off, size int }
		var live []run
		for step := range 2000 {
			if len(live) > 0 && rng.IntN(3) == 0 {
				i := rng.IntN(len(live))
				c.release(live[i].off, live[i].size)
				live = append(live[:i], live[i+1:]...)
			} else {
				n := rng.IntN(size / 4)
				off, got, ok := c.alloc(n)
				if ok {
					if got < n || got%carveGranularity != 0 || off%carveGranularity != 0 {
						t.Fatalf("seed %d step %d: alloc(%d) = offset %d size %d", seed, step, n, off, got)
					}
					for _, r := range live {
						if off < r.off+r.size && r.off < off+got {
							t.Fatalf("seed %d step %d: [%d,+%d) overlaps live [%d,+%d)", seed, step, off, got, r.off, r.size)
						}
					}
					live = append(live, run{off, got})
				} else if largest(c) >= roundCarve(n) {
					t.Fatalf("seed %d step %d: alloc(%d) failed with a free run of %d", seed, step, n, largest(c))
				}
			}
			if err := c.verify(); err != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, err)
			}
		}
		for _, r := range live {
			c.release(r.off, r.size)
		}
		if len(c.free) != 1 || c.free[0] != (span{0, size}) || c.used != 0 {
			t.Fatalf("seed %d: after freeing everything: %+v, used %d", seed, c.free, c.used)
		}
	}
}

func largest(c *carver) int {
	m := 0
	for _, s := range c.free {
		m = max(m, s.len)
	}
	return m
}

func TestCarverZeroAndFull(t *testing.T) {
	c := newCarver(1024)
	a, sa, _ := c.alloc(0)
	b, sb, _ := c.alloc(0)
	if a == b || sa != carveGranularity || sb != carveGranularity {
		t.Errorf("zero-byte runs at %d and %d, sizes %d %d", a, b, sa, sb)
	}
	if _, _, ok := c.alloc(1024); ok {
		t.Error("alloc of the whole arena succeeded with two runs taken")
	}
	c.release(a, sa)
	c.release(b, sb)
	if off, _, ok := c.alloc(1024); !ok || off != 0 {
		t.Errorf("whole arena after freeing: %d, %v", off, ok)
	}
	if err := newCarver(0).verify(); err != nil {
		t.Error(err)
	}
}
