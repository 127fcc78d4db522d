package softrc

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

const knownAccess = verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead

// Region is the provider-independent part of a registered memory region.
// Providers embed it in their verbs.MemoryRegion. Every transfer into or
// out of its bytes holds a reference (Acquire/Release) while the data
// moves; Table.Deregister waits for those references to go, so that memory
// the caller frees after Deregister is never touched again. Posted work
// requests hold no reference: one that reaches a deregistered region
// fails.
type Region struct {
	owner  any
	table  *Table
	mem    []byte
	addr   uint64
	key    uint32
	access verbs.Access

	mu    sync.Mutex
	cond  sync.Cond
	users int
	dead  atomic.Bool
}

func (r *Region) Addr() uint64         { return r.addr }
func (r *Region) Len() int             { return len(r.mem) }
func (r *Region) Bytes() []byte        { return r.mem }
func (r *Region) LocalKey() uint32     { return r.key }
func (r *Region) RemoteKey() uint32    { return r.key }
func (r *Region) Access() verbs.Access { return r.access }

// Owner is the domain the region belongs to.
func (r *Region) Owner() any { return r.owner }

// Dead reports whether the region is deregistered.
func (r *Region) Dead() bool { return r.dead.Load() }

// Core returns r; a provider's region type embedding *Region gets it too,
// which is how the core finds its part of any verbs.MemoryRegion.
func (r *Region) Core() *Region { return r }

type corer interface{ Core() *Region }

// CoreOf returns the core part of mr when it is a region of owner.
func CoreOf(mr verbs.MemoryRegion, owner any) (*Region, bool) {
	c, ok := mr.(corer)
	if !ok {
		return nil, false
	}
	r := c.Core()
	return r, r != nil && r.owner == owner
}

// Acquire takes a reference; it fails once the region is deregistered.
func (r *Region) Acquire() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		return false
	}
	r.users++
	return true
}

// Release drops a reference.
func (r *Region) Release() {
	r.mu.Lock()
	r.users--
	if r.users == 0 && r.dead.Load() {
		r.cond.Broadcast()
	}
	r.mu.Unlock()
}

// Span returns [off, off+n) of the region if it lies inside it.
func (r *Region) Span(off, n uint64) ([]byte, bool) {
	size := uint64(len(r.mem))
	if off > size || n > size-off {
		return nil, false
	}
	return r.mem[off : off+n : off+n], true
}

// Table is a protection domain's table of remote keys: its regions and its
// grants share one space of random, nonzero 32-bit keys.
type Table struct {
	owner any

	mu      sync.RWMutex
	regions map[uint32]*Region
	grants  map[uint32]*Grant
}

// NewTable makes the key table of owner, a protection domain.
func NewTable(owner any) *Table {
	return &Table{owner: owner, regions: make(map[uint32]*Region), grants: make(map[uint32]*Grant)}
}

// newKeyLocked picks a random key in use by no region or grant.
func (t *Table) newKeyLocked() (uint32, uint64) {
	var b [12]byte
	for {
		rand.Read(b[:]) // never fails (it panics rather than return short output)
		k := binary.LittleEndian.Uint32(b[:4])
		if k == 0 || t.regions[k] != nil || t.grants[k] != nil {
			continue
		}
		return k, binary.LittleEndian.Uint64(b[4:])
	}
}

// Register adds a region of mem with the given rights. Its address is
// addr, or when addr is zero a random page-aligned base below 2^62 (which
// leaves room for any length). Unknown access bits and DMA-BUF memory wrap
// verbs.ErrInvalidMemory.
func (t *Table) Register(m verbs.Memory, access verbs.Access, addr uint64) (*Region, error) {
	if access&^knownAccess != 0 {
		return nil, fmt.Errorf("register memory: unknown access bits %v: %w", access, verbs.ErrInvalidMemory)
	}
	if m.DMABuf {
		return nil, fmt.Errorf("register memory: %w: DMA-BUF device memory cannot be read by the CPU; stage it through host memory", verbs.ErrInvalidMemory)
	}
	r := &Region{owner: t.owner, table: t, mem: m.Bytes[:len(m.Bytes):len(m.Bytes)], access: access, addr: addr}
	r.cond.L = &r.mu
	t.mu.Lock()
	defer t.mu.Unlock()
	var base uint64
	r.key, base = t.newKeyLocked()
	if r.addr == 0 {
		r.addr = (base >> 2) &^ 0xfff
	}
	t.regions[r.key] = r
	return r, nil
}

