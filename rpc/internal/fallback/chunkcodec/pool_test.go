package chunkcodec

import (
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc/mem"
)

// countingPool is a mem.BufferPool that records every buffer it hands out
// and every return, so tests can prove that each buffer is returned exactly
// once and none leaks.
type countingPool struct {
	mu      sync.Mutex
	out     map[*[]byte]bool // handed out, not yet returned
	gets    int
	puts    int
	badPuts []string
}

func newCountingPool() *countingPool {
	return &countingPool{out: make(map[*[]byte]bool)}
}

func (p *countingPool) Get(n int) *[]byte {
	b := make([]byte, n)
	h := &b
	p.mu.Lock()
	p.out[h] = true
	p.gets++
	p.mu.Unlock()
	return h
}

func (p *countingPool) Put(h *[]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.puts++
	if !p.out[h] {
		p.badPuts = append(p.badPuts, fmt.Sprintf("Put of %p which is not out (double free or foreign buffer)", h))
		return
	}
	delete(p.out, h)
}

// buffer returns a pooled, refcounted mem.Buffer holding a copy of b. Its
// capacity is over 1 KiB, since mem.NewBuffer does not refcount smaller
// slices; its length is len(b).
func (p *countingPool) buffer(b []byte) mem.Buffer {
	h := p.Get(max(len(b), 2048))
	*h = (*h)[:len(b)]
	copy(*h, b)
	return mem.NewBuffer(h, p)
}

// split copies b into pooled buffers of at most size bytes each.
func (p *countingPool) split(b []byte, size int) mem.BufferSlice {
	var out mem.BufferSlice
	for len(b) > 0 {
		n := min(size, len(b))
		out = append(out, p.buffer(b[:n]))
		b = b[n:]
	}
	return out
}

func (p *countingPool) outstanding() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.out)
}

// check fails t when a buffer is still out or was returned wrongly.
func (p *countingPool) check(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.badPuts {
		t.Error(s)
	}
	if len(p.out) != 0 {
		t.Errorf("%d of %d pooled buffers were never returned", len(p.out), p.gets)
	}
}

// releaseCounter counts calls of its release function.
type releaseCounter struct {
	mu sync.Mutex
	n  int
}

func (r *releaseCounter) release() {
	r.mu.Lock()
	r.n++
	r.mu.Unlock()
}

func (r *releaseCounter) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}
