package mempool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

// Pool hands out buffers carved from pinned arenas that are mapped, and
// registered with every hook, once. It grows by adding arenas of doubling
// size up to its limit and then applies backpressure: Alloc waits for
// memory to be released. It is safe for concurrent use.
type Pool struct {
	opts options
	gran int // allocation unit: max(Granularity, alignment)
	unit int // arena size unit: the page size, or 2 MiB for hugepages

	// hookMu serializes hook membership and every ArenaAdded/ArenaRemoved
	// call, so each hook sees each arena added once and removed once. It is
	// taken before mu, never while mu is held.
	hookMu     sync.Mutex
	hooks      []*hookEntry // guarded by hookMu
	registered []*Arena     // arenas the hooks know about; guarded by hookMu

	mu        sync.Mutex
	bfc       bfc
	arenas    []*Arena                 // live arenas, by address
	located   atomic.Pointer[[]*Arena] // a copy of arenas for lock-free Locate
	nextArena int                      // size of the next arena to add
	reserved  int64                    // bytes of live arenas
	pending   int64                    // bytes of arenas being mapped
	inUse     int64
	requested int64
	peak      int64
	allocs    int64
	total     int64
	waiters   int
	wake      chan struct{} // closed and cleared when memory may have become available
	closed    bool
	tornDown  bool     // arenas released after Close
	slab      []Buffer // fresh Buffers, see newBufferLocked
}

// NewPool maps the pool's first arena (running its hooks) and returns the
// pool.
func NewPool(opts ...Option) (*Pool, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		return nil, err
	}
	p := &Pool{opts: o, gran: o.alignment, unit: max(mapUnit(o.backing), o.alignment)}
	p.bfc = bfc{gran: p.gran, rng: 0x9e3779b97f4a7c15}
	p.nextArena = roundUp(o.arenaSize, p.unit)
	if int64(p.nextArena) > o.limit {
		return nil, fmt.Errorf("mempool: arena size %d (rounded to %d) is larger than the limit %d", o.arenaSize, p.nextArena, o.limit)
	}
	for _, h := range o.hooks {
		p.hooks = append(p.hooks, &hookEntry{h})
	}
	p.mu.Lock()
	size, _, _ := p.planGrowthLocked(p.nextArena)
	p.mu.Unlock()
	if err := p.grow(size, nil); err != nil {
		return nil, err
	}
	return p, nil
}

// Alloc returns a buffer of exactly n bytes. When the pool is at its limit
// and no free block fits, Alloc waits until enough memory is released, the
// context ends (it returns an error wrapping ctx.Err()) or the pool is
// closed (ErrClosed). It fails at once with ErrTooLarge when n could never
// fit under the limit and with ErrNegativeSize when n < 0. n == 0 returns a
// valid empty buffer that holds no memory. The context is only consulted
// when Alloc has to wait.
func (p *Pool) Alloc(ctx context.Context, n int) (*Buffer, error) {
	return p.alloc(ctx, n, true)
}

// TryAlloc is Alloc without the waiting: it returns ErrExhausted when Alloc
// would block. It may still map a new arena when the limit allows.
func (p *Pool) TryAlloc(n int) (*Buffer, error) {
	return p.alloc(context.Background(), n, false)
}