// Deregister removes the region's key and its grants, so later remote
// accesses fail, and waits for transfers in progress on its memory. It
// reports false when the region was deregistered already.
func (t *Table) Deregister(r *Region) bool {
	t.mu.Lock()
	if t.regions[r.key] == r {
		delete(t.regions, r.key)
	}
	var grants []*Grant
	for k, g := range t.grants {
		if g.region == r {
			delete(t.grants, k)
			grants = append(grants, g)
		}
	}
	t.mu.Unlock()
	for _, g := range grants {
		g.revoked.Store(true)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		return false
	}
	r.dead.Store(true)
	for r.users > 0 {
		r.cond.Wait()
	}
	return true
}

// Deregister removes the region's key (and its grants), so later peer
// accesses fail with a remote access error, and waits for transfers in
// progress on its memory to finish (see Table.Deregister). Work requests
// posted on it that have not moved their data yet fail with
// StatusLocalProtection (and, like any local error, move their queue pair
// to ERR). It is idempotent. A provider whose peers map its regions wraps
// it to revoke their mappings too.
func (r *Region) Deregister() error {
	r.table.Deregister(r)
	return nil
}

// Regions returns the live regions.
func (t *Table) Regions() []*Region {
	t.mu.RLock()
	defer t.mu.RUnlock()
	rs := make([]*Region, 0, len(t.regions))
	for _, r := range t.regions {
		rs = append(rs, r)
	}
	return rs
}

// Grant is a narrow remote key (verbs.Grant): one range of one region,
// one right, the peer of one queue pair.
type Grant struct {
	t        *Table
	region   *Region
	qp       any
	key      uint32
	off, n   int
	access   verbs.Access
	onRevoke func(*Grant)
	// onRevokeAsync, if not nil, is onRevoke for RevokeAsync: it calls
	// done once the revocation is complete.
	onRevokeAsync func(g *Grant, done func())
	// onStuck runs when accesses under way outlast RevokeWait in Revoke;
	// it must make them end (tcp fails the queue pair and closes its
	// connection).
	onStuck func()
	revoked atomic.Bool // set under mu: no access may start after it

	mu      sync.Mutex
	users   int           // accesses under way (Table.Remote to Use.Release)
	drained chan struct{} // closed when users drops to 0 after a Revoke began
	first   sync.Once     // the first Revoke does the work
	done    chan struct{} // closed when the first Revoke has finished
}

// RevokeWait bounds how long Revoke waits for accesses under way (a peer
// trickling the payload of a Write) before it calls the grant's onStuck.
var RevokeWait = 5 * time.Second

// acquire counts an access that passed the key check; false once the grant
// is revoked.
func (g *Grant) acquire() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.revoked.Load() {
		return false
	}
	g.users++
	return true
}

func (g *Grant) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.users--; g.users == 0 && g.drained != nil {
		close(g.drained)
		g.drained = nil
	}
}

