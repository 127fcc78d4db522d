package gpudirect

import (
	"fmt"
	"sort"
)

// carveGranularity is the size every carved run rounds up to: the same as
// mempool's, and enough to keep tensors aligned for any dtype and for the
// NIC's cache lines.
const carveGranularity = 256

// span is a run of an arena, in bytes from its start.
type span struct{ off, len int }

// carver hands out runs of a fixed-size arena: first fit over an
// address-ordered free list, with freed runs merged into their free
// neighbours. Device arenas are few and their buffers large, so the O(n)
// list is simpler than mempool's binned allocator and fast enough. It is
// not safe for concurrent use; its owner locks.
type carver struct {
	size int
	free []span // sorted by off, never adjacent, never empty
	used int
}

func newCarver(size int) *carver {
	c := &carver{size: size}
	if size > 0 {
		c.free = []span{{0, size}}
	}
	return c
}

// roundCarve rounds n up to the granularity; zero-byte requests take one
// granule so that every buffer has a distinct offset.
func roundCarve(n int) int {
	if n <= 0 {
		return carveGranularity
	}
	return (n + carveGranularity - 1) &^ (carveGranularity - 1)
}

// alloc returns the offset of a run of roundCarve(n) bytes.
func (c *carver) alloc(n int) (off, size int, ok bool) {
	size = roundCarve(n)
	for i, s := range c.free {
		if s.len < size {
			continue
		}
		if s.len == size {
			c.free = append(c.free[:i], c.free[i+1:]...)
		} else {
			c.free[i] = span{s.off + size, s.len - size}
		}
		c.used += size
		return s.off, size, true
	}
	return 0, 0, false
}

// release returns the run [off, off+size), merging it with free neighbours.
func (c *carver) release(off, size int) {
	i := sort.Search(len(c.free), func(i int) bool { return c.free[i].off > off })
	s := span{off, size}
	mergePrev := i > 0 && c.free[i-1].off+c.free[i-1].len == off
	mergeNext := i < len(c.free) && off+size == c.free[i].off
	switch {
	case mergePrev && mergeNext:
		c.free[i-1].len += size + c.free[i].len
		c.free = append(c.free[:i], c.free[i+1:]...)
	case mergePrev:
		c.free[i-1].len += size
	case mergeNext:
		c.free[i] = span{off, size + c.free[i].len}
	default:
		c.free = append(c.free, span{})
		copy(c.free[i+1:], c.free[i:])
		c.free[i] = s
	}
	c.used -= size
}

// verify checks the free list's invariants; tests call it after every step.
func (c *carver) verify() error {
	free := 0
	for i, s := range c.free {
		if s.len <= 0 || s.off < 0 || s.off+s.len > c.size {
			return fmt.Errorf("free run %d %+v outside the arena of %d bytes", i, s, c.size)
		}
		if i > 0 && c.free[i-1].off+c.free[i-1].len >= s.off {
			return fmt.Errorf("free runs %d %+v and %d %+v overlap or touch", i-1, c.free[i-1], i, s)
		}
		free += s.len
	}
	if free+c.used != c.size {
		return fmt.Errorf("free %d + used %d != size %d", free, c.used, c.size)
	}
	return nil
}
