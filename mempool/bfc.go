package mempool

import "math/bits"

// This file is the best-fit-with-coalescing allocator (after TensorFlow's
// BFCAllocator) that carves a pool's arenas into buffers. It is not safe for
// concurrent use: the pool calls it with its mutex held.
//
// Every arena is an address-ordered, doubly linked list of chunks that tile
// it exactly; a chunk is either one live buffer or free. Free chunks are also
// kept in bins: bin i holds the sizes in [256·2^i, 256·2^(i+1)), and each bin
// is a treap ordered by (size, address). Best fit is then the least chunk of
// size ≥ n in n's own bin, or failing that the least chunk of the next
// non-empty bin (a bitmap finds it): O(log n) either way. Freeing a chunk
// merges it with a free neighbour on either side (the list finds them in
// O(1)) and reinserts the result: O(log n).

// chunk is a run of an arena's memory, either one live buffer's or free.
type chunk struct {
	arena      *Arena
	off, size  int
	prev, next *chunk // neighbours in address order within the arena
	free       bool

	// Treap links and the chunk's bin, valid while the chunk is free.
	left, right *chunk
	prio        uint32
	bin         uint8
}

func (c *chunk) addr() uintptr { return c.arena.addr + uintptr(c.off) }

// before is the best-fit order of free chunks: smaller first, then lower
// address, so that equal sizes fill memory from the bottom and leave the
// top free to coalesce.
func before(a, b *chunk) bool {
	if a.size != b.size {
		return a.size < b.size
	}
	return a.addr() < b.addr()
}

const numBins = 64

// binIndex is the bin of a free chunk of size bytes, size ≥ Granularity.
func binIndex(size int) int { return bits.Len64(uint64(size)/Granularity) - 1 }

// maxSliver is the most a split may leave unsplit. A chunk larger than the
// request is split only when the remainder is worth keeping on its own: at
// least the granularity and at least 1/16 of the request, and in any case
// once it reaches 1 MiB. So a buffer wastes at most 1/16 of its size (at
// most 1 MiB) on the tail it drags along, and the allocator never makes
// slivers that are tiny next to their neighbour, which would otherwise
// litter the bins between long-lived buffers. The unsplit tail is never
// lost: it is freed together with its buffer.
func maxSliver(request, gran int) int { return min(max(request/16, gran), 1<<20) }

type bfc struct {
	gran       int
	bins       [numBins]*chunk // treap roots
	nonEmpty   uint64          // bit i set when bins[i] is not empty
	freeChunks int
	spare      *chunk // recycled chunk structs, linked through next
	rng        uint64
}

// take removes a best-fit chunk of at least size bytes (a multiple of the
// granularity) from the free bins, splitting off the remainder when it is
// worth keeping. It returns nil when no free chunk is large enough.
func (h *bfc) take(size int) *chunk {
	bin := binIndex(size)
	var c *chunk
	if root := h.bins[bin]; root != nil {
		c = treapCeil(root, size)
	}
	if c == nil {
		higher := h.nonEmpty &^ (uint64(1)<<(bin+1) - 1)
		if bin == numBins-1 || higher == 0 {
			return nil
		}
		c = treapMin(h.bins[bits.TrailingZeros64(higher)])
	}
	h.removeFree(c)
	if rest := c.size - size; rest >= maxSliver(size, h.gran) {
		r := h.newChunk()
		r.arena, r.off, r.size = c.arena, c.off+size, rest
		r.prev, r.next = c, c.next
		if c.next != nil {
			c.next.prev = r
		}
		c.next = r
		c.size = size
		h.insertFree(r)
	}
	c.free = false
	c.arena.used += int64(c.size)
	return c
}

// release frees a chunk taken by take, merging it with free neighbours.
func (h *bfc) release(c *chunk) {
	c.arena.used -= int64(c.size)
	if p := c.prev; p != nil && p.free {
		h.removeFree(p)
		p.size += c.size
		h.unlink(c)
		c = p
	}
	if n := c.next; n != nil && n.free {
		h.removeFree(n)
		c.size += n.size
		h.unlink(n)
	}
	h.insertFree(c)
}

