package engine

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Caller memory: bytes a transfer moves in place that are not pool
// memory (a tensor the caller owns: a Go slice, a framework's array).
// They are registered with the domain for the transfer, through one
// registration cache per domain keyed by address range and rights.
//
// A stale entry (memory freed, then reallocated at the same address with
// other contents) is never used where it would matter: the software
// providers (tcp, shm; verbs.GrantSoftware) reach registered memory
// through its address at each access, so an entry for a range reaches
// whatever the range holds now, and the cache keeps their entries; a
// NIC's registration (ibv) pins the pages it found, so there an implicit
// registration lasts one transfer and only memory registered explicitly
// (Domain.Pin, which the caller undoes before freeing it) stays.

// callerCacheMax bounds the cached registrations of a domain; past it,
// unused ones are dropped oldest first.
const callerCacheMax = 64

type callerKey struct {
	addr   uintptr
	n      int
	access verbs.Access
}

type callerEntry struct {
	mr     verbs.MemoryRegion
	refs   int
	pinned bool   // Pin: kept until Unpin
	age    uint64 // when last taken, for eviction
}

type callerCache struct {
	mu      sync.Mutex
	entries map[callerKey]*callerEntry
	clock   uint64
	closed  bool
	// Registered, Reused count registrations made and cache hits, for
	// Stats and tests.
	registered, reused uint64
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// cacheable reports whether registrations of caller memory may outlive a
// transfer on d's provider (see above).
func (d *Domain) cacheable() bool { return d.PD.Attributes().Grants == verbs.GrantSoftware }

// CallerLocal registers b, caller memory, with access for one transfer
// and names it for a local work request; done ends the transfer's use of
// the registration (which a cache may keep). An error means the provider
// cannot register such memory: the caller then goes through pool memory.
// (shm registers memory without a memfd, but its peer reaches it only by
// cross-memory attach: before granting it, the caller asks the queue
// pair, shm.CrossMemory.)
func (d *Domain) CallerLocal(b []byte, access verbs.Access) (verbs.Local, func(), error) {
	if len(b) == 0 {
		return verbs.Local{}, nil, fmt.Errorf("tensorrpc: registering 0 bytes of caller memory")
	}
	c := &d.caller
	k := callerKey{addrOf(b), len(b), access}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return verbs.Local{}, nil, fmt.Errorf("tensorrpc: domain closed")
	}
	if e, ok := c.entries[k]; ok {
		e.refs++
		c.clock++
		e.age = c.clock
		c.reused++
		c.mu.Unlock()
		return verbs.Local{Region: e.mr, Length: len(b)}, func() { d.dropCaller(k, e) }, nil
	}
	c.mu.Unlock()
	mr, err := d.PD.RegisterMemory(verbs.Memory{Bytes: b}, access)
	if err != nil {
		return verbs.Local{}, nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.registered++
	if c.closed || !d.cacheable() {
		return verbs.Local{Region: mr, Length: len(b)}, func() { mr.Deregister() }, nil
	}
	if c.entries == nil {
		c.entries = map[callerKey]*callerEntry{}
	}
	if old, ok := c.entries[k]; ok { // registered meanwhile by another transfer
		old.refs++
		mr.Deregister()
		return verbs.Local{Region: old.mr, Length: len(b)}, func() { d.dropCaller(k, old) }, nil
	}
	c.clock++
	e := &callerEntry{mr: mr, refs: 1, age: c.clock}
	c.entries[k] = e
	c.evictLocked()
	return verbs.Local{Region: mr, Length: len(b)}, func() { d.dropCaller(k, e) }, nil
}

func (d *Domain) dropCaller(k callerKey, e *callerEntry) {
	c := &d.caller
	c.mu.Lock()
	e.refs--
	gone := c.entries[k] != e && e.refs == 0 // evicted or closed while in use
	c.mu.Unlock()
	if gone {
		e.mr.Deregister()
	}
}

// evictLocked drops the oldest unused, unpinned entries past
// callerCacheMax.
func (c *callerCache) evictLocked() {
	for len(c.entries) > callerCacheMax {
		var oldest callerKey
		var victim *callerEntry
		for k, e := range c.entries {
			if e.refs == 0 && !e.pinned && (victim == nil || e.age < victim.age) {
				oldest, victim = k, e
			}
		}
		if victim == nil {
			return // all in use: the cache grows until they are not
		}
		delete(c.entries, oldest)
		victim.mr.Deregister()
	}
}

// Pin registers b with access until Unpin, on every provider (the
// explicit registration of memory the caller keeps; see above).
func (d *Domain) Pin(b []byte, access verbs.Access) error {
	l, done, err := d.CallerLocal(b, access)
	if err != nil {
		return err
	}
	c := &d.caller
	k := callerKey{addrOf(b), len(b), access}
	c.mu.Lock()
	if e, ok := c.entries[k]; ok {
		e.pinned = true
		c.mu.Unlock()
		done()
		return nil
	}
	if c.entries == nil {
		c.entries = map[callerKey]*callerEntry{}
	}
	c.entries[k] = &callerEntry{mr: l.Region, pinned: true}
	c.mu.Unlock()
	return nil
}

// Unpin ends Pin's registration of b (once no transfer uses it). It
// reports whether b was pinned.
func (d *Domain) Unpin(b []byte, access verbs.Access) bool {
	c := &d.caller
	k := callerKey{addrOf(b), len(b), access}
	c.mu.Lock()
	e, ok := c.entries[k]
	if !ok || !e.pinned {
		c.mu.Unlock()
		return false
	}
	delete(c.entries, k)
	idle := e.refs == 0
	c.mu.Unlock()
	if idle {
		e.mr.Deregister()
	}
	return true
}

// CallerStats are the registrations of caller memory made and the
// transfers that found one in the cache.
func (d *Domain) CallerStats() (registered, reused uint64) {
	c := &d.caller
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.registered, c.reused
}

// closeCaller deregisters what the cache holds; transfers under way
// deregister theirs when they end.
func (c *callerCache) close() {
	c.mu.Lock()
	c.closed = true
	var idle []verbs.MemoryRegion
	for k, e := range c.entries {
		delete(c.entries, k)
		if e.refs == 0 {
			idle = append(idle, e.mr)
		}
	}
	c.mu.Unlock()
	for _, mr := range idle {
		mr.Deregister()
	}
}
