package shm

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

// peerMemory is a range of a peer's memfd mapped into our address space
// for copies: PROT_READ, plus PROT_WRITE once a key on it grants remote
// write. It keeps the memfd, from which MapRemote makes the read-only
// mapping its Mappings share.
type peerMemory struct {
	fd       int    // the peer's memfd, closed by unmap
	offset   uint64 // of data[0] in fd
	length   uint64
	writable bool
	mapping  []byte // the whole mmap, page-aligned
	data     []byte // the range inside it

	// copies counts the copies under way on mapping (withRemote), which
	// hold no lock while they copy: unmap and remapWritable wait for them.
	// They begin with qp.remoteMu held for reading, so none begins while
	// the memory is being dropped or remapped (remoteMu held for writing)
	// or once it left the cache.
	copies sync.WaitGroup

	roMu sync.Mutex
	// ro is the read-only mapping for MapRemote, made on first use. While
	// the memory is cached, the cache holds a reference to it, so that a
	// Mapping costs no mmap once there is one; unmap drops that reference
	// and the last Release unmaps it.
	ro *roMapping
}

// mapPeerMemory maps length bytes of the peer's memfd at offset, after
// checking that the memfd is sealed against shrinking and long enough: a
// later truncation could otherwise SIGBUS us. On success the memory owns
// fd.
func mapPeerMemory(fd int, offset, length uint64, writable bool) (*peerMemory, error) {
	end := offset + length
	if length == 0 || length > uint64(math.MaxInt) || end < offset || end > math.MaxInt64 {
		return nil, fmt.Errorf("bad file range [%d, +%d)", offset, length)
	}
	if err := checkSealedFD(fd, end); err != nil {
		return nil, err
	}
	mapping, data, err := mapFD(fd, offset, length, writable)
	if err != nil {
		return nil, err
	}
	return &peerMemory{fd: fd, offset: offset, length: length, writable: writable, mapping: mapping, data: data}, nil
}

// remapWritable replaces the read-only copy mapping by a read-write one.
// The caller holds qp.remoteMu for writing, so no copy begins; it waits
// for those under way, and then points the keys on pm at the new data.
func (pm *peerMemory) remapWritable() error {
	pm.copies.Wait()
	mapping, data, err := mapFD(pm.fd, pm.offset, pm.length, true)
	if err != nil {
		return err
	}
	unix.Munmap(pm.mapping)
	pm.mapping, pm.data, pm.writable = mapping, data, true
	return nil
}

// unmap drops the copy mapping, the memfd and the cache's reference to
// the read-only mapping; Mappings from MapRemote keep theirs. The caller
// holds qp.remoteMu for writing (or owns the queue pair, in Close), so no
// copy begins; it waits for those under way.
func (pm *peerMemory) unmap() {
	pm.copies.Wait()
	unix.Munmap(pm.mapping)
	closeFD(pm.fd)
	pm.mapping, pm.data, pm.fd = nil, nil, -1
	pm.roMu.Lock()
	ro := pm.ro
	pm.ro = nil
	pm.roMu.Unlock()
	if ro != nil {
		ro.release()
	}
}

// remoteRegion is what a peer announced for one key: a region of its own
// with remote rights, whose memory it owns, or a grant, a window with one
// right on the memory of an exposed region (see peerRegions) that other
// grants share.
//
// Memory of the peer without a memfd (cma) is not mapped: mem and data
// are nil, and copies reach it by cross-memory attach at the peer's
// virtual address vaddr.
type remoteRegion struct {
	key    uint32
	addr   uint64 // the peer's name for data[0]
	length uint64
	access verbs.Access
	mem    *peerMemory
	off    uint64 // of data[0] in mem.data
	data   []byte // mem.data[off : off+length]
	grant  bool   // mem belongs to an exposed region, not to this key
	cma    bool
	vaddr  uint64 // the cma memory's address in the peer process
}

// setData points rr at its bytes in rr.mem's current mapping.
func (rr *remoteRegion) setData() {
	rr.data = rr.mem.data[rr.off : rr.off+rr.length : rr.off+rr.length]
}

// drop releases what the key alone holds: the memory of a region the
// peer announced by its own key. A grant's memory stays with its region.
// The caller holds qp.remoteMu for writing.
func (rr *remoteRegion) drop() {
	if !rr.grant && rr.mem != nil {
		rr.mem.unmap()
	}
}

