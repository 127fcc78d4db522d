// Package mempool provides the memory tensors live in: arenas that are
// mapped, pinned and registered once, a best-fit allocator with coalescing
// that carves them into reference-counted buffers, and byte rings for
// transports' eager messages.
//
// Registering memory with a NIC or a peer costs micro- to milliseconds,
// far more than moving a small tensor, so tensorrpc never registers per
// message: a Pool maps a few large arenas, every transport registers each
// arena once through a Hook, and Alloc hands out pieces of them in well
// under a microsecond.
//
// # Basics
//
// Create a pool, allocate, and release:
//
//	p, err := mempool.NewPool(mempool.WithBacking(mempool.BackingMemfd), mempool.WithLimit(256<<20))
//	...
//	buf, err := p.Alloc(ctx, 1<<20) // waits while the pool is at its limit
//	copy(buf.Bytes(), tensor)
//	send(buf.Arena().ID(), buf.Offset(), buf.Len())
//	buf.Release()
//	...
//	err = p.Close()
//
// Arenas are anonymous memory, memfds (which a peer process on the same
// host can map from the file descriptor; they are sealed against shrinking
// and growing) or huge pages (MAP_HUGETLB when the host reserved some, else
// transparent huge pages). The first arena is WithArenaSize bytes; each
// later one doubles, up to WithLimit in total. At the limit Alloc waits for
// memory to be released or for its context to end: the pool never grows
// past its limit and never panics for lack of memory; TryAlloc returns
// ErrExhausted instead of waiting.
//
// Allocation is best fit with coalescing, after TensorFlow's BFC allocator:
// sizes round up to 256 bytes (or the WithAlignment value), free blocks sit
// in power-of-two bins ordered by (size, address), a block is split only
// when the remainder is worth keeping, and a freed block merges with free
// neighbours on both sides. Alloc, Release and Locate take O(log n). Stats
// reports bytes in use, the peak, bytes reserved, counts, the largest free
// block and the fragmentation.
//
// A Buffer starts with one reference; Retain adds one, and the last Release
// gives the memory back. A Ring is a single-producer, single-consumer byte
// ring whose header lives in the memory it manages, so that two processes
// sharing a memfd can each hold one end.
//
// # Caveats
//
// A Buffer's memory belongs to the pool. It is valid until the buffer's last
// Release; after that the same bytes may belong to another buffer, and a
// slice kept from Bytes is a use after free that no tool will catch. A
// Release past the last reference returns ErrDoubleRelease without touching
// anything (and panics under the invariants build tag or -race). Every
// Buffer is a distinct value (they are not recycled), which is what makes
// that check exact.
//
// Close with buffers outstanding returns an error wrapping ErrOutstanding
// and keeps the memory mapped; the arenas are unmapped, and the hooks told,
// when the last buffer is released. Unmapping earlier would turn a late
// reader's access into a crash.
//
// Waiting Allocs are woken together whenever memory is released and are not
// served in arrival order: a large request can keep waiting while smaller
// ones succeed. Give it a deadline.
//
// Pinning (mlock) is tried for every arena unless WithPinning(false), and
// its failure is never fatal: Arena.Pinned and Arena.PinError say what
// happened, naming RLIMIT_MEMLOCK's value, and Stats counts the pinned
// arenas. Processes without CAP_IPC_LOCK can lock only RLIMIT_MEMLOCK bytes
// in total (often 8 MiB; raise it with ulimit -l or systemd's
// LimitMEMLOCK=). Pinning faults every page in, so a pinned arena costs its
// full size in physical memory at once; an unpinned one only costs the pages
// touched. MAP_HUGETLB pages are never swapped, so for them mlock adds
// nothing (and /proc shows no "lo" flag).
//
// Arenas are excluded from fork (MADV_DONTFORK), as RDMA registration
// requires: a child process does not see them at all, and touching a
// Buffer's memory in a forked child faults. Exec'd children are unaffected,
// and memfds are close-on-exec; pass one on purpose (over a unix socket or
// as an extra file) to share it.
//
// A memfd's pages can still be written by every process that maps it: a
// Ring's records, or a region a peer shares, can change while you read them.
// Copy or validate what you must trust.
//
// Hooks run with the pool's hook lock held and must not call Alloc,
// TryAlloc, AddHook, Trim or Close. When WithReleaseEmptyArenas is on, the
// Release that empties an arena runs the ArenaRemoved hooks and the munmap
// itself.
package mempool
