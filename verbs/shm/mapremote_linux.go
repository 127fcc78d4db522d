package shm

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

var _ verbs.RemoteMapper = (*queuePair)(nil)

// MapRemote maps length bytes of the peer's region at remote, with no
// copy. It checks the key, the bounds and the remote-read right as a Read
// would, and uses the same cache of announced regions, asking the peer for
// the region on first use. A refusal is an error; it does not move the
// queue pair to the error state. A zero length returns an empty mapping
// and, like a zero-length Read, checks no key.
//
// The mapping is the peer's memfd mapped PROT_READ (for a grant, its whole
// region), shared by every Mapping of the same region and, while the
// region is cached, by the cache, so that later Mappings cost no mmap; it
// is unmapped when the last of them lets go. It does not depend on the
// queue pair: closing it, the peer deregistering
// the region or the peer's death leave it readable (the memfd is sealed
// against shrinking, so its pages stay), showing the last bytes the peer
// wrote.
//
// Memory the peer registered without a memfd cannot be mapped: MapRemote
// refuses it with an error wrapping verbs.ErrUnsupported (Read it).
func (qp *queuePair) MapRemote(remote verbs.Remote, length int) (verbs.Mapping, error) {
	qp.Mu.Lock()
	_, cause := qp.FailureLocked()
	err := softrc.PostError(qp.ClosedLocked(), qp.StateLocked(), cause, true)
	qp.Mu.Unlock()
	switch {
	case err != nil:
		return nil, qp.Errorf("MapRemote: %w", err)
	case length < 0:
		return nil, qp.Errorf("MapRemote of a negative length %d: %w", length, verbs.ErrInvalidMemory)
	case length == 0:
		return &mapping{}, nil
	}
	var m *mapping
	st, err, _ := qp.withRemote(remote.Key, true, func(rr *remoteRegion) (err error) {
		if rr.cma {
			return fmt.Errorf("remote key %#x is memory of the peer without a memfd, which cannot be mapped, only copied: %w", rr.key, verbs.ErrUnsupported)
		}
		if _, err = rr.span(remote.Addr, length, verbs.AccessRemoteRead); err == nil {
			if m, err = rr.mem.view(rr.off+(remote.Addr-rr.addr), length); err != nil {
				err = fmt.Errorf("peer region %#x: %v", rr.key, err)
			}
		}
		return err
	})
	switch {
	case st == verbs.StatusSuccess:
		return m, nil
	case st == verbs.StatusRemoteAccess:
		return nil, fmt.Errorf("shm: MapRemote refused: %w", err)
	case qp.Closed():
		// The queue pair failed or closed while we asked.
		return nil, qp.Errorf("MapRemote: %w", verbs.ErrClosed)
	case err == nil:
		err = errors.New("shm: the queue pair failed")
	}
	return nil, qp.Errorf("MapRemote: %w: %w", verbs.ErrQPError, err)
}

// roMapping is a read-only mapping of a peer's memory, shared by its
// Mappings and, while the memory is cached, by the cache; the last
// reference unmaps it.
type roMapping struct {
	pm      *peerMemory
	refs    int // guarded by pm.roMu
	mapping []byte
	data    []byte
}

// view returns a Mapping of n bytes at off in the memory. The caller holds
// qp.remoteMu for reading, so pm is cached and pm.fd open.
func (pm *peerMemory) view(off uint64, n int) (*mapping, error) {
	pm.roMu.Lock()
	defer pm.roMu.Unlock()
	ro := pm.ro
	if ro == nil {
		whole, data, err := mapFD(pm.fd, pm.offset, pm.length, false)
		if err != nil {
			return nil, err
		}
		ro = &roMapping{pm: pm, refs: 1, mapping: whole, data: data} // the cache's reference
		pm.ro = ro
	}
	ro.refs++
	return &mapping{ro: ro, b: ro.data[off : off+uint64(n) : off+uint64(n)]}, nil
}

func (ro *roMapping) release() {
	pm := ro.pm
	pm.roMu.Lock()
	ro.refs--
	last := ro.refs == 0
	if last && pm.ro == ro {
		pm.ro = nil
	}
	pm.roMu.Unlock()
	if last {
		unix.Munmap(ro.mapping)
	}
}

// mapping implements verbs.Mapping.
type mapping struct {
	ro       *roMapping // nil for an empty mapping
	b        []byte
	released atomic.Bool
}

func (m *mapping) Bytes() []byte { return m.b }

// Release unmaps the pages when nothing else (another Mapping of the
// region, or the cache while the region is cached) shares them. It is
// idempotent.
func (m *mapping) Release() error {
	if m.released.Swap(true) || m.ro == nil {
		return nil
	}
	m.ro.release()
	return nil
}

// Grant opens length bytes at offset of region to this queue pair's peer
// with one right: the peer asks for the grant's key like a region's, and
// only this queue pair's peer is told of it (with the region's memfd the
// first time the region is exposed to it; see the package doc). When the
// region is already exposed to the peer, the grant is announced to it at
// once, so that its first use needs no question. Revoke
// has the peer drop the key and waits for its confirmation, as Deregister
// does; the peer keeps the region mapped until it is deregistered.
func (qp *queuePair) Grant(region verbs.MemoryRegion, offset, length int, access verbs.Access) (verbs.Grant, error) {
	g, err := qp.QP.Grant(region, offset, length, access, qp.revokeGrant, nil)
	if err == nil {
		g.(*softrc.Grant).SetRevokeAsync(qp.revokeGrantAsync)
		qp.pushGrant(g.Remote().Key)
	}
	return g, err
}

// unannounce forgets key as announced to the peer and reports whether it
// was.
func (qp *queuePair) unannounce(key uint32) bool {
	qp.pd.Mu.Lock()
	defer qp.pd.Mu.Unlock()
	_, announced := qp.announced[key]
	delete(qp.announced, key)
	return announced
}

func (qp *queuePair) revokeGrant(g *softrc.Grant) {
	if qp.unannounce(g.Key()) {
		qp.revoke(g.Key())
	}
}

// revokeGrantAsync is revokeGrant without waiting for the peer: done runs
// once it confirmed (unmapAtPeerAsync).
func (qp *queuePair) revokeGrantAsync(g *softrc.Grant, done func()) {
	if !qp.unannounce(g.Key()) {
		done()
		return
	}
	qp.unmapAtPeerAsync(message{typ: msgUnmap, key: g.Key()}, done)
}
