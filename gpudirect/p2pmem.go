package gpudirect

import (
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// PublishedP2PMem returns the p2pmem providers whose memory is published,
// in address order.
func (t *Topology) PublishedP2PMem() []P2PProvider {
	var out []P2PProvider
	for _, p := range t.P2PMem {
		if p.Published {
			out = append(out, p)
		}
	}
	return out
}

// clientAddress resolves a PCI address or an RDMA device name to a PCI
// address.
func (t *Topology) clientAddress(client string) (string, error) {
	if _, ok := t.PCI[client]; ok {
		return client, nil
	}
	if n, ok := t.RDMADevice(client); ok {
		if n.PCIAddress == "" {
			return "", fmt.Errorf("%s is a software RDMA device with no PCI parent", client)
		}
		return n.PCIAddress, nil
	}
	return "", fmt.Errorf("no PCI device or RDMA device %q under %s", client, t.Root)
}

// FindP2PMem picks the published p2pmem provider closest to every client
// (PCI addresses or RDMA device names), as the kernel's pci_p2pmem_find_many
// does: the provider whose routes to all clients are allowed by the policy
// (PIX and PXB always, PHB with WithHostBridgeP2P, SYS never) and whose
// distances add up to the least. Ties go to the provider with the most
// available memory, then to the lowest PCI address. (The kernel picks at
// random among ties to spread the load; a deterministic choice makes logs
// and tests reproducible, and preferring free memory spreads load too.)
//
// When no provider qualifies, the error wraps ErrNotDirect and says, for
// each provider, why not.
func (t *Topology) FindP2PMem(clients ...string) (P2PProvider, error) {
	if len(clients) == 0 {
		return P2PProvider{}, errors.New("gpudirect: FindP2PMem needs at least one client")
	}
	addrs := make([]string, len(clients))
	for i, c := range clients {
		a, err := t.clientAddress(c)
		if err != nil {
			return P2PProvider{}, fmt.Errorf("gpudirect: %w", err)
		}
		addrs[i] = a
	}
	type candidate struct {
		p     P2PProvider
		total int
	}
	var found []candidate
	var refused []string
	for _, p := range t.P2PMem {
		if !p.Published {
			refused = append(refused, p.PCIAddress+" is not published")
			continue
		}
		total, why := 0, ""
		for i, a := range addrs {
			r, err := t.Route(p.PCIAddress, a)
			if err != nil {
				why = err.Error()
				break
			}
			if !t.allowed(r.Class) {
				why = fmt.Sprintf("%s is too far from %s: %s", p.PCIAddress, clients[i], r.Detail)
				if r.Class == ClassPHB {
					why += " and WithHostBridgeP2P is off"
				}
				break
			}
			total += r.Distance
		}
		if why != "" {
			refused = append(refused, why)
			continue
		}
		found = append(found, candidate{p, total})
	}
	if len(found) == 0 {
		if len(refused) == 0 {
			refused = append(refused, "no PCI device offers p2pmem")
		}
		return P2PProvider{}, fmt.Errorf("%w: no p2pmem provider for %s: %s", ErrNotDirect, strings.Join(clients, ", "), strings.Join(refused, "; "))
	}
	sort.SliceStable(found, func(i, j int) bool {
		a, b := found[i], found[j]
		if a.total != b.total {
			return a.total < b.total
		}
		if a.p.Available != b.p.Available {
			return a.p.Available > b.p.Available
		}
		return a.p.PCIAddress < b.p.PCIAddress
	})
	return found[0].p, nil
}

// P2PArena is a mapping of a provider's peer-to-peer memory: each mmap of
// /sys/bus/pci/devices/<addr>/p2pmem/allocate takes a fresh run of the
// provider's pool, given back at munmap. Its accessors are safe for
// concurrent use.
type P2PArena struct {
	topo     *Topology
	provider string
	mem      []byte
	closed   atomic.Bool
}

// MapP2PMem maps size bytes (rounded up to the page size) of the published
// p2pmem of the provider at PCI address addr. It refuses, with the reason,
// a provider that is not published or has too little available.
func (t *Topology) MapP2PMem(addr string, size int) (*P2PArena, error) {
	p, ok := t.P2PProvider(addr)
	switch {
	case !ok:
		return nil, fmt.Errorf("gpudirect: %s offers no p2pmem (no /sys/bus/pci/devices/%s/p2pmem)", addr, addr)
	case !p.Published:
		return nil, fmt.Errorf("%w: p2pmem of %s is not published: its driver keeps it for its own use", ErrNotDirect, addr)
	case size <= 0:
		return nil, fmt.Errorf("gpudirect: p2pmem size %d is not positive", size)
	case uint64(size) > p.Available:
		return nil, fmt.Errorf("gpudirect: p2pmem of %s has %d bytes available, %d asked", addr, p.Available, size)
	}
	path := filepath.Join(t.Root, "sys/bus/pci/devices", addr, "p2pmem/allocate")
	mem, err := mapP2PFile(path, size)
	if err != nil {
		return nil, fmt.Errorf("gpudirect: mapping p2pmem of %s: %w", addr, err)
	}
	return &P2PArena{topo: t, provider: addr, mem: mem}, nil
}

// Provider is the PCI address of the device whose memory this is.
func (a *P2PArena) Provider() string { return a.provider }

// Bytes is the mapping. The CPU can read and write it, slowly: each access
// is a PCIe transaction to the provider.
func (a *P2PArena) Bytes() []byte { return a.mem }

// Len is the mapping's size.
func (a *P2PArena) Len() int { return len(a.mem) }

// Memory is the mapping as verbs needs it. HasFD is false: mapping the
// allocate file again yields other memory, not these bytes, so there is
// no descriptor a peer could map (the shm provider refuses it; ibv
// registers the mapping by address).
func (a *P2PArena) Memory() verbs.Memory { return verbs.Memory{Bytes: a.mem} }

// Close unmaps the memory, which gives it back to the provider. A second
// Close returns ErrClosed.
func (a *P2PArena) Close() error {
	if !a.closed.CompareAndSwap(false, true) {
		return ErrClosed
	}
	return unmapP2P(a.mem)
}

// RegisterP2PMem registers the arena with pd, for access through the RDMA
// device nic, after checking that nic may reach the provider directly:
// the provider is published and the route is allowed by the topology's
// policy. Otherwise it registers nothing and returns an error wrapping
// ErrNotDirect with the reason.
func RegisterP2PMem(pd verbs.ProtectionDomain, arena *P2PArena, nic string, access verbs.Access) (verbs.MemoryRegion, error) {
	if arena.closed.Load() {
		return nil, ErrClosed
	}
	if nic == "" {
		return nil, errors.New("gpudirect: RegisterP2PMem needs the RDMA device the domain belongs to")
	}
	d := arena.topo.decide(arena.provider, nic, MechanismP2PMem)
	if d.Path != Direct {
		return nil, fmt.Errorf("%w: %s", ErrNotDirect, d.Reason)
	}
	mr, err := pd.RegisterMemory(arena.Memory(), access)
	if err != nil {
		return nil, fmt.Errorf("gpudirect: registering p2pmem of %s with %s: %w", arena.provider, pd.Provider(), err)
	}
	return mr, nil
}

// P2PAllocator carves device buffers out of one p2pmem arena. Register the
// arena once (Arena, RegisterP2PMem); every buffer's Direct memory lies
// inside it. It is safe for concurrent use.
type P2PAllocator struct {
	arena *P2PArena

	mu     sync.Mutex
	carve  *carver
	live   int
	closed bool
}

// NewP2PAllocator maps an arena of size bytes from the provider at addr
// (see MapP2PMem) and allocates from it.
func NewP2PAllocator(topo *Topology, addr string, size int) (*P2PAllocator, error) {
	a, err := topo.MapP2PMem(addr, size)
	if err != nil {
		return nil, err
	}
	return &P2PAllocator{arena: a, carve: newCarver(a.Len())}, nil
}

// Arena is the mapping buffers are carved from.
func (p *P2PAllocator) Arena() *P2PArena { return p.arena }

// Name returns "p2pmem:<address>".
func (p *P2PAllocator) Name() string { return "p2pmem:" + p.arena.provider }

// Alloc carves n bytes (rounded up to 256) from the arena, or fails with
// ErrExhausted.
func (p *P2PAllocator) Alloc(n int) (DeviceBuffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("gpudirect: %s: negative size %d", p.Name(), n)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	off, size, ok := p.carve.alloc(n)
	if !ok {
		return nil, fmt.Errorf("%w: %s: no free run of %d bytes in %d", ErrExhausted, p.Name(), n, p.arena.Len())
	}
	p.live++
	return &p2pBuffer{alloc: p, off: off, size: size, mem: p.arena.mem[off : off+n : off+n]}, nil
}

// Close unmaps the arena; it fails with ErrOutstanding while buffers are
// allocated.
func (p *P2PAllocator) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	if p.live > 0 {
		return fmt.Errorf("%w: %d buffers of %s", ErrOutstanding, p.live, p.Name())
	}
	p.closed = true
	return p.arena.Close()
}