// NewGrant opens n bytes at off of mr, a region of the table's domain, to
// the peer of qp with one right. onRevoke, if not nil, runs on the first
// Revoke after the key is gone from the table and the accesses under way
// have ended (shm tells the peer to unmap it); onStuck, if not nil, runs
// when those accesses outlast RevokeWait. A bad region, range or right
// wraps verbs.ErrInvalidMemory.
func (t *Table) NewGrant(qp any, mr verbs.MemoryRegion, off, n int, access verbs.Access, onRevoke func(*Grant), onStuck func()) (*Grant, error) {
	if mr == nil {
		return nil, fmt.Errorf("grant: no region: %w", verbs.ErrInvalidMemory)
	}
	r, ok := CoreOf(mr, t.owner)
	if !ok {
		return nil, fmt.Errorf("grant: the region does not belong to the queue pair's domain: %w", verbs.ErrInvalidMemory)
	}
	if access != verbs.AccessRemoteRead && access != verbs.AccessRemoteWrite {
		return nil, fmt.Errorf("grant: access %v is not exactly one of remote-read and remote-write: %w", access, verbs.ErrInvalidMemory)
	}
	if off < 0 || n < 0 || off > len(r.mem) || n > len(r.mem)-off {
		return nil, fmt.Errorf("grant: [%d, +%d) lies outside region %#x of %d bytes: %w", off, n, r.key, len(r.mem), verbs.ErrInvalidMemory)
	}
	g := &Grant{t: t, region: r, qp: qp, off: off, n: n, access: access, onRevoke: onRevoke, onStuck: onStuck, done: make(chan struct{})}
	t.mu.Lock()
	defer t.mu.Unlock()
	if r.dead.Load() || t.regions[r.key] != r {
		return nil, fmt.Errorf("grant: region %#x is deregistered: %w", r.key, verbs.ErrInvalidMemory)
	}
	g.key, _ = t.newKeyLocked()
	t.grants[g.key] = g
	return g, nil
}

func (g *Grant) Remote() verbs.Remote {
	return verbs.Remote{Addr: g.region.addr + uint64(g.off), Key: g.key}
}
func (g *Grant) Len() int             { return g.n }
func (g *Grant) Access() verbs.Access { return g.access }

// SetRevokeAsync sets what RevokeAsync runs instead of onRevoke (see
// NewGrant): it calls done once the provider's revocation is complete.
// Set it before the grant is used.
func (g *Grant) SetRevokeAsync(f func(g *Grant, done func())) { g.onRevokeAsync = f }

// Key is the grant's remote key.
func (g *Grant) Key() uint32 { return g.key }

// Region is the granted region.
func (g *Grant) Region() *Region { return g.region }

// Revoke removes the grant's key and waits for the accesses that passed
// its check before to end: when it returns, no remote access through the
// grant is under way or can start. Every call waits for the first to
// finish.
func (g *Grant) Revoke() error {
	wait, first := g.begin()
	if !first {
		<-g.done
		return nil
	}
	defer close(g.done)
	g.drain(wait)
	if g.onRevoke != nil {
		g.onRevoke(g)
	}
	return nil
}

// RevokeAsync (verbs.AsyncRevoker) is Revoke without waiting: done runs
// when Revoke would have returned. Without accesses under way and with an
// asynchronous onRevoke (or none), nothing waits in a goroutine: done runs
// here, or from what completes the provider's revocation.
func (g *Grant) RevokeAsync(done func()) {
	wait, first := g.begin()
	switch {
	case !first:
		go func() {
			<-g.done
			done()
		}()
	case wait != nil || (g.onRevoke != nil && g.onRevokeAsync == nil):
		go func() {
			g.drain(wait)
			if g.onRevoke != nil {
				g.onRevoke(g)
			}
			close(g.done)
			done()
		}()
	case g.onRevokeAsync != nil:
		g.onRevokeAsync(g, func() {
			close(g.done)
			done()
		})
	default:
		close(g.done)
		done()
	}
}

// begin removes the grant's key and marks it revoked; first reports
// whether this is the first revocation, and wait, when not nil, closes
// once the accesses under way have ended.
func (g *Grant) begin() (wait chan struct{}, first bool) {
	g.t.mu.Lock()
	if g.t.grants[g.key] == g {
		delete(g.t.grants, g.key)
	}
	g.t.mu.Unlock()
	g.first.Do(func() { first = true })
	if !first {
		return nil, false
	}
	g.mu.Lock()
	g.revoked.Store(true)
	if g.users > 0 {
		g.drained = make(chan struct{})
		wait = g.drained
	}
	g.mu.Unlock()
	return wait, true
}

// drain waits for wait (begin's), calling onStuck if it takes longer than
// RevokeWait.
func (g *Grant) drain(wait chan struct{}) {
	if wait == nil {
		return
	}
	timer := time.NewTimer(RevokeWait)
	defer timer.Stop()
	select {
	case <-wait:
	case <-timer.C:
		if g.onStuck != nil {
			g.onStuck()
		}
		<-wait
	}
}

