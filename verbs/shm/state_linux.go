package shm

import (
	"errors"
	"sync/atomic"
	"unsafe"
)

// Each queue pair's staging memfd starts with a header the peer maps
// read-only. Its first word says whether the queue pair is still up. A
// queue pair clears it when it fails or closes, before it closes its
// socket, so that once the peer's Close has returned our next request sees
// it at once, without waiting for our receiver to read the EOF. (A peer
// that dies without closing is still seen only through the EOF.)
const (
	stagingHeader = 64 // one cache line, keeps the payload aligned
	stateUp       = 1
	stateDown     = 2
)

var errPeerDown = errors.New("shm: the peer's queue pair is closed or in the error state")

// wordAt is the 32-bit word at off in a page-aligned mapping, which keeps
// it aligned for atomic access: the state word at 0 of a staging mapping,
// the sleeping word of a control ring. Callers keep the mapping until
// every goroutine that uses the word has stopped (Close unmaps it last).
func wordAt(mapping []byte, off int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&mapping[off]))
}

// peerDown reports whether the peer's queue pair has gone down. The peer
// owns the word; anything but stateUp counts as down.
func (qp *queuePair) peerDown() bool {
	return qp.peerState.Load() != stateUp
}