type p2pBuffer struct {
	alloc     *P2PAllocator
	off, size int
	mem       []byte
	freed     atomic.Bool
}

func (b *p2pBuffer) Device() string       { return b.alloc.Name() }
func (b *p2pBuffer) Len() int             { return len(b.mem) }
func (b *p2pBuffer) PCIAddress() string   { return b.alloc.arena.provider }
func (b *p2pBuffer) Mechanism() Mechanism { return MechanismP2PMem }

func (b *p2pBuffer) CopyToHost(dst []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), len(b.mem), offset, len(dst)); err != nil {
		return err
	}
	copy(dst, b.mem[offset:])
	return nil
}

func (b *p2pBuffer) CopyFromHost(src []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), len(b.mem), offset, len(src)); err != nil {
		return err
	}
	copy(b.mem[offset:], src)
	return nil
}

func (b *p2pBuffer) Direct() (verbs.Memory, bool) {
	if b.freed.Load() {
		return verbs.Memory{}, false
	}
	return verbs.Memory{Bytes: b.mem}, true
}

func (b *p2pBuffer) Free() error {
	if !b.freed.CompareAndSwap(false, true) {
		return ErrFreed
	}
	p := b.alloc
	p.mu.Lock()
	p.carve.release(b.off, b.size)
	p.live--
	p.mu.Unlock()
	return nil
}
