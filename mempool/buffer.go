package mempool

import (
	"fmt"
	"sync/atomic"
)

// Buffer is a reference-counted run of a pool's memory. It starts with one
// reference; Retain adds one and Release drops one, and the last Release
// gives the memory back to the pool. Its methods are safe for concurrent
// use.
type Buffer struct {
	pool  *Pool
	arena *Arena
	chunk *chunk // guarded by pool.mu; nil once freed
	off   int
	n     int
	refs  atomic.Int32
}

// Bytes returns the buffer's n bytes, with the capacity clamped to n. The
// memory is valid until the last Release; after it, Bytes returns nil.
func (b *Buffer) Bytes() []byte {
	if b.arena == nil || b.refs.Load() <= 0 {
		return nil
	}
	return b.arena.mem[b.off : b.off+b.n : b.off+b.n]
}

// Len is the buffer's size as asked of Alloc.
func (b *Buffer) Len() int { return b.n }

// Arena is the arena holding the buffer, nil for an empty buffer.
func (b *Buffer) Arena() *Arena { return b.arena }

// Offset is the offset of Bytes()[0] in the arena.
func (b *Buffer) Offset() int { return b.off }

// Addr is the address of Bytes()[0], 0 for an empty buffer.
func (b *Buffer) Addr() uintptr {
	if b.arena == nil {
		return 0
	}
	return b.arena.addr + uintptr(b.off)
}

// Retain adds a reference. Retaining a buffer whose last reference is gone
// is a use after free; Retain panics rather than resurrect memory that may
// already belong to another buffer.
func (b *Buffer) Retain() {
	for {
		r := b.refs.Load()
		if r <= 0 {
			panic("mempool: Retain of a released Buffer")
		}
		if b.refs.CompareAndSwap(r, r+1) {
			return
		}
	}
}

// Release drops a reference and frees the memory with the last one.
// Releasing more times than retained returns ErrDoubleRelease and touches
// nothing; under the invariants build tag (and -race) it panics.
func (b *Buffer) Release() error {
	switch r := b.refs.Add(-1); {
	case r > 0:
		return nil
	case r < 0:
		if invariants {
			panic(ErrDoubleRelease)
		}
		return ErrDoubleRelease
	}
	if b.pool != nil {
		b.pool.release(b)
	}
	return nil
}

// String describes the buffer for logs.
func (b *Buffer) String() string {
	if b.arena == nil {
		return "buffer (empty)"
	}
	return fmt.Sprintf("buffer %d bytes at arena %d offset %d", b.n, b.arena.id, b.off)
}