// span returns the n bytes at the peer's address addr if they lie inside
// the region and the region grants need: the initiator's check, before
// any copy, of what the peer announced for the key.
func (rr *remoteRegion) span(addr uint64, n int, need verbs.Access) ([]byte, error) {
	off, err := softrc.InWindow(rr.key, rr.addr, rr.length, rr.access, need, addr, uint64(n))
	if err != nil {
		return nil, err
	}
	return rr.data[off : off+uint64(n) : off+uint64(n)], nil
}

// statusError is an error of a remote access that fails with status
// instead of StatusRemoteAccess (see withRemote).
type statusError struct {
	status verbs.Status
	err    error
}

func (e *statusError) Error() string { return e.err.Error() }
func (e *statusError) Unwrap() error { return e.err }

// mapRequest identifies the sender's outstanding msgMapRequest.
type mapRequest struct {
	seq uint64
	key uint32
}

// mapResult answers the sender's msgMapRequest.
type mapResult struct {
	seq uint64
	err error // why the key cannot be used; nil when it is now mapped
}

const knownAccess = verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead

// mapAnnounced maps a region the peer announced by its own key. The peer
// is not trusted: see mapPeerMemory.
func mapAnnounced(m message, fd int) (*remoteRegion, error) {
	if m.access&^knownAccess != 0 {
		return nil, fmt.Errorf("shm: peer region %#x has unknown access bits %v", m.key, m.access)
	}
	if m.length == 0 || m.length > uint64(math.MaxInt) || m.addr+m.length < m.addr {
		return nil, fmt.Errorf("shm: peer region %#x has bad bounds [%#x, +%d)", m.key, m.addr, m.length)
	}
	pm, err := mapPeerMemory(fd, m.offset, m.length, m.access&verbs.AccessRemoteWrite != 0)
	if err != nil {
		return nil, fmt.Errorf("shm: refusing peer region %#x: %v", m.key, err)
	}
	rr := &remoteRegion{key: m.key, addr: m.addr, length: m.length, access: m.access, mem: pm}
	rr.setData()
	return rr, nil
}

// withRemote runs f on the peer's region key, mapped: counted among the
// copies of its memory (peerMemory.copies), so that it cannot be unmapped
// under f, without holding the mapping cache's lock while f copies. The
// receiver changes the cache for every grant the peer makes and revokes;
// held for reading across each copy, the lock had it wait for the copies
// under way (and later copies for it), so that concurrent Reads of one
// queue pair took turns with its messages. Memory without a memfd (cma)
// keeps the lock, which keeps the peer's pidfd open. A key not in the
// cache is asked of the peer first when fetch is set; otherwise
// withRemote reports false and does nothing. An error of f fails with
// StatusRemoteAccess, unless it is a statusError.
func (qp *queuePair) withRemote(key uint32, fetch bool, f func(*remoteRegion) error) (verbs.Status, error, bool) {
	for asked := false; ; asked = true {
		qp.remoteMu.RLock()
		if rr := qp.remote[key]; rr != nil {
			var err error
			if pm := rr.mem; pm != nil && !rr.cma {
				pm.copies.Add(1)
				qp.remoteMu.RUnlock()
				err = f(rr)
				pm.copies.Done()
			} else {
				err = f(rr)
				qp.remoteMu.RUnlock()
			}
			if err != nil {
				st := verbs.StatusRemoteAccess
				var se *statusError
				if errors.As(err, &se) {
					st = se.status
				}
				return st, err, true
			}
			return verbs.StatusSuccess, nil, true
		}
		qp.remoteMu.RUnlock()
		if !fetch {
			return 0, nil, false
		}
		if asked {
			// Mapped and revoked again before we got to use it.
			return verbs.StatusRemoteAccess, fmt.Errorf("shm: remote key %#x was deregistered by the peer", key), true
		}
		if st, err := qp.ensureRemote(key); st != verbs.StatusSuccess {
			return st, err, true
		}
	}
}

// ensureRemote makes sure the peer's region key is in the mapping cache,
// asking the peer for it if it is not. The sender and MapRemote both fetch;
// fetchMu lets one request be outstanding at a time.
func (qp *queuePair) ensureRemote(key uint32) (verbs.Status, error) {
	qp.fetchMu.Lock()
	defer qp.fetchMu.Unlock()
	qp.remoteMu.RLock()
	_, ok := qp.remote[key]
	qp.remoteMu.RUnlock()
	if ok {
		return verbs.StatusSuccess, nil
	}
	return qp.fetchRemote(key)
}