func (p *Pool) alloc(ctx context.Context, n int, wait bool) (*Buffer, error) {
	if n <= 0 {
		if n < 0 {
			return nil, fmt.Errorf("%w: alloc %d bytes", ErrNegativeSize, n)
		}
		b := new(Buffer)
		b.refs.Store(1)
		return b, nil
	}
	if int64(n) > p.opts.limit || int64(roundUp(roundUp(n, p.gran), p.unit)) > p.opts.limit {
		return nil, fmt.Errorf("%w: alloc %d bytes from a pool limited to %d", ErrTooLarge, n, p.opts.limit)
	}
	size := roundUp(n, p.gran)
	p.mu.Lock()
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, ErrClosed
		}
		if c := p.bfc.take(size); c != nil {
			b := p.newBufferLocked(c, n)
			p.checkLocked()
			p.mu.Unlock()
			return b, nil
		}
		if p.pending >= int64(size) && wait {
			// Another allocation is mapping an arena this one fits in:
			// wait for it instead of mapping one more, so a burst of
			// concurrent allocations shares one new arena rather than
			// growing the pool once each.
			if err := p.waitLocked(ctx); err != nil {
				p.mu.Unlock()
				return nil, fmt.Errorf("mempool: alloc %d bytes: %w", n, err)
			}
			continue
		}
		if arenaSize, retired, ok := p.planGrowthLocked(size); ok {
			p.mu.Unlock()
			if err := p.grow(arenaSize, retired); err != nil {
				return nil, err
			}
			p.mu.Lock()
			continue
		}
		if !wait {
			p.mu.Unlock()
			return nil, ErrExhausted
		}
		if err := p.waitLocked(ctx); err != nil {
			p.mu.Unlock()
			return nil, fmt.Errorf("mempool: alloc %d bytes: %w", n, err)
		}
	}
}

// newBufferLocked wraps a taken chunk in a Buffer. Buffers are carved from
// slabs and never reused, so a stale *Buffer can always be told apart from a
// live one (that is what makes a double Release detectable) while the
// allocation cost is shared by a slab's worth of Allocs.
func (p *Pool) newBufferLocked(c *chunk, n int) *Buffer {
	if len(p.slab) == 0 {
		p.slab = make([]Buffer, 64)
	}
	b := &p.slab[0]
	p.slab = p.slab[1:]
	b.pool, b.arena, b.chunk, b.off, b.n = p, c.arena, c, c.off, n
	b.refs.Store(1)
	p.inUse += int64(c.size)
	p.requested += int64(n)
	p.peak = max(p.peak, p.inUse)
	p.allocs++
	p.total++
	return b
}

// release frees a buffer's chunk; the buffer's last reference is gone.
func (p *Pool) release(b *Buffer) {
	p.mu.Lock()
	c := b.chunk
	b.chunk = nil
	a := c.arena
	p.inUse -= int64(c.size)
	p.requested -= int64(b.n)
	p.allocs--
	p.bfc.release(c)
	var retired []*Arena
	switch {
	case p.closed:
		if p.allocs == 0 && !p.tornDown {
			retired = p.teardownLocked()
		}
	case a.used == 0 && p.opts.releaseEmpty && len(p.arenas) > 1:
		p.detachLocked(a)
		retired = []*Arena{a}
	}
	p.wakeLocked()
	p.checkLocked()
	p.mu.Unlock()
	if retired != nil {
		_ = p.retire(retired)
	}
}

// waitLocked waits, with mu released, until memory may have become
// available or ctx ends.
func (p *Pool) waitLocked(ctx context.Context) error {
	if p.wake == nil {
		p.wake = make(chan struct{})
	}
	wake := p.wake
	p.waiters++
	p.mu.Unlock()
	var err error
	select {
	case <-wake:
	case <-ctx.Done():
		err = ctx.Err()
	}
	p.mu.Lock()
	p.waiters--
	return err
}

// wakeLocked wakes every waiting Alloc to try again.
func (p *Pool) wakeLocked() {
	if p.wake != nil {
		close(p.wake)
		p.wake = nil
	}
}

// maxGrowthArena caps the doubling of arena sizes: past it the pool grows
// by arenas of this size (or of the request, if larger). Unbounded doubling
// made a pool whose empty arenas were trimmed grow back by ever larger
// arenas, up to its limit, for a few MiB of live buffers.
const maxGrowthArena = 256 << 20

