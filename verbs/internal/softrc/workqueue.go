package softrc

import (
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// WorkQueue accounts for the outstanding requests of one send or receive
// queue. A request holds a slot from its post until its completion is
// polled; an unsignaled request that succeeds has no completion and holds
// its slot until the next completion of the queue is polled, as on a NIC.
type WorkQueue struct {
	max  int
	used atomic.Int64

	mu       sync.Mutex
	pending  int // unsignaled successes whose slots the next completion frees
	failed   bool
	status   verbs.Status // of the first failure after Fail
	reported bool         // a failure completed since Fail
}

// NewWorkQueue makes the accounting of a queue of max requests.
func NewWorkQueue(max int) *WorkQueue { return &WorkQueue{max: max} }

// Max is the queue's size.
func (w *WorkQueue) Max() int { return w.max }

// Outstanding is the number of slots held.
func (w *WorkQueue) Outstanding() int { return int(w.used.Load()) }

// Take takes n slots, all or none; it fails with an error wrapping
// verbs.ErrQueueFull when fewer are free.
func (w *WorkQueue) Take(n int) error {
	for {
		u := w.used.Load()
		if u+int64(n) > int64(w.max) {
			return QueueFull(n, int(u), w.max)
		}
		if w.used.CompareAndSwap(u, u+int64(n)) {
			return nil
		}
	}
}

// Fail applies the contract's flush order to the completions that follow:
// the first of them that fails carries the error, status in place of
// StatusFlushed, and every later one stays StatusFlushed. The queue pair
// calls it as it enters ERR.
func (w *WorkQueue) Fail(status verbs.Status) {
	w.mu.Lock()
	w.failed, w.status = true, status
	w.mu.Unlock()
}

// Complete turns the outcome of a request into the entry to push, or
// reports false when there is none (an unsignaled success). Completions of
// one queue must be passed in the order they are pushed.
func (w *WorkQueue) Complete(c verbs.Completion, unsignaled bool) (Entry, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failed && c.Status != verbs.StatusSuccess {
		if !w.reported && c.Status == verbs.StatusFlushed {
			c.Status = w.status
		}
		w.reported = true
	}
	if unsignaled && c.Status == verbs.StatusSuccess {
		w.pending++
		return Entry{}, false
	}
	e := Entry{C: c, Queue: w, Slots: 1 + w.pending}
	w.pending = 0
	return e, true
}