// fetchRemote asks the peer for region key and waits for the receiver to
// map it (or learn that it cannot be). The caller holds fetchMu.
func (qp *queuePair) fetchRemote(key uint32) (verbs.Status, error) {
	qp.mapSeq++
	req := message{typ: msgMapRequest, key: key, seq: qp.mapSeq}
	qp.Mu.Lock()
	qp.mapWanted = mapRequest{seq: req.seq, key: key}
	qp.Mu.Unlock()
	if err := qp.send(&req, -1); err != nil {
		return qp.lost(err)
	}
	for {
		select {
		case r := <-qp.mapCh:
			if r.seq != req.seq {
				continue // the answer to a request abandoned earlier
			}
			if r.err != nil {
				return verbs.StatusRemoteAccess, r.err
			}
			return verbs.StatusSuccess, nil
		case <-qp.Errored:
			return qp.Failure()
		}
	}
}

// onMapReply maps an announced region into the cache and wakes the sender.
// Only the answer to the outstanding request is accepted, so a peer cannot
// make us map regions we did not ask for.
func (qp *queuePair) onMapReply(m message, fd int) error {
	qp.Mu.Lock()
	wanted := qp.mapWanted
	if wanted.seq == m.seq && wanted.key == m.key {
		qp.mapWanted = mapRequest{}
	}
	qp.Mu.Unlock()
	if wanted.seq == 0 || wanted.seq != m.seq || wanted.key != m.key {
		closeFD(fd)
		return fmt.Errorf("unrequested announcement of region %#x (request %d)", m.key, m.seq)
	}
	var err error
	switch {
	case m.flags&flagFound == 0:
		closeFD(fd)
		err = fmt.Errorf("shm: remote key %#x is not registered for remote access at the peer", m.key)
	case m.flags&flagCMA != 0:
		if fd >= 0 {
			closeFD(fd)
			return fmt.Errorf("peer announced memory %#x without a memfd, with an fd", m.key)
		}
		err = qp.cacheCMA(m)
	case m.flags&flagRegion != 0:
		var broken error
		if err, broken = qp.mapGrant(m, fd); broken != nil {
			return broken
		}
	case fd < 0:
		err = fmt.Errorf("shm: peer announced region %#x without its fd", m.key)
	default:
		var rr *remoteRegion
		rr, err = mapAnnounced(m, fd)
		if err != nil {
			unix.Close(fd)
		} else {
			qp.remoteMu.Lock()
			qp.putRemoteLocked(rr)
			qp.remoteMu.Unlock()
		}
	}
	select {
	case qp.mapCh <- mapResult{seq: m.seq, err: err}:
	default:
	}
	return nil
}

// putRemoteLocked caches rr under its key, dropping what was there. The
// caller holds remoteMu for writing.
func (qp *queuePair) putRemoteLocked(rr *remoteRegion) {
	if old := qp.remote[rr.key]; old != nil {
		old.drop()
	}
	qp.remote[rr.key] = rr
}

// mapGrant caches a grant the peer announced (a msgMapReply marked
// flagRegion): a window with one right on a region of the peer, which we
// map whole the first time it is exposed to us (when its fd comes along)
// and keep mapped for its later grants, until the peer drops the exposure
// (msgUnmap with flagRegion) or the queue pair closes. err refuses the
// key; broken is a protocol violation that fails the queue pair.
func (qp *queuePair) mapGrant(m message, fd int) (err, broken error) {
	regOff, regLen := m.regionRange()
	switch {
	case m.access != verbs.AccessRemoteRead && m.access != verbs.AccessRemoteWrite:
		err = fmt.Errorf("shm: peer grant %#x has access %v, want one remote right", m.key, m.access)
	case regLen == 0 || regLen > uint64(math.MaxInt) || regOff+regLen < regOff || regOff+regLen > math.MaxInt64:
		err = fmt.Errorf("shm: peer grant %#x lies in a region with bad file range [%d, +%d)", m.key, regOff, regLen)
	case m.length == 0 || m.offset > regLen || m.length > regLen-m.offset || m.addr+m.length < m.addr:
		err = fmt.Errorf("shm: peer grant %#x has bad bounds [%#x, +%d) at %d of a %d-byte region", m.key, m.addr, m.length, m.offset, regLen)
	}
	if err != nil {
		closeFD(fd)
		return err, nil
	}
	writable := m.access == verbs.AccessRemoteWrite
	qp.remoteMu.RLock()
	pm := qp.peerRegions[m.total] // only this goroutine changes peerRegions while we run
	qp.remoteMu.RUnlock()
	fresh, remap := false, false
	switch {
	case fd >= 0 && pm != nil:
		closeFD(fd)
		return nil, fmt.Errorf("peer exposed region %d again", m.total)
	case fd >= 0:
		pm, err = mapPeerMemory(fd, regOff, regLen, writable)
		if err != nil {
			unix.Close(fd)
			return fmt.Errorf("shm: refusing the region of peer grant %#x: %v", m.key, err), nil
		}
		fresh = true
	case pm == nil:
		// We could not map it when it was exposed.
		return fmt.Errorf("shm: the region of peer grant %#x is not mapped here", m.key), nil
	case pm.offset != regOff || pm.length != regLen:
		return nil, fmt.Errorf("peer grant %#x names region %d as [%d, +%d), exposed as [%d, +%d)", m.key, m.total, regOff, regLen, pm.offset, pm.length)
	case writable && !pm.writable:
		remap = true
	}
	rr := &remoteRegion{key: m.key, addr: m.addr, length: m.length, access: m.access, mem: pm, off: m.offset, grant: true}
	qp.remoteMu.Lock()
	defer qp.remoteMu.Unlock()
	if fresh {
		qp.peerRegions[m.total] = pm
		qp.regionMaps++
	}
	if remap {
		if err := pm.remapWritable(); err != nil {
			return fmt.Errorf("shm: peer grant %#x: %v", m.key, err), nil
		}
		qp.regionMaps++
		for _, other := range qp.remote {
			if other.mem == pm {
				other.setData()
			}
		}
	}
	rr.setData()
	qp.putRemoteLocked(rr)
	return nil, nil
}

