package chunkcodec

import (
	"sync/atomic"

	"google.golang.org/grpc/mem"
)

// releasePool is a mem.BufferPool that owns no memory: mem.NewBuffer calls
// Put when the last reference to a buffer is freed, and Put runs release.
type releasePool struct {
	release func()
}

// Get is never called by mem for buffers made with NewBuffer; it allocates
// only to satisfy the interface.
func (p *releasePool) Get(n int) *[]byte {
	b := make([]byte, n)
	return &b
}

func (p *releasePool) Put(*[]byte) { p.release() }

// Wrap returns a mem.Buffer, with one reference, that views b without
// copying it. release, when not nil, runs exactly once, on whichever
// goroutine frees the last reference (the caller's, the codec's or gRPC's);
// it must not block. Until it has run, b must not be modified or reused.
//
// grpc-go refcounts only buffers of more than 1 KiB capacity
// (mem.IsBelowBufferPoolingThreshold). A smaller b is therefore copied
// into a new slice and release runs before Wrap returns. With a nil release
// b is wrapped as a mem.SliceBuffer at any size, with no copy and no
// lifetime tracking: the garbage collector keeps it alive, and the caller
// promises never to modify it.
func Wrap(b []byte, release func()) mem.Buffer {
	if release == nil {
		return mem.SliceBuffer(b)
	}
	if mem.IsBelowBufferPoolingThreshold(cap(b)) {
		c := make([]byte, len(b))
		copy(c, b)
		release()
		return mem.SliceBuffer(c)
	}
	h := new([]byte)
	*h = b
	return mem.NewBuffer(h, &releasePool{release: release})
}

// WrapSlices wraps several views (for example the pieces of a tensor that
// is not contiguous, or many tensors sent back to back) as one BufferSlice
// with one reference per buffer. release, when not nil, runs once, after
// the last reference to the last of them is freed. Empty views are dropped.
// Views of 1 KiB capacity or less are copied as in Wrap.
func WrapSlices(views [][]byte, release func()) mem.BufferSlice {
	out := make(mem.BufferSlice, 0, len(views))
	if release == nil {
		for _, v := range views {
			if len(v) > 0 {
				out = append(out, mem.SliceBuffer(v))
			}
		}
		return out
	}
	// One count per view plus one held while the views are wrapped, so a
	// view released early (a copied small one) cannot fire release early.
	var pending atomic.Int64
	pending.Store(1)
	done := func() {
		if pending.Add(-1) == 0 {
			release()
		}
	}
	for _, v := range views {
		if len(v) == 0 {
			continue
		}
		pending.Add(1)
		out = append(out, Wrap(v, done))
	}
	done()
	return out
}
