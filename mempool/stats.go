package mempool

// Stats is a snapshot of a pool's accounting.
type Stats struct {
	// InUse is the bytes held by live buffers, counting the whole chunk each
	// buffer occupies (its size rounded up to the granularity, plus any tail
	// too small to split off).
	InUse int64
	// Requested is the bytes live buffers asked for; InUse − Requested is
	// the internal fragmentation.
	Requested int64
	// Peak is the highest InUse so far.
	Peak int64
	// Reserved is the bytes mapped in the pool's arenas.
	Reserved int64
	// Allocs is the number of live buffers (empty ones excluded) and
	// TotalAllocs the number of allocations since NewPool.
	Allocs, TotalAllocs int64
	// LargestFree is the size of the largest free block, the largest Alloc
	// that can succeed without growing.
	LargestFree int64
	// FreeBlocks is the number of free blocks across all arenas.
	FreeBlocks int
	// Fragmentation is (free − largest free) / free, where free is
	// Reserved − InUse: 0 when the free memory is one block, near 1 when it
	// is scattered in small pieces. It is 0 when nothing is free.
	Fragmentation float64
	// Arenas is the number of arenas; PinnedArenas and PinnedBytes count
	// those locked in memory.
	Arenas, PinnedArenas int
	PinnedBytes          int64
	// Waiting is the number of Allocs waiting for memory.
	Waiting int
}

// Stats returns a snapshot of the pool's accounting.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := Stats{
		InUse:       p.inUse,
		Requested:   p.requested,
		Peak:        p.peak,
		Reserved:    p.reserved,
		Allocs:      p.allocs,
		TotalAllocs: p.total,
		LargestFree: int64(p.bfc.largestFree()),
		FreeBlocks:  p.bfc.freeChunks,
		Arenas:      len(p.arenas),
		Waiting:     p.waiters,
	}
	if free := s.Reserved - s.InUse; free > 0 {
		s.Fragmentation = float64(free-s.LargestFree) / float64(free)
	}
	for _, a := range p.arenas {
		if a.pinned {
			s.PinnedArenas++
			s.PinnedBytes += int64(len(a.mem))
		}
	}
	return s
}
