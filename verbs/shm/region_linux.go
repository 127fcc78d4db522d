package shm

import (
	"sync/atomic"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// region is a registered memfd-backed memory region. Its key serves as both
// local and remote key.
type region struct {
	pd       *domain
	mem      []byte
	addr     uint64
	key      uint32
	access   verbs.Access
	fd       int // our dup of the memfd, closed by Deregister
	fdOffset uint64

	deregistered atomic.Bool
}

// addressOf is the virtual address of b's first byte. It is only a name
// for the region that peers put in their requests; nothing converts it
// back into a pointer.
func addressOf(b []byte) uint64 {
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

func (r *region) Addr() uint64         { return r.addr }
func (r *region) Len() int             { return len(r.mem) }
func (r *region) Bytes() []byte        { return r.mem }
func (r *region) LocalKey() uint32     { return r.key }
func (r *region) RemoteKey() uint32    { return r.key }
func (r *region) Access() verbs.Access { return r.access }

// Deregister removes the region from the domain and waits until every
// connected peer that mapped it confirms that it unmapped it (or until its
// connection is gone or WithDeregisterTimeout passes). After it returns,
// remote accesses with the key fail with StatusRemoteAccess.
func (r *region) Deregister() error {
	pd := r.pd
	pd.mu.Lock()
	if r.deregistered.Load() {
		pd.mu.Unlock()
		return verbs.ErrClosed
	}
	r.deregistered.Store(true)
	delete(pd.regions, r.key)
	var peers []*queuePair
	for _, qp := range pd.qps {
		if _, ok := qp.announced[r.key]; ok {
			delete(qp.announced, r.key)
			peers = append(peers, qp)
		}
	}
	pd.mu.Unlock()
	for _, qp := range peers {
		qp.revoke(r.key)
	}
	unix.Close(r.fd)
	return nil
}
