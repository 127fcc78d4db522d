package verbs

import (
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/mempool"
)

// PoolRegistration keeps every arena of a mempool.Pool registered with one
// protection domain: arenas are registered once, when they join the pool
// (through the pool's hooks), and deregistered when they leave it. It is
// safe for concurrent use.
type PoolRegistration struct {
	pd     ProtectionDomain
	access Access
	remove func()

	mu      sync.RWMutex
	regions map[*mempool.Arena]MemoryRegion
}

// RegisterPool registers the pool's arenas, present and future, with pd,
// granting access. A registration failure keeps the failing arena out of
// the pool and surfaces as the error of the allocation that added it.
func RegisterPool(pd ProtectionDomain, p *mempool.Pool, access Access) (*PoolRegistration, error) {
	r := &PoolRegistration{pd: pd, access: access, regions: make(map[*mempool.Arena]MemoryRegion)}
	remove, err := p.AddHook(mempool.HookFuncs{Added: r.added, Removed: r.removed})
	if err != nil {
		return nil, fmt.Errorf("verbs: registering pool with %s: %w", pd.Provider(), err)
	}
	r.remove = remove
	return r, nil
}

func (r *PoolRegistration) added(a *mempool.Arena) error {
	m := Memory{Bytes: a.Bytes()}
	if fd, ok := a.FD(); ok {
		m.HasFD, m.FD = true, fd
	}
	mr, err := r.pd.RegisterMemory(m, r.access)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.regions[a] = mr
	r.mu.Unlock()
	return nil
}

func (r *PoolRegistration) removed(a *mempool.Arena) {
	r.mu.Lock()
	mr, ok := r.regions[a]
	delete(r.regions, a)
	r.mu.Unlock()
	if ok {
		mr.Deregister()
	}
}

// Region returns the memory region of an arena.
func (r *PoolRegistration) Region(a *mempool.Arena) (MemoryRegion, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	mr, ok := r.regions[a]
	return mr, ok
}

// Local names the bytes of b for a local work request.
func (r *PoolRegistration) Local(b *mempool.Buffer) (Local, error) {
	mr, ok := r.Region(b.Arena())
	if !ok {
		return Local{}, fmt.Errorf("verbs: buffer's arena %d is not registered with %s", b.Arena().ID(), r.pd.Provider())
	}
	return Local{Region: mr, Offset: b.Offset(), Length: b.Len()}, nil
}

// Remote names the bytes of b for a peer's one-sided work requests, and
// returns the region's key.
func (r *PoolRegistration) Remote(b *mempool.Buffer) (Remote, error) {
	mr, ok := r.Region(b.Arena())
	if !ok {
		return Remote{}, fmt.Errorf("verbs: buffer's arena %d is not registered with %s", b.Arena().ID(), r.pd.Provider())
	}
	return Remote{Addr: mr.Addr() + uint64(b.Offset()), Key: mr.RemoteKey()}, nil
}

// Close stops registering new arenas and deregisters every arena.
func (r *PoolRegistration) Close() error {
	r.remove() // runs removed for every registered arena
	return nil
}
