//go:build linux

package mempool

import (
	"errors"
	"math/rand/v2"
	"testing"
)

// randomSize draws an allocation size from 1 B to 64 MiB, mostly small,
// like tensors: many under 64 KiB, fewer large ones, and 64 MiB rarely
// enough that the pool stays modest.
func randomSize(rng *rand.Rand) int {
	switch r := rng.IntN(10000); {
	case r < 5000:
		return 1 + rng.IntN(4<<10)
	case r < 8000:
		return 1 + rng.IntN(256<<10)
	case r < 9600:
		return 1 + rng.IntN(4<<20)
	case r < 9990:
		return 1 + rng.IntN(24<<20)
	default:
		return 32<<20 + rng.IntN(32<<20+1)
	}
}

type liveBuffer struct {
	b   *Buffer
	tag byte
}

// TestRandomTraces runs seeded random alloc/free traces and checks, after
// every operation, that no two live buffers overlap, that the accounting is
// exact and, at the end, that every arena has coalesced back to one free
// chunk. With the invariants on (the invariants tag, -race), the allocator
// also verifies all its chunk lists and bins after every operation.
func TestRandomTraces(t *testing.T) {
	for _, tc := range []struct {
		name string
		seed uint64
		ops  int
		opts []Option
	}{
		{"default", 1, 100_000, nil},
		{"aligned-4k-release", 2, 20_000, []Option{WithAlignment(4096), WithReleaseEmptyArenas(true)}},
		{"memfd", 3, 10_000, []Option{WithBacking(BackingMemfd)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := append([]Option{WithArenaSize(4 << 20), WithLimit(256 << 20)}, tc.opts...)
			runTrace(t, tc.seed, tc.ops, newTestPool(t, opts...))
		})
	}
}

func runTrace(t *testing.T, seed uint64, ops int, p *Pool) {
	rng := rand.New(rand.NewPCG(seed, seed))
	var live []liveBuffer
	var requested, minInUse, maxInUse int64
	var total int64
	gran := int64(p.gran)
	free := func(i int) {
		lb := live[i]
		mem := lb.b.Bytes()
		if mem[0] != lb.tag || mem[len(mem)-1] != lb.tag {
			t.Fatalf("%v: tag overwritten: another buffer overlapped it", lb.b)
		}
		n := int64(lb.b.Len())
		rounded := (n + gran - 1) / gran * gran
		requested -= n
		minInUse -= rounded
		maxInUse -= rounded + int64(maxSliver(int(rounded), p.gran))
		mustRelease(t, lb.b)
		live[i] = live[len(live)-1]
		live = live[:len(live)-1]
	}
	target := 64
	for op := 0; op < ops; op++ {
		if op%5000 == 0 {
			target = 16 + rng.IntN(200) // vary the working set
		}
		if len(live) > 0 && (len(live) >= target || rng.IntN(2) == 0) {
			free(rng.IntN(len(live)))
		} else {
			n := randomSize(rng)
			b, err := p.TryAlloc(n)
			if errors.Is(err, ErrExhausted) {
				if len(live) == 0 {
					t.Fatalf("op %d: %d bytes exhausted an empty pool", op, n)
				}
				free(rng.IntN(len(live)))
				continue
			}
			if err != nil {
				t.Fatalf("op %d: TryAlloc(%d): %v", op, n, err)
			}
			checkNewBuffer(t, p, b, n, live)
			tag := byte(op) | 1
			mem := b.Bytes()
			mem[0], mem[n-1] = tag, tag
			live = append(live, liveBuffer{b, tag})
			rounded := (int64(n) + gran - 1) / gran * gran
			requested += int64(n)
			minInUse += rounded
			maxInUse += rounded + int64(maxSliver(int(rounded), p.gran))
			total++
		}
		s := p.Stats()
		if s.Requested != requested || s.Allocs != int64(len(live)) || s.TotalAllocs != total {
			t.Fatalf("op %d: Stats %+v; want Requested %d, Allocs %d, TotalAllocs %d", op, s, requested, len(live), total)
		}
		if s.InUse < minInUse || s.InUse > maxInUse || s.Reserved > 256<<20 || s.InUse+s.LargestFree > s.Reserved {
			t.Fatalf("op %d: Stats %+v; want InUse in [%d, %d]", op, s, minInUse, maxInUse)
		}
		if !invariants && op%1000 == 0 {
			if err := p.verify(); err != nil {
				t.Fatalf("op %d: %v", op, err)
			}
		}
	}
	s := p.Stats()
	t.Logf("%d ops: peak %d MiB, reserved %d MiB in %d arenas, %d live, fragmentation %.3f",
		ops, s.Peak>>20, s.Reserved>>20, s.Arenas, s.Allocs, s.Fragmentation)
	for len(live) > 0 {
		free(len(live) - 1)
	}
	// Everything freed: each arena is one free chunk again.
	p.mu.Lock()
	for _, a := range p.arenas {
		if c := a.first; !c.free || c.next != nil || c.size != len(a.mem) {
			t.Errorf("%v did not coalesce back to one free chunk", a)
		}
	}
	if p.bfc.freeChunks != len(p.arenas) {
		t.Errorf("%d free chunks in %d arenas", p.bfc.freeChunks, len(p.arenas))
	}
	p.mu.Unlock()
	if s := p.Stats(); s.Fragmentation != 0 && s.Arenas == 1 {
		t.Errorf("fragmentation %.3f with one empty arena", s.Fragmentation)
	}
	closePool(t, p)
}

