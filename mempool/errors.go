package mempool

import "errors"

var (
	// ErrExhausted is returned by TryAlloc when the pool is at its limit and
	// no free block is large enough.
	ErrExhausted = errors.New("mempool: pool exhausted")
	// ErrDoubleRelease is returned by Buffer.Release when the buffer was
	// already released as many times as it was retained. Under the
	// invariants build tag (and -race) it panics instead.
	ErrDoubleRelease = errors.New("mempool: buffer released more times than retained")
	// ErrClosed is returned for operations on a closed pool, arena or ring.
	ErrClosed = errors.New("mempool: closed")
	// ErrTooLarge is returned for an allocation that could never fit under
	// the pool's limit, or a ring record larger than the ring allows.
	ErrTooLarge = errors.New("mempool: too large")
	// ErrNegativeSize is returned for an allocation of fewer than zero bytes.
	ErrNegativeSize = errors.New("mempool: negative size")
	// ErrOutstanding is wrapped by Pool.Close when buffers are still live.
	ErrOutstanding = errors.New("mempool: buffers outstanding")
	// ErrArenaOwned is returned by Arena.Close for an arena that belongs to
	// a pool.
	ErrArenaOwned = errors.New("mempool: arena belongs to a pool; close the pool instead")
	// ErrPinningDisabled is an arena's PinError when pinning was turned off
	// with WithPinning(false).
	ErrPinningDisabled = errors.New("mempool: pinning disabled")
	// ErrNotSealed is returned by OpenMemfd for a memfd that its owner could
	// still shrink.
	ErrNotSealed = errors.New("mempool: memfd is not sealed against shrinking")
	// ErrRingFull is returned by Ring.Reserve when the consumer has not
	// released enough space (no credit).
	ErrRingFull = errors.New("mempool: ring full")
	// ErrRingCorrupt is a ring's Err after its shared header or a record
	// header was found inconsistent (a misbehaving peer).
	ErrRingCorrupt = errors.New("mempool: ring corrupt")
)
