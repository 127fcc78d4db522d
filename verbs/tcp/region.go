package tcp

import (
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// memoryRegion implements verbs.MemoryRegion. Every transfer into or out
// of its bytes holds a reference (acquire/release) while the data moves;
// Deregister waits for those references to go, so that memory the caller
// frees after Deregister is never touched again. Posted work requests hold
// no reference: one that reaches a deregistered region fails.
type memoryRegion struct {
	pd     *domain
	bytes  []byte
	addr   uint64
	key    uint32
	access verbs.Access

	mu    sync.Mutex
	cond  sync.Cond
	users int
	dead  bool
}

func (r *memoryRegion) Addr() uint64         { return r.addr }
func (r *memoryRegion) Len() int             { return len(r.bytes) }
func (r *memoryRegion) Bytes() []byte        { return r.bytes }
func (r *memoryRegion) LocalKey() uint32     { return r.key }
func (r *memoryRegion) RemoteKey() uint32    { return r.key }
func (r *memoryRegion) Access() verbs.Access { return r.access }

// acquire takes a reference; it fails once the region is deregistered.
func (r *memoryRegion) acquire() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead {
		return false
	}
	r.users++
	return true
}

func (r *memoryRegion) isDead() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.dead
}

func (r *memoryRegion) release() {
	r.mu.Lock()
	r.users--
	if r.users == 0 && r.dead {
		r.cond.Broadcast()
	}
	r.mu.Unlock()
}

// Deregister removes the region's key, so later peer accesses fail with a
// remote access error, and waits for transfers in progress on its memory
// to finish. Work requests posted on it that have not moved their data yet
// fail with StatusLocalProtection (and, like any local error, move their
// queue pair to ERR).
func (r *memoryRegion) Deregister() error {
	r.pd.removeRegion(r)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead {
		return fmt.Errorf("tcp: region %#x: %w", r.key, verbs.ErrClosed)
	}
	r.dead = true
	for r.users > 0 {
		r.cond.Wait()
	}
	return nil
}

// span checks that [off, off+n) lies inside the region and returns it.
func (r *memoryRegion) span(off uint64, n uint64) ([]byte, bool) {
	size := uint64(len(r.bytes))
	if off > size || n > size-off {
		return nil, false
	}
	return r.bytes[off : off+n : off+n], true
}