// RevokeAll revokes every grant made on qp, when it closes.
func (t *Table) RevokeAll(qp any) {
	t.mu.Lock()
	var gs []*Grant
	for k, g := range t.grants {
		if g.qp == qp {
			delete(t.grants, k)
			gs = append(gs, g)
		}
	}
	t.mu.Unlock()
	for _, g := range gs {
		g.revoked.Store(true)
	}
}

// Window is what a remote key opens to the peer of one queue pair: a range
// of a region and the rights on it.
type Window struct {
	Region *Region
	Addr   uint64 // the peer's name for the first byte
	Off    uint64 // its offset in the region
	Len    uint64
	Access verbs.Access // remote rights only
	Grant  bool
	g      *Grant
}

// Window looks up the remote key a request that arrived on qp names: a
// region with remote rights, or a grant made on qp.
func (t *Table) Window(key uint32, qp any) (Window, error) {
	t.mu.RLock()
	r, g := t.regions[key], t.grants[key]
	t.mu.RUnlock()
	switch {
	case r != nil:
		acc := r.access & (verbs.AccessRemoteRead | verbs.AccessRemoteWrite)
		if acc == 0 {
			return Window{}, fmt.Errorf("region %#x grants no remote access", key)
		}
		return Window{Region: r, Addr: r.addr, Len: uint64(len(r.mem)), Access: acc}, nil
	case g != nil:
		if g.qp != qp {
			return Window{}, fmt.Errorf("grant %#x was made on another queue pair", key)
		}
		return Window{Region: g.region, Addr: g.region.addr + uint64(g.off), Off: uint64(g.off), Len: uint64(g.n), Access: g.access, Grant: true, g: g}, nil
	}
	return Window{}, fmt.Errorf("no region or grant has remote key %#x", key)
}

// Check returns the bytes [addr, addr+n) of the window if it holds them
// and grants right.
func (w *Window) Check(key uint32, addr, n uint64, right verbs.Access) ([]byte, error) {
	off, err := InWindow(key, w.Addr, w.Len, w.Access, right, addr, n)
	if err != nil {
		return nil, err
	}
	b, _ := w.Region.Span(w.Off+off, n)
	return b, nil
}

// InWindow is the check of every remote access, wherever it is made (tcp's
// target, shm's initiator against what the peer announced): the n bytes
// at the peer's address addr must lie inside the window [winAddr,
// +winLen) of remote key key, whose rights access must include need. It
// returns their offset in the window.
func InWindow(key uint32, winAddr, winLen uint64, access, need verbs.Access, addr, n uint64) (uint64, error) {
	if access&need != need {
		return 0, fmt.Errorf("remote key %#x grants %v, the request needs %v", key, access, need)
	}
	off := addr - winAddr
	if addr < winAddr || off > winLen || n > winLen-off {
		return 0, fmt.Errorf("remote [%#x, +%d) lies outside region %#x [%#x, +%d)", addr, n, key, winAddr, winLen)
	}
	return off, nil
}

// Use is a remote access under way: it holds the region, and the grant
// its key named, until Release, so that neither Deregister nor Revoke
// returns while the access still touches the memory.
type Use struct {
	Region *Region
	grant  *Grant
}

// Release ends the access. The zero Use does nothing.
func (u Use) Release() {
	if u.grant != nil {
		u.grant.release()
	}
	if u.Region != nil {
		u.Region.Release()
	}
}

// Remote resolves a remote access that arrived on qp: key, bounds and
// right are checked before anything touches memory, and the region (and
// grant) are held until the Use is released, when the data has moved.
func (t *Table) Remote(key uint32, qp any, addr, n uint64, right verbs.Access) (Use, []byte, error) {
	w, err := t.Window(key, qp)
	if err != nil {
		return Use{}, nil, err
	}
	b, err := w.Check(key, addr, n, right)
	if err != nil {
		return Use{}, nil, err
	}
	if w.g != nil && !w.g.acquire() {
		return Use{}, nil, fmt.Errorf("grant %#x was revoked", key)
	}
	if !w.Region.Acquire() {
		if w.g != nil {
			w.g.release()
		}
		return Use{}, nil, fmt.Errorf("region of remote key %#x is deregistered", key)
	}
	return Use{Region: w.Region, grant: w.g}, b, nil
}