// planGrowthLocked decides whether a new arena can make room for size bytes
// and how large it is. When the limit leaves too little room it detaches
// empty arenas (largest first) until there is enough; the caller retires
// them. It reserves the new arena's bytes as pending.
func (p *Pool) planGrowthLocked(size int) (arenaSize int, retired []*Arena, ok bool) {
	need := roundUp(size, p.unit)
	room := p.opts.limit - p.reserved - p.pending
	if int64(need) > room {
		var empty []*Arena
		var emptyBytes int64
		for _, a := range p.arenas {
			if a.used == 0 {
				empty = append(empty, a)
				emptyBytes += int64(len(a.mem))
			}
		}
		if int64(need) > room+emptyBytes {
			return 0, nil, false
		}
		slices.SortFunc(empty, func(a, b *Arena) int { return len(b.mem) - len(a.mem) })
		for _, a := range empty {
			if int64(need) <= room {
				break
			}
			p.detachLocked(a)
			retired = append(retired, a)
			room += int64(len(a.mem))
		}
	}
	arenaSize = max(p.nextArena, need)
	if int64(arenaSize) > room {
		arenaSize = int(room) / p.unit * p.unit // still ≥ need
	}
	if int64(p.nextArena) <= p.opts.limit/2 && p.nextArena < maxGrowthArena {
		p.nextArena *= 2
	}
	p.pending += int64(arenaSize)
	return arenaSize, retired, true
}

// grow retires the arenas that made room, then maps an arena of size bytes,
// runs the hooks and adds it to the pool.
func (p *Pool) grow(size int, retired []*Arena) error {
	_ = p.retire(retired)
	a, err := mapArena(p.opts.backing, size, &p.opts)
	if err != nil {
		p.mu.Lock()
		p.pending -= int64(size)
		p.wakeLocked()
		p.mu.Unlock()
		return err
	}
	a.pool = p
	p.hookMu.Lock()
	for i, e := range p.hooks {
		if err = e.h.ArenaAdded(a); err != nil {
			err = fmt.Errorf("mempool: hook %d refused %v: %w", i, a, err)
			break
		}
		a.hooks = append(a.hooks, e)
	}
	p.mu.Lock()
	p.pending -= int64(size)
	if err == nil && p.closed {
		err = ErrClosed
	}
	if err != nil {
		p.wakeLocked()
		p.mu.Unlock()
		p.removeHooks(a)
		p.hookMu.Unlock()
		return errors.Join(err, a.unmap())
	}
	p.registered = append(p.registered, a)
	i, _ := slices.BinarySearchFunc(p.arenas, a.addr, func(x *Arena, addr uintptr) int {
		return cmpUintptr(x.addr, addr)
	})
	p.arenas = slices.Insert(p.arenas, i, a)
	p.publishLocked()
	p.reserved += int64(len(a.mem))
	p.bfc.addArena(a)
	p.wakeLocked()
	p.checkLocked()
	p.mu.Unlock()
	p.hookMu.Unlock()
	return nil
}

// detachLocked takes an empty arena out of the allocator and out of Locate.
func (p *Pool) detachLocked(a *Arena) {
	p.bfc.removeArena(a)
	p.arenas = slices.DeleteFunc(p.arenas, func(x *Arena) bool { return x == a })
	p.publishLocked()
	p.reserved -= int64(len(a.mem))
}

// teardownLocked detaches every arena of a closed pool that has no live
// buffers left.
func (p *Pool) teardownLocked() []*Arena {
	p.tornDown = true
	retired := slices.Clone(p.arenas)
	for _, a := range retired {
		p.detachLocked(a)
	}
	return retired
}

func (p *Pool) publishLocked() {
	located := slices.Clone(p.arenas)
	p.located.Store(&located)
}

