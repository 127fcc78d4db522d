package gpudirect

import (
	"sync"

	"github.com/tensorrpc/tensorrpc/mempool"
)

// Pinned staging: the arenas of a staging pool are registered with a
// device's HostRegistrar (cuMemHostRegister), once per arena and
// registrar, through the pool's registration hooks, so that copies to and
// from them are DMA and asynchronous. CUDA treats unregistered memory as
// pageable: it copies it synchronously, through a bounce buffer.

// pinKey names one registration of a pool's arenas with one registrar.
type pinKey struct {
	pool *mempool.Pool
	reg  HostRegistrar
}

// pinning is the hook that registers a pool's arenas with a registrar,
// shared by every Pinner of that pool and registrar (two Clients with one
// pool must not register an arena twice: the driver refuses that).
type pinning struct {
	key    pinKey
	users  int // Pinners holding it, under pinsMu
	remove func()

	mu      sync.Mutex
	arenas  map[*mempool.Arena]struct{} // registered now
	bytes   int64
	failed  int64
	lastErr error
}

var (
	pinsMu sync.Mutex
	pins   = map[pinKey]*pinning{}
)

func (p *pinning) ArenaAdded(a *mempool.Arena) error {
	err := p.key.reg.RegisterHost(a.Bytes())
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		// Not fatal: staging from the arena still works, at pageable
		// speed; Stats says so.
		p.failed++
		p.lastErr = err
		return nil
	}
	p.arenas[a] = struct{}{}
	p.bytes += int64(a.Len())
	return nil
}

func (p *pinning) ArenaRemoved(a *mempool.Arena) {
	p.mu.Lock()
	_, ok := p.arenas[a]
	delete(p.arenas, a)
	if ok {
		p.bytes -= int64(a.Len())
	}
	p.mu.Unlock()
	if ok {
		p.key.reg.UnregisterHost(a.Bytes())
	}
}

// Pinner registers the arenas of one pool with the HostRegistrars of the
// devices it stages for, lazily: Pin registers every arena the pool has
// and, through a hook, every arena it adds, until Close (or the arena
// leaves the pool). Pinners of the same pool and registrar share the
// registrations, which the last Close undoes. It is safe for concurrent
// use.
type Pinner struct {
	pool   *mempool.Pool
	mu     sync.Mutex
	held   map[HostRegistrar]*pinning
	closed bool
}

// PinStats describes a Pinner's registrations.
type PinStats struct {
	// Arenas and Bytes are the arenas registered now with any of the
	// Pinner's registrars, and their size.
	Arenas int
	Bytes  int64
	// Failed counts arenas a registrar refused (they stage at pageable
	// speed); LastError is the latest refusal.
	Failed    int64
	LastError error
}

// NewPinner returns a Pinner of pool's arenas.
func NewPinner(pool *mempool.Pool) *Pinner {
	return &Pinner{pool: pool, held: map[HostRegistrar]*pinning{}}
}

// Pin makes sure that pool's arenas are registered with r, now and as
// they are added. The first Pin of a registrar registers every arena;
// later ones cost a map lookup. A registrar's refusal of an arena is not
// an error (PinStats counts it); Pin fails only when the pool is closed
// or the Pinner is. A nil r (a device with nothing to pin host memory
// with) pins nothing.
func (p *Pinner) Pin(r HostRegistrar) error {
	if r == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	if _, ok := p.held[r]; ok {
		return nil
	}
	key := pinKey{p.pool, r}
	pinsMu.Lock()
	defer pinsMu.Unlock()
	pin := pins[key]
	if pin == nil {
		pin = &pinning{key: key, arenas: map[*mempool.Arena]struct{}{}}
		remove, err := p.pool.AddHook(pin)
		if err != nil {
			return err
		}
		pin.remove = remove
		pins[key] = pin
	}
	pin.users++
	p.held[r] = pin
	return nil
}

// Stats returns what the Pinner's registrars have registered.
func (p *Pinner) Stats() PinStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	var s PinStats
	for _, pin := range p.held {
		pin.mu.Lock()
		s.Arenas += len(pin.arenas)
		s.Bytes += pin.bytes
		s.Failed += pin.failed
		if pin.lastErr != nil {
			s.LastError = pin.lastErr
		}
		pin.mu.Unlock()
	}
	return s
}

// Close gives up the Pinner's registrations: those no other Pinner holds
// are undone (every arena unregistered). Pin fails after Close.
func (p *Pinner) Close() {
	p.mu.Lock()
	held := p.held
	p.held, p.closed = nil, true
	p.mu.Unlock()
	for _, pin := range held {
		pinsMu.Lock()
		pin.users--
		last := pin.users == 0
		if last {
			// Under pinsMu, so that a new Pin of the same key
			// registers only after these are undone.
			delete(pins, pin.key)
			pin.remove()
		}
		pinsMu.Unlock()
	}
}

// Pinned reports whether arena a is registered with r through this
// Pinner.
func (p *Pinner) Pinned(r HostRegistrar, a *mempool.Arena) bool {
	p.mu.Lock()
	pin := p.held[r]
	p.mu.Unlock()
	if pin == nil {
		return false
	}
	pin.mu.Lock()
	defer pin.mu.Unlock()
	_, ok := pin.arenas[a]
	return ok
}
