package shm

import (
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// region is a registered memory region: the core's region and the memfd
// its peers map, if it has one. Its key serves as both local and remote
// key.
type region struct {
	*softrc.Region
	pd       *domain
	fd       int // our dup of the memfd, closed by Deregister; -1 for memory without one
	fdOffset uint64
}

// addressOf is the virtual address of b's first byte. It is only a name
// for the region that peers put in their requests; nothing converts it
// back into a pointer.
func addressOf(b []byte) uint64 {
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

// Deregister removes the region and its grants from the domain, waits for
// local copies in progress on it, and then until every connected peer that
// mapped it (or a grant of it, or the whole region for its grants)
// confirms that it unmapped it (or until its
// connection is gone or WithDeregisterTimeout passes). After it returns,
// remote accesses with its keys fail with StatusRemoteAccess. It is
// idempotent.
func (r *region) Deregister() error {
	pd := r.pd
	pd.Mu.Lock()
	if pd.regions[r.LocalKey()] != r {
		pd.Mu.Unlock()
		return nil
	}
	delete(pd.regions, r.LocalKey())
	type revocation struct {
		qp       *queuePair
		key      uint32
		exposure uint64 // nonzero: drop the exposure, not the key
	}
	var revs []revocation
	pd.QPsLocked(func(core *softrc.QP) {
		qp := core.Wire().(*queuePair)
		for key, ar := range qp.announced {
			if ar == r {
				delete(qp.announced, key)
				revs = append(revs, revocation{qp: qp, key: key})
			}
		}
		if id, ok := qp.exposures[r]; ok {
			delete(qp.exposures, r)
			revs = append(revs, revocation{qp: qp, exposure: id})
		}
	})
	pd.Mu.Unlock()
	pd.Table.Deregister(r.Region)
	for _, rv := range revs {
		if rv.exposure != 0 {
			rv.qp.unexpose(r, rv.exposure)
		} else {
			rv.qp.revoke(rv.key)
		}
	}
	closeFD(r.fd)
	return nil
}
