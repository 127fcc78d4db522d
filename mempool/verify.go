package mempool

import (
	"fmt"
	"slices"
)

// checkLocked verifies the allocator's structures after an operation when
// the invariants are on, and panics at the first inconsistency.
func (p *Pool) checkLocked() {
	if !invariants {
		return
	}
	if err := p.verifyLocked(); err != nil {
		panic(err)
	}
}

// verify checks every allocator invariant and returns the first violation.
func (p *Pool) verify() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.verifyLocked()
}

// verifyLocked checks that each arena's chunks tile it exactly, in address
// order and fully coalesced; that the bins hold exactly the free chunks, in
// treap order and in the right bin; and that the pool's counters add up.
// It takes time linear in the number of chunks.
func (p *Pool) verifyLocked() error {
	var inUse, reserved int64
	var live, free int
	if !slices.IsSortedFunc(p.arenas, func(a, b *Arena) int { return cmpUintptr(a.addr, b.addr) }) {
		return fmt.Errorf("mempool: arenas not in address order")
	}
	if located := p.located.Load(); located != nil && !slices.Equal(*located, p.arenas) {
		return fmt.Errorf("mempool: Locate's arena list is stale")
	}
	for _, a := range p.arenas {
		if a.first == nil || a.first.prev != nil {
			return fmt.Errorf("mempool: %v: bad first chunk", a)
		}
		off, prevFree := 0, false
		var used int64
		for c := a.first; c != nil; c = c.next {
			switch {
			case c.arena != a:
				return fmt.Errorf("mempool: %v: chunk at %d belongs to %v", a, c.off, c.arena)
			case c.off != off:
				return fmt.Errorf("mempool: %v: chunk at %d, want %d (gap or overlap)", a, c.off, off)
			case c.size <= 0 || c.size%p.gran != 0:
				return fmt.Errorf("mempool: %v: chunk at %d has size %d", a, c.off, c.size)
			case c.next != nil && c.next.prev != c:
				return fmt.Errorf("mempool: %v: chunk at %d: broken back link", a, c.off)
			case c.free && prevFree:
				return fmt.Errorf("mempool: %v: free chunk at %d not coalesced with its predecessor", a, c.off)
			}
			if c.free {
				free++
			} else {
				live++
				used += int64(c.size)
			}
			prevFree = c.free
			off += c.size
		}
		if off != len(a.mem) {
			return fmt.Errorf("mempool: %v: chunks cover %d bytes", a, off)
		}
		if used != a.used {
			return fmt.Errorf("mempool: %v: used %d, chunks say %d", a, a.used, used)
		}
		inUse += used
		reserved += int64(len(a.mem))
	}
	switch {
	case inUse != p.inUse:
		return fmt.Errorf("mempool: in use %d, chunks say %d", p.inUse, inUse)
	case int64(live) != p.allocs:
		return fmt.Errorf("mempool: %d live allocations, chunks say %d", p.allocs, live)
	case reserved != p.reserved:
		return fmt.Errorf("mempool: reserved %d, arenas say %d", p.reserved, reserved)
	case p.requested > p.inUse:
		return fmt.Errorf("mempool: requested %d > in use %d", p.requested, p.inUse)
	case p.inUse > p.peak:
		return fmt.Errorf("mempool: in use %d > peak %d", p.inUse, p.peak)
	case p.reserved+p.pending > p.opts.limit:
		return fmt.Errorf("mempool: reserved %d + pending %d > limit %d", p.reserved, p.pending, p.opts.limit)
	}
	inBins := 0
	for i, root := range p.bfc.bins {
		if (root != nil) != (p.bfc.nonEmpty&(1<<i) != 0) {
			return fmt.Errorf("mempool: bin %d: bitmap disagrees", i)
		}
		var prev *chunk
		var err error
		var walk func(t *chunk, depth int) int
		walk = func(t *chunk, depth int) int {
			if t == nil || err != nil {
				return 0
			}
			n := walk(t.left, depth+1)
			switch {
			case !t.free:
				err = fmt.Errorf("mempool: bin %d holds a live chunk", i)
			case int(t.bin) != i || binIndex(t.size) != i:
				err = fmt.Errorf("mempool: chunk of %d bytes in bin %d", t.size, i)
			case prev != nil && !before(prev, t):
				err = fmt.Errorf("mempool: bin %d out of order", i)
			case t.left != nil && t.left.prio > t.prio, t.right != nil && t.right.prio > t.prio:
				err = fmt.Errorf("mempool: bin %d breaks the heap order", i)
			case depth > 200:
				err = fmt.Errorf("mempool: bin %d is a cycle or degenerate", i)
			}
			prev = t
			return n + 1 + walk(t.right, depth+1)
		}
		inBins += walk(root, 0)
		if err != nil {
			return err
		}
	}
	if inBins != free || p.bfc.freeChunks != free {
		return fmt.Errorf("mempool: %d free chunks, %d in bins, counter %d", free, inBins, p.bfc.freeChunks)
	}
	return nil
}
