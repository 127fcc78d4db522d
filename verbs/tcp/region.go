package tcp

import (
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// memoryRegion implements verbs.MemoryRegion with the core's region: every
// transfer into or out of its bytes holds a reference while the data
// moves, and Deregister waits for those references to go, so that memory
// the caller frees after Deregister is never touched again. Posted work
// requests hold no reference: one that reaches a deregistered region
// fails.
type memoryRegion struct {
	*softrc.Region
	pd *domain
}

// Deregister removes the region's key (and its grants), so later peer
// accesses fail with a remote access error, and waits for transfers in
// progress on its memory to finish. Work requests posted on it that have
// not moved their data yet fail with StatusLocalProtection (and, like any
// local error, move their queue pair to ERR). It is idempotent.
func (r *memoryRegion) Deregister() error {
	r.pd.Table.Deregister(r.Region)
	return nil
}
