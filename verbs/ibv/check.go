package ibv

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// This file is pure Go so that it is tested on every build: the checks the
// provider makes before anything reaches libibverbs.

// regionView is what the checks need to know of a memory region.
type regionView struct {
	length     int
	access     verbs.Access
	registered bool
	// localWrite: the region was registered with IBV_ACCESS_LOCAL_WRITE
	// (the caller asked for local or remote write).
	localWrite bool
}

// checkGrant checks Grant's arguments against the region. Every refusal
// wraps verbs.ErrInvalidMemory.
func checkGrant(r regionView, offset, length int, access verbs.Access) error {
	switch access {
	case verbs.AccessRemoteRead, verbs.AccessRemoteWrite:
	default:
		return fmt.Errorf("%w: a grant opens exactly one right, %s or %s, not %s",
			verbs.ErrInvalidMemory, verbs.AccessRemoteRead, verbs.AccessRemoteWrite, access)
	}
	if !r.registered {
		return fmt.Errorf("%w: region is deregistered", verbs.ErrInvalidMemory)
	}
	if offset < 0 || length <= 0 || offset > r.length || length > r.length-offset {
		return fmt.Errorf("%w: grant [%d, %d+%d) outside the %d-byte region", verbs.ErrInvalidMemory, offset, offset, length, r.length)
	}
	if access == verbs.AccessRemoteWrite && !r.localWrite {
		// The NIC lets a window or a registration be written remotely only
		// when the memory is registered for local write.
		return fmt.Errorf("%w: granting %s needs a region registered with %s or %s",
			verbs.ErrInvalidMemory, access, verbs.AccessLocalWrite, verbs.AccessRemoteWrite)
	}
	return nil
}

// checkLocal checks one local segment against its region: in bounds, and
// with the local-write right when the device writes it (a Read's or a
// Recv's destination). Refusals wrap verbs.ErrInvalidMemory.
func checkLocal(r regionView, offset, length int, written bool) error {
	if offset < 0 || length < 0 || offset > r.length || length > r.length-offset {
		return fmt.Errorf("%w: local [%d, %d+%d) outside the %d-byte region", verbs.ErrInvalidMemory, offset, offset, length, r.length)
	}
	if written && length > 0 && r.access&verbs.AccessLocalWrite == 0 {
		return fmt.Errorf("%w: local region is not registered with %s", verbs.ErrInvalidMemory, verbs.AccessLocalWrite)
	}
	if !r.registered {
		return fmt.Errorf("%w: local region is deregistered", verbs.ErrInvalidMemory)
	}
	return nil
}

// segments returns the local segments of a request: Segments when it has
// any, else Local.
func segments(local verbs.Local, segs []verbs.Local) []verbs.Local {
	if len(segs) > 0 {
		return segs
	}
	return []verbs.Local{local}
}

// checkLimits checks a request's segment count and total length against
// the queue pair's limits (see softrc.CheckSegments and CheckLength).
// Refusals wrap verbs.ErrTooLarge.
func checkLimits(segs []verbs.Local, maxSegments int, maxMessage int64) (total int64, err error) {
	if err := softrc.CheckSegments(len(segs), maxSegments); err != nil {
		return 0, err
	}
	for _, s := range segs {
		if s.Length > 0 {
			total += int64(s.Length)
		}
	}
	if err := softrc.CheckLength(total, maxMessage); err != nil {
		return 0, err
	}
	return total, nil
}
