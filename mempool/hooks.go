package mempool

import (
	"fmt"
	"slices"
	"sync"
)

// Hook is told when a pool adds or removes an arena, so that a transport
// registers each arena once (with an RDMA NIC, a peer, ...) instead of each
// buffer. Calls to all of a pool's hooks are serialized. A hook must not
// call the pool's Alloc, TryAlloc, AddHook, Trim or Close (which may need
// to run hooks themselves); Stats, Locate and Arenas are fine.
type Hook interface {
	// ArenaAdded is called before any buffer is carved from a. A non-nil
	// error keeps the arena out of the pool: it is unmapped, the hooks that
	// accepted it get ArenaRemoved, and the Alloc that needed it returns an
	// error wrapping this one.
	ArenaAdded(a *Arena) error
	// ArenaRemoved is called, for hooks whose ArenaAdded accepted a, once
	// no buffer lives in a and before a is unmapped.
	ArenaRemoved(a *Arena)
}

// HookFuncs makes a Hook of two functions; either may be nil.
type HookFuncs struct {
	Added   func(*Arena) error
	Removed func(*Arena)
}

// ArenaAdded calls f.Added when it is not nil.
func (f HookFuncs) ArenaAdded(a *Arena) error {
	if f.Added == nil {
		return nil
	}
	return f.Added(a)
}

// ArenaRemoved calls f.Removed when it is not nil.
func (f HookFuncs) ArenaRemoved(a *Arena) {
	if f.Removed != nil {
		f.Removed(a)
	}
}

// hookEntry gives a hook an identity (Hook values need not be comparable).
type hookEntry struct{ h Hook }

// AddHook adds a hook and calls its ArenaAdded for every arena the pool
// already has. If one fails, AddHook calls ArenaRemoved for those that
// succeeded and returns the error; the hook is not added. The returned
// remove function (safe to call more than once) takes the hook out, calling
// its ArenaRemoved for every arena it still knows, so that the hook sees
// each arena added once and removed once.
func (p *Pool) AddHook(h Hook) (remove func(), err error) {
	if h == nil {
		return nil, fmt.Errorf("mempool: nil hook")
	}
	e := &hookEntry{h}
	p.hookMu.Lock()
	defer p.hookMu.Unlock()
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	for i, a := range p.registered {
		if err := h.ArenaAdded(a); err != nil {
			for _, done := range slices.Backward(p.registered[:i]) {
				h.ArenaRemoved(done)
				done.hooks = slices.DeleteFunc(done.hooks, func(x *hookEntry) bool { return x == e })
			}
			return nil, fmt.Errorf("mempool: hook refused %v: %w", a, err)
		}
		a.hooks = append(a.hooks, e)
	}
	p.hooks = append(slices.Clip(p.hooks), e)
	var once sync.Once
	return func() { once.Do(func() { p.removeHook(e) }) }, nil
}

func (p *Pool) removeHook(e *hookEntry) {
	p.hookMu.Lock()
	defer p.hookMu.Unlock()
	p.hooks = slices.DeleteFunc(slices.Clone(p.hooks), func(x *hookEntry) bool { return x == e })
	for _, a := range p.registered {
		if i := slices.Index(a.hooks, e); i >= 0 {
			e.h.ArenaRemoved(a)
			a.hooks = slices.Delete(a.hooks, i, i+1)
		}
	}
}
