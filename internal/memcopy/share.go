package memcopy

import (
	"os"
	"runtime"
	"sync/atomic"
	"time"
)

// Sharing a copy with goroutines that would otherwise spin.
//
// A shared-memory ring receiver with nothing to read polls its ring for a
// while before it sleeps (verbs/shm), and a Fetch of 1 MiB over shared
// memory is one copy made meanwhile by the caller's goroutine. Share lets
// such a copy be made in 64 KiB chunks that the caller and those
// receivers claim one at a time, a receiver one chunk between looks at its
// ring: no goroutine is woken or started for it (a hand-off that on a
// many-core machine costs more than a chunk), and a receiver with a record
// to handle is back to it within a chunk's time (about 2 µs).
//
// It is off unless TENSORRPC_COPY=share (Sharing). Measured on the 2-core
// VM (RESULTS, "Session 33"): in one process (tensorbench, where the
// server's receiver polls while the client copies), shm Fetches of 1 MiB
// went from 0.39-0.61 of a memcpy to 0.52-0.69, of 4 MiB from 0.28-0.44
// to 0.60-1.18; with the client in a process of its own, whose receiver
// shares the two cores with the caller and the server, no faster at
// 1 MiB (medians 55.9-65.7 µs before, 52.3-68.7 after) and slower at
// 4 MiB (the median of 10 rounds' medians 453 µs before, 553 after). Whether a receiver with a core of its own
// (many cores, few streams) makes it a gain, and what it does to 16
// streams, is for a many-core machine to tell (scripts/copyshare-ab.sh,
// run by scripts/device-check.sh).

// sharingOn is whether copies are shared: TENSORRPC_COPY=share when the
// process started, or SetSharing.
var sharingOn atomic.Bool

func init() { sharingOn.Store(norm(os.Getenv(Env)) == "share") }

// Sharing reports whether copies are shared (TENSORRPC_COPY=share):
// whether a goroutine that would spin should call Help.
func Sharing() bool { return sharingOn.Load() }

// SetSharing turns sharing on or off and returns what it was (for tests
// and benchmarks; TENSORRPC_COPY sets it when the process starts).
func SetSharing(on bool) bool { return sharingOn.Swap(on) }

// ShareMinBytes is the smallest copy Share offers to helpers: below it,
// a chunk or two would be all a helper could take, for the cost of
// publishing the copy and waiting for its last chunk.
const ShareMinBytes = 256 << 10

// shareChunk is how much a helper takes at a time: about 2 µs of copying
// on the 2-core VM (30 GB/s), after which it looks at its own work again.
const shareChunk = 64 << 10

// shareWait is how long Share waits for a helper's chunk before it lets
// other goroutines run on its P: ten chunks' time.
const shareWait = 20 * time.Microsecond

// shared is a copy under way that helpers may take chunks of. Chunks are
// claimed with next, one goroutine each; done counts the bytes of the
// chunks finished, got what the copy function reported for them. A
// shared is never reused: a helper that loads it after the copy ended
// claims nothing (next is past n) and touches no memory.
type shared struct {
	copy func(lo, hi int) int
	n    int64
	next atomic.Int64
	done atomic.Int64
	got  atomic.Int64
}

var (
	// sharing is the copy being shared now, if any (one at a time: a
	// second copy made meanwhile is made by its own goroutine alone).
	sharing atomic.Pointer[shared]
	// helpers counts the goroutines that call Help while they spin.
	helpers atomic.Int32
)

// Helping says that the calling goroutine starts (on) or stops calling
// Help in a loop it would otherwise spin in: Share offers copies only
// while some goroutine does.
func Helping(on bool) {
	if on {
		helpers.Add(1)
	} else {
		helpers.Add(-1)
	}
}

// Share runs copy over [0, n) and returns the sum of what it returned:
// by the calling goroutine alone for a copy under ShareMinBytes, when
// sharing is off (Sharing), when no goroutine is Helping, or when another
// copy is being shared; else in
// chunks, which the caller and goroutines calling Help (a shared-memory
// ring receiver polling an empty ring, on a core of its own) claim one
// at a time. It returns once every chunk is copied. copy must be safe to
// call on disjoint ranges at once.
func Share(n int, copy func(lo, hi int) int) int {
	if n < ShareMinBytes || !sharingOn.Load() || helpers.Load() == 0 {
		return copy(0, n)
	}
	s := &shared{copy: copy, n: int64(n)}
	if !sharing.CompareAndSwap(nil, s) {
		return copy(0, n)
	}
	for s.take() {
	}
	sharing.CompareAndSwap(s, nil)
	// Helpers finish the chunks they claimed: a chunk's time at most,
	// unless one was descheduled. Between looks the thread yields to
	// others (that helper's thread among them); the goroutine yields only
	// past shareWait, when that helper's goroutine may be waiting for a P
	// (preempted), as runtime.Gosched would otherwise wake an idle P for
	// nothing.
	var since time.Time
	for i := 0; s.done.Load() < s.n; i++ {
		if i%16 != 15 {
			continue
		}
		if since.IsZero() {
			since = time.Now()
		} else if time.Since(since) > shareWait {
			runtime.Gosched()
			continue
		}
		osYield()
	}
	return int(s.got.Load())
}

// take claims the next chunk of s and copies it; it reports false when
// none was left.
func (s *shared) take() bool {
	lo := s.next.Add(shareChunk) - shareChunk
	if lo >= s.n {
		return false
	}
	hi := min(lo+shareChunk, s.n)
	s.got.Add(int64(s.copy(int(lo), int(hi))))
	s.done.Add(hi - lo)
	return true
}

// Help copies one chunk of the copy being shared, if there is one, and
// reports whether it did: for a goroutine that would otherwise spin,
// which calls it between its own looks (see Helping).
func Help() bool {
	s := sharing.Load()
	if s == nil || !s.take() {
		return false
	}
	helped.Add(1)
	return true
}

// helped counts the chunks helpers copied.
var helped atomic.Int64

// Helped is how many chunks goroutines calling Help have copied in this
// process.
func Helped() int64 { return helped.Load() }