// unlink drops c from its arena's list and recycles it; its predecessor has
// already absorbed its bytes.
func (h *bfc) unlink(c *chunk) {
	c.prev.next = c.next
	if c.next != nil {
		c.next.prev = c.prev
	}
	*c = chunk{next: h.spare}
	h.spare = c
}

// addArena makes the whole of a free.
func (h *bfc) addArena(a *Arena) {
	c := h.newChunk()
	c.arena, c.off, c.size = a, 0, len(a.mem)
	a.first = c
	h.insertFree(c)
}

// removeArena forgets a, which must be empty (one free chunk).
func (h *bfc) removeArena(a *Arena) {
	c := a.first
	if c == nil || !c.free || c.next != nil {
		panic("mempool: removing an arena that is not empty")
	}
	h.removeFree(c)
	a.first = nil
	*c = chunk{next: h.spare}
	h.spare = c
}

// largestFree is the size of the largest free chunk, or 0.
func (h *bfc) largestFree() int {
	if h.nonEmpty == 0 {
		return 0
	}
	return treapMax(h.bins[63-bits.LeadingZeros64(h.nonEmpty)]).size
}

func (h *bfc) newChunk() *chunk {
	c := h.spare
	if c == nil {
		return new(chunk)
	}
	h.spare = c.next
	c.next = nil
	return c
}

func (h *bfc) insertFree(c *chunk) {
	// xorshift64*: treap priorities need to be random, not secret.
	h.rng ^= h.rng >> 12
	h.rng ^= h.rng << 25
	h.rng ^= h.rng >> 27
	c.prio = uint32((h.rng * 2685821657736338717) >> 32)
	c.free, c.left, c.right = true, nil, nil
	c.bin = uint8(binIndex(c.size))
	h.bins[c.bin] = treapInsert(h.bins[c.bin], c)
	h.nonEmpty |= 1 << c.bin
	h.freeChunks++
}

func (h *bfc) removeFree(c *chunk) {
	root := treapDelete(h.bins[c.bin], c)
	h.bins[c.bin] = root
	if root == nil {
		h.nonEmpty &^= 1 << c.bin
	}
	c.left, c.right = nil, nil
	h.freeChunks--
}

// The treap: a binary search tree by before, and a max-heap by prio, which
// keeps its depth O(log n) in expectation.

func treapInsert(t, c *chunk) *chunk {
	if t == nil {
		return c
	}
	if before(c, t) {
		t.left = treapInsert(t.left, c)
		if t.left.prio > t.prio {
			l := t.left
			t.left, l.right = l.right, t
			return l
		}
	} else {
		t.right = treapInsert(t.right, c)
		if t.right.prio > t.prio {
			r := t.right
			t.right, r.left = r.left, t
			return r
		}
	}
	return t
}

func treapDelete(t, c *chunk) *chunk {
	if t == nil {
		panic("mempool: free chunk missing from its bin")
	}
	if t == c {
		return treapJoin(t.left, t.right)
	}
	if before(c, t) {
		t.left = treapDelete(t.left, c)
	} else {
		t.right = treapDelete(t.right, c)
	}
	return t
}

// treapJoin merges two treaps whose keys are all smaller in a than in b.
func treapJoin(a, b *chunk) *chunk {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	case a.prio > b.prio:
		a.right = treapJoin(a.right, b)
		return a
	default:
		b.left = treapJoin(a, b.left)
		return b
	}
}

// treapCeil is the least chunk of at least size bytes, or nil.
func treapCeil(t *chunk, size int) *chunk {
	var best *chunk
	for t != nil {
		if t.size >= size {
			best, t = t, t.left
		} else {
			t = t.right
		}
	}
	return best
}

func treapMin(t *chunk) *chunk {
	for t.left != nil {
		t = t.left
	}
	return t
}

func treapMax(t *chunk) *chunk {
	for t.right != nil {
		t = t.right
	}
	return t
}

func roundUp(n, unit int) int { return (n + unit - 1) &^ (unit - 1) }