// maxPushedKeys bounds the key cache for grants the peer announces
// unasked: past it, they are ignored (and asked for when used), so a
// peer that grants without revoking cannot grow the cache without end.
const maxPushedKeys = 1 << 14

// onGrant caches a grant the peer announced as it made it (msgGrant). A
// grant we cannot use is ignored: the request that names it will ask.
func (qp *queuePair) onGrant(m message) error {
	if m.flags != flagFound|flagRegion && m.flags != flagFound|flagCMA {
		return fmt.Errorf("grant announcement %#x has flags %#x", m.key, m.flags)
	}
	qp.remoteMu.RLock()
	full := len(qp.remote) >= maxPushedKeys
	qp.remoteMu.RUnlock()
	if full {
		return nil
	}
	if m.flags&flagCMA != 0 {
		qp.cacheCMA(m) // a refusal waits for the request that names it
		return nil
	}
	_, broken := qp.mapGrant(m, -1)
	return broken
}

// pushGrant announces grant key to the peer as it is made, when its
// region is already exposed to the peer (so no fd goes along): the peer
// need not ask for it before its first use. The announcement is recorded
// like an answer, so that Revoke and Deregister tell the peer.
func (qp *queuePair) pushGrant(key uint32) {
	qp.Mu.Lock()
	ready := qp.StateLocked() == verbs.QPReadyToSend && qp.readerDone != nil
	qp.Mu.Unlock()
	if !ready {
		return
	}
	qp.announceMu.Lock()
	defer qp.announceMu.Unlock()
	if a, err := qp.pd.announce(qp, key, true); err == nil {
		m, _ := a.message(msgGrant, key, 0) // never an fd: the region is exposed
		qp.send(&m, -1)
	}
}

// onMapRequest announces our region, or the grant made on this queue pair,
// that the peer asks for, with its fd. Another queue pair's grant, a
// region without remote rights or an unknown key is not found. A grant's
// answer names its region's exposure and carries the region's fd only
// the first time the region is exposed to the peer.
func (qp *queuePair) onMapRequest(m message) {
	qp.announceMu.Lock()
	defer qp.announceMu.Unlock()
	reply, fd := message{typ: msgMapReply, key: m.key, seq: m.seq}, -1
	if a, err := qp.pd.announce(qp, m.key, false); err == nil {
		reply, fd = a.message(msgMapReply, m.key, m.seq)
	}
	qp.send(&reply, fd)
}

// onUnmap drops our mapping of a peer region, or a grant, (waiting for any
// copy in progress) and confirms. With flagRegion it drops an exposed
// region: its mapping and every grant on it.
func (qp *queuePair) onUnmap(m message) {
	qp.remoteMu.Lock()
	if m.flags&flagRegion != 0 {
		if pm := qp.peerRegions[m.total]; pm != nil {
			delete(qp.peerRegions, m.total)
			for key, rr := range qp.remote {
				if rr.mem == pm {
					delete(qp.remote, key)
				}
			}
			pm.unmap()
		}
	} else if rr := qp.remote[m.key]; rr != nil {
		delete(qp.remote, m.key)
		rr.drop()
	}
	qp.remoteMu.Unlock()
	qp.send(&message{typ: msgUnmapAck, seq: m.seq}, -1)
}