// retire runs the ArenaRemoved hooks of detached arenas and unmaps them.
func (p *Pool) retire(arenas []*Arena) error {
	if len(arenas) == 0 {
		return nil
	}
	p.hookMu.Lock()
	for _, a := range arenas {
		p.removeHooks(a)
		p.registered = slices.DeleteFunc(p.registered, func(x *Arena) bool { return x == a })
	}
	p.hookMu.Unlock()
	var errs []error
	for _, a := range arenas {
		errs = append(errs, a.unmap())
	}
	return errors.Join(errs...)
}

// removeHooks tells, in reverse order, every hook that accepted a that it is
// gone. hookMu is held.
func (p *Pool) removeHooks(a *Arena) {
	for i := len(a.hooks) - 1; i >= 0; i-- {
		a.hooks[i].h.ArenaRemoved(a)
	}
	a.hooks = nil
}

// Locate finds the arena holding addr and addr's offset in it, in
// O(log arenas) and without locking. The answer is only as durable as the
// arena: it holds while the caller keeps a buffer in it alive.
func (p *Pool) Locate(addr uintptr) (a *Arena, offset int, ok bool) {
	located := p.located.Load()
	if located == nil {
		return nil, 0, false
	}
	arenas := *located
	lo, hi := 0, len(arenas)
	for lo < hi { // first arena that ends after addr
		mid := int(uint(lo+hi) >> 1)
		if x := arenas[mid]; x.addr+uintptr(len(x.mem)) <= addr {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo == len(arenas) || addr < arenas[lo].addr {
		return nil, 0, false
	}
	return arenas[lo], int(addr - arenas[lo].addr), true
}

// Arenas returns the pool's arenas in address order.
func (p *Pool) Arenas() []*Arena {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.arenas)
}

// Trim unmaps every arena that has no live buffer, even the last, and
// returns how many bytes it gave back.
func (p *Pool) Trim() int64 {
	p.mu.Lock()
	var retired []*Arena
	var bytes int64
	for _, a := range slices.Clone(p.arenas) {
		if a.used == 0 {
			p.detachLocked(a)
			retired = append(retired, a)
			bytes += int64(len(a.mem))
		}
	}
	p.checkLocked()
	p.mu.Unlock()
	_ = p.retire(retired)
	return bytes
}

// EmptyArenas returns the IDs of the arenas that hold no live buffer.
func (p *Pool) EmptyArenas() []uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ids []uint32
	for _, a := range p.arenas {
		if a.used == 0 {
			ids = append(ids, a.id)
		}
	}
	return ids
}

// TrimArenas unmaps those of the arenas named by ids that still hold no
// live buffer, and returns how many bytes it gave back. With EmptyArenas
// it lets a caller release only arenas that stayed empty for a while.
func (p *Pool) TrimArenas(ids []uint32) int64 {
	p.mu.Lock()
	var retired []*Arena
	var bytes int64
	for _, a := range slices.Clone(p.arenas) {
		if a.used == 0 && slices.Contains(ids, a.id) {
			p.detachLocked(a)
			retired = append(retired, a)
			bytes += int64(len(a.mem))
		}
	}
	if len(retired) > 0 {
		p.nextArena = roundUp(p.opts.arenaSize, p.unit) // grow back gradually
	}
	p.checkLocked()
	p.mu.Unlock()
	_ = p.retire(retired)
	return bytes
}

// Close stops the pool: waiting and later Allocs fail with ErrClosed. When
// no buffer is live it runs the ArenaRemoved hooks and unmaps every arena.
// Otherwise it returns an error wrapping ErrOutstanding that says how many
// buffers are live, and the arenas are released when the last of them is
// (their memory stays valid until then). Close may be called again.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closed = true
	p.wakeLocked()
	if n := p.allocs; n > 0 {
		p.mu.Unlock()
		return fmt.Errorf("%w: %d buffers are still live; the pool releases its arenas when the last is released", ErrOutstanding, n)
	}
	var retired []*Arena
	if !p.tornDown {
		retired = p.teardownLocked()
	}
	p.mu.Unlock()
	return p.retire(retired)
}

func cmpUintptr(a, b uintptr) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
