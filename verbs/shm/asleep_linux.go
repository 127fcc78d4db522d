package shm

import (
	"sync"
	"sync/atomic"
	"time"
)

// Receivers asleep in a busy process. A ring receiver that found its ring
// empty for its spin sleeps on the socket, and its peer's next record
// wakes it with a message there, which Go's netpoller hands to it. When
// every P of the process runs goroutines, though, no P looks at the
// netpoller until one runs out of work, and the runtime's monitor looks
// only every 10 ms: the woken receiver, and every call on its lane, waits
// that long. With 16 streams of 1 MiB Fetches on one session of 2 lanes
// (2 CPUs, one process), the lane that fewer calls took slept between
// them, its streams waited up to 10-14 ms for answers and Reads while the
// other lane's went on, and within 50 ms some stream made 0.03-0.12 as
// many Fetches as another (0.79 when receivers did not sleep).
//
// So the receivers that are awake look after those asleep: between its
// own drains, and on every look while it spins, an awake receiver takes
// the next sleeping receiver of the process (round robin) and, when
// records wait in its ring, kicks it: a read deadline in the past ends the
// sleeper's read at once, and Go readies it on the kicker's P without the
// netpoller (readSocket takes the deadline back). The sleeper then drains
// its own ring, in its own goroutine, as after a wake-up. (Polling the
// sleeper's ring in the kicker's goroutine, as a polling caller does, was
// as even in the same measurement, but would let a peer that keeps its
// ring full, sending no wake-ups, hold another session's receiver.) A
// busy process has awake receivers exactly when its netpoller goes
// unwatched; an idle one has a P free to take the wake-up at once.
var asleep struct {
	n    atomic.Int32 // len(qps), read without mu
	mu   sync.Mutex
	qps  []*queuePair
	next int // the next one to look at
}

// sleepBegins lists qp, whose receiver is about to block on its socket.
func sleepBegins(qp *queuePair) {
	asleep.mu.Lock()
	qp.asleepAt = len(asleep.qps)
	asleep.qps = append(asleep.qps, qp)
	asleep.n.Store(int32(len(asleep.qps)))
	asleep.mu.Unlock()
}

// sleepEnds takes qp off the list once its receiver woke.
func sleepEnds(qp *queuePair) {
	asleep.mu.Lock()
	last := len(asleep.qps) - 1
	moved := asleep.qps[last]
	asleep.qps[qp.asleepAt] = moved
	moved.asleepAt = qp.asleepAt
	asleep.qps[last] = nil
	asleep.qps = asleep.qps[:last]
	asleep.n.Store(int32(last))
	asleep.mu.Unlock()
}

// kickAfter is how long records wait in a sleeping receiver's ring before
// an awake receiver kicks it: a wake-up that a watched netpoller hands
// over takes far less, and the kick then only adds a hand-off; the stall
// it ends takes up to 10 ms. (On the 2-core VM a single stream's 4 KiB
// shm Fetch, in one process, made 0.12-0.22 hand-offs a call kicking at
// once and 0.07-0.16 after 100 µs, against 0.03-0.05 with no kicks: both
// Ps spin there (the polling caller, the server's receiver), so the
// netpoller waits for the monitor. Counted in another single-stream run,
// the kicks were rare, 88 in 66,000 Fetches, all to the client's own
// lane, whose receiver sleeps while its caller polls; what the rest of
// those hand-offs are is not traced.)
const kickAfter = 100 * time.Microsecond

// lookAfterSleeper is called by the awake receiver of self between its
// drains: it kicks the next sleeping receiver of the process if records
// have waited in its ring for kickAfter.
func lookAfterSleeper(self *queuePair) {
	if asleep.n.Load() == 0 || !asleep.mu.TryLock() {
		return
	}
	var qp *queuePair
	if k := len(asleep.qps); k > 0 {
		asleep.next = (asleep.next + 1) % k
		qp = asleep.qps[asleep.next]
	}
	asleep.mu.Unlock()
	if qp == nil || qp == self {
		return
	}
	rx := qp.rx
	if !qp.recordsWait() {
		if rx != nil && rx.waitingSince.Load() != 0 {
			rx.waitingSince.Store(0)
		}
		return
	}
	// Kick only records that waited kickAfter: in a process with a P
	// free, the peer's wake-up comes through the netpoller sooner, and a
	// kick would only add a hand-off (and leave the wake-up for the next
	// sleep).
	now := time.Now().UnixNano()
	since := rx.waitingSince.Load()
	if since == 0 {
		rx.waitingSince.CompareAndSwap(0, now)
		return
	}
	if now-since < int64(kickAfter) || !rx.kicked.CompareAndSwap(false, true) {
		return
	}
	rx.waitingSince.Store(0)
	// A read deadline in the past ends the sleeper's read at once: Go
	// readies it on this P, without the netpoller.
	qp.conn.SetReadDeadline(time.Unix(1, 0))
}

// recordsWait reports whether qp's ring holds records, unless someone
// drains it now.
func (qp *queuePair) recordsWait() bool {
	rx := qp.rx
	if rx == nil || !rx.consume.TryLock() {
		return false
	}
	defer rx.consume.Unlock()
	return !rx.released && rx.ring.Used() > 0
}