// checkNewBuffer checks a fresh buffer's shape and that it overlaps no live
// buffer.
func checkNewBuffer(t *testing.T, p *Pool, b *Buffer, n int, live []liveBuffer) {
	t.Helper()
	mem := b.Bytes()
	if len(mem) != n || cap(mem) != n || b.Addr()%uintptr(p.gran) != 0 {
		t.Fatalf("%v: len %d cap %d at %#x", b, len(mem), cap(mem), b.Addr())
	}
	if a, off, ok := p.Locate(b.Addr() + uintptr(n-1)); !ok || a != b.Arena() || off != b.Offset()+n-1 {
		t.Fatalf("Locate(end of %v) = %v %d %v", b, a, off, ok)
	}
	lo, hi := b.Addr(), b.Addr()+uintptr(n)
	for _, lb := range live {
		if l, h := lb.b.Addr(), lb.b.Addr()+uintptr(lb.b.Len()); lo < h && l < hi {
			t.Fatalf("%v overlaps live %v", b, lb.b)
		}
	}
}

// TestTrainingTraceFragmentation logs the fragmentation a training-like
// trace leaves (see trainingTrace). It asserts only what must hold; the
// figures are for reading.
func TestTrainingTraceFragmentation(t *testing.T) {
	p := newTestPool(t, WithArenaSize(16<<20), WithLimit(1<<30))
	r := trainingTrace(p, 50, 7)
	t.Logf("%d allocations in 50 steps; peak in use %.1f MiB, reserved %.1f MiB",
		r.allocs, float64(r.peakInUse)/(1<<20), float64(r.reserved)/(1<<20))
	t.Logf("fragmentation at the steps' peaks: mean %.3f, max %.3f; free share of reserved at peaks %.3f",
		r.meanPeakFrag, r.maxPeakFrag, r.wasteAtPeak)
	t.Logf("after the last step (parameters live: %.1f MiB): fragmentation %.3f, largest free %.1f MiB",
		float64(r.inUse)/(1<<20), r.endFrag, float64(r.largestFreeAtEnd)/(1<<20))
	if r.endFrag < 0 || r.endFrag > 1 || r.maxPeakFrag > 1 {
		t.Errorf("fragmentation out of [0, 1]: %+v", r)
	}
	closePool(t, p)
}
