package shm

import (
	"sync"
	"sync/atomic"
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
// own drains, an awake receiver polls the ring of one sleeping receiver of
// the process (round robin) when records wait there, as a caller polls
// for its answer (Poll: the sleeping word is claimed meanwhile, so the
// peer sends no wake-ups for what it handles, and set back after). A busy
// process has awake receivers exactly when its netpoller is not looked at;
// an idle one has a P free to take the wake-up at once. Records that come
// with an fd, which only the receiver reads, stay for it.
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

// lookAfterSleeper is called by the awake receiver of self between its
// drains: it polls the ring of the next sleeping receiver of the process,
// if records wait there. It reports whether it handled any.
func lookAfterSleeper(self *queuePair) bool {
	if asleep.n.Load() == 0 || !asleep.mu.TryLock() {
		return false
	}
	var qp *queuePair
	if k := len(asleep.qps); k > 0 {
		asleep.next = (asleep.next + 1) % k
		qp = asleep.qps[asleep.next]
	}
	asleep.mu.Unlock()
	if qp == nil || qp == self || !qp.recordsWait() || !qp.BeginPoll() {
		return false
	}
	handled := qp.Poll()
	qp.EndPoll()
	return handled
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
