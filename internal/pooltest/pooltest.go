// Package pooltest gives tests a memory pool that must be empty when the
// test ends.
package pooltest

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/mempool"
)

// New returns a pool of one arena of size bytes (its limit too); when the
// test ends, a buffer still outstanding fails it, and the pool is closed.
func New(t testing.TB, size int) *mempool.Pool {
	t.Helper()
	p, err := mempool.NewPool(mempool.WithArenaSize(size), mempool.WithLimit(int64(size)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if st := p.Stats(); st.Allocs != 0 {
			t.Errorf("%d buffers outstanding", st.Allocs)
		}
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}
