package shm

import (
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// remoteRegion is a peer's region (or grant) mapped into our address
// space for copies: PROT_READ, plus PROT_WRITE when it grants remote
// write. It keeps the peer's memfd, from which MapRemote makes read-only
// mappings that outlive it.
type remoteRegion struct {
	key     uint32
	addr    uint64 // the peer's name for data[0]
	length  uint64
	access  verbs.Access
	fd      int    // the peer's memfd, closed by unmap
	offset  uint64 // of data[0] in fd
	mapping []byte // the whole mmap, page-aligned
	data    []byte // the region inside it

	roMu sync.Mutex
	ro   *roMapping // shared by the live Mappings of this region
}

func (rr *remoteRegion) unmap() {
	unix.Munmap(rr.mapping)
	closeFD(rr.fd)
	rr.mapping, rr.data, rr.fd = nil, nil, -1
}

// span returns the n bytes at the peer's address addr if they lie inside
// the region and the region grants need: the initiator's check, before
// any copy, of what the peer announced for the key.
func (rr *remoteRegion) span(addr uint64, n int, need verbs.Access) ([]byte, error) {
	if rr.access&need != need {
		return nil, fmt.Errorf("shm: remote key %#x grants %v, the request needs %v", rr.key, rr.access, need)
	}
	off := addr - rr.addr
	if addr < rr.addr || off > rr.length || uint64(n) > rr.length-off {
		return nil, fmt.Errorf("shm: remote [%#x, +%d) lies outside region %#x [%#x, +%d)", addr, n, rr.key, rr.addr, rr.length)
	}
	return rr.data[off : off+uint64(n) : off+uint64(n)], nil
}

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

// mapAnnounced maps a region the peer announced. The peer is not trusted:
// its memfd must be sealed against shrinking and long enough, or a later
// truncation could SIGBUS us.
func mapAnnounced(m message, fd int) (*remoteRegion, error) {
	const known = verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
	if m.access&^known != 0 {
		return nil, fmt.Errorf("shm: peer region %#x has unknown access bits %v", m.key, m.access)
	}
	if m.length == 0 || m.length > uint64(maxInt) || m.addr+m.length < m.addr {
		return nil, fmt.Errorf("shm: peer region %#x has bad bounds [%#x, +%d)", m.key, m.addr, m.length)
	}
	end := m.offset + m.length
	if end < m.offset || end > maxInt64 {
		return nil, fmt.Errorf("shm: peer region %#x has bad file range [%d, +%d)", m.key, m.offset, m.length)
	}
	if err := checkSealedFD(fd, end); err != nil {
		return nil, fmt.Errorf("shm: refusing peer region %#x: %v", m.key, err)
	}
	mapping, data, err := mapFD(fd, m.offset, m.length, m.access&verbs.AccessRemoteWrite != 0)
	if err != nil {
		return nil, fmt.Errorf("shm: peer region %#x: %v", m.key, err)
	}
	return &remoteRegion{key: m.key, addr: m.addr, length: m.length, access: m.access, fd: fd, offset: m.offset, mapping: mapping, data: data}, nil
}

// withRemote runs f on the peer's region key, mapped, with the mapping
// cache read-locked so the region cannot be unmapped under f. A key not in
// the cache is asked of the peer first when fetch is set; otherwise
// withRemote reports false and does nothing.
func (qp *queuePair) withRemote(key uint32, fetch bool, f func(*remoteRegion) error) (verbs.Status, error, bool) {
	for asked := false; ; asked = true {
		qp.remoteMu.RLock()
		if rr := qp.remote[key]; rr != nil {
			err := f(rr)
			qp.remoteMu.RUnlock()
			if err != nil {
				return verbs.StatusRemoteAccess, err, true
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
	qp.mu.Lock()
	qp.mapWanted = mapRequest{seq: req.seq, key: key}
	qp.mu.Unlock()
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
		case <-qp.failed:
			return qp.inflight()
		}
	}
}

// onMapReply maps an announced region into the cache and wakes the sender.
// Only the answer to the outstanding request is accepted, so a peer cannot
// make us map regions we did not ask for.
func (qp *queuePair) onMapReply(m message, fd int) error {
	qp.mu.Lock()
	wanted := qp.mapWanted
	if wanted.seq == m.seq && wanted.key == m.key {
		qp.mapWanted = mapRequest{}
	}
	qp.mu.Unlock()
	if wanted.seq == 0 || wanted.seq != m.seq || wanted.key != m.key {
		closeFD(fd)
		return fmt.Errorf("unrequested announcement of region %#x (request %d)", m.key, m.seq)
	}
	var err error
	if m.flags&flagFound == 0 {
		closeFD(fd)
		err = fmt.Errorf("shm: remote key %#x is not registered for remote access at the peer", m.key)
	} else if fd < 0 {
		err = fmt.Errorf("shm: peer announced region %#x without its fd", m.key)
	} else {
		var rr *remoteRegion
		rr, err = mapAnnounced(m, fd)
		if err != nil {
			unix.Close(fd)
		} else {
			qp.remoteMu.Lock()
			if old := qp.remote[m.key]; old != nil {
				qp.dropRemoteLocked(old)
			}
			qp.remote[m.key] = rr
			qp.remoteMu.Unlock()
		}
	}
	select {
	case qp.mapCh <- mapResult{seq: m.seq, err: err}:
	default:
	}
	return nil
}

// onMapRequest announces our region, or the grant made on this queue pair,
// that the peer asks for, with its fd. Another queue pair's grant, a
// region without remote rights or an unknown key is not found.
func (qp *queuePair) onMapRequest(m message) {
	qp.announceMu.Lock()
	defer qp.announceMu.Unlock()
	reply := message{typ: msgMapReply, key: m.key, seq: m.seq}
	fd := -1
	if w, r, err := qp.pd.announce(qp, m.key); err == nil {
		reply.flags = flagFound
		reply.addr = w.Addr
		reply.length = w.Len
		reply.access = w.Access
		reply.offset = r.fdOffset + w.Off
		fd = r.fd
	}
	qp.send(&reply, fd)
}

// onUnmap drops our mapping of a peer region (waiting for any copy in
// progress) and confirms.
func (qp *queuePair) onUnmap(m message) {
	qp.remoteMu.Lock()
	if rr := qp.remote[m.key]; rr != nil {
		delete(qp.remote, m.key)
		qp.dropRemoteLocked(rr)
	}
	qp.remoteMu.Unlock()
	qp.send(&message{typ: msgUnmapAck, seq: m.seq}, -1)
}

// dropRemoteLocked releases a mapping that has left the cache; the caller
// holds remoteMu for writing, so no copy is using it. Mappings handed out
// by MapRemote have their own read-only mappings and stay valid.
func (qp *queuePair) dropRemoteLocked(rr *remoteRegion) {
	rr.unmap()
}
