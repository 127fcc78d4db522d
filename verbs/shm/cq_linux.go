package shm

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// completionQueue is a verbs.CompletionQueue. It never drops a completion:
// when more than its capacity are outstanding it grows, because every work
// request must be reported exactly once.
type completionQueue struct {
	pd *domain

	mu     sync.Mutex
	items  []cqEntry
	head   int
	closed bool

	notify chan struct{} // a token when completions may be waiting
	done   chan struct{} // closed by Close
}

// cqEntry is a completion and the counter of outstanding requests of the
// queue it belongs to: as in InfiniBand, a request holds its place in its
// work queue until its completion is polled.
type cqEntry struct {
	c           verbs.Completion
	outstanding *atomic.Int64
}

func newCompletionQueue(pd *domain, capacity int) *completionQueue {
	return &completionQueue{
		pd:     pd,
		items:  make([]cqEntry, 0, capacity),
		notify: make(chan struct{}, 1),
		done:   make(chan struct{}),
	}
}

func (cq *completionQueue) push(c verbs.Completion, outstanding *atomic.Int64) {
	cq.mu.Lock()
	if cq.closed {
		cq.mu.Unlock()
		return
	}
	cq.items = append(cq.items, cqEntry{c, outstanding})
	cq.mu.Unlock()
	cq.wake()
}

func (cq *completionQueue) wake() {
	select {
	case cq.notify <- struct{}{}:
	default:
	}
}

func (cq *completionQueue) Poll(out []verbs.Completion) int {
	cq.mu.Lock()
	n := min(len(out), len(cq.items)-cq.head)
	for i := range n {
		e := cq.items[cq.head+i]
		out[i] = e.c
		e.outstanding.Add(-1)
	}
	cq.head += n
	left := len(cq.items) - cq.head
	if left == 0 {
		clear(cq.items[:cq.head]) // drop references to errors
		cq.items = cq.items[:0]
		cq.head = 0
	} else if cq.head > len(cq.items)/2 {
		m := copy(cq.items, cq.items[cq.head:])
		clear(cq.items[m:])
		cq.items = cq.items[:m]
		cq.head = 0
	}
	cq.mu.Unlock()
	if left > 0 && n > 0 {
		// Another waiter may be asleep on the token we consumed.
		cq.wake()
	}
	return n
}

func (cq *completionQueue) Wait(ctx context.Context, out []verbs.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	for {
		if n := cq.Poll(out); n > 0 {
			return n, nil
		}
		select {
		case <-cq.notify:
		case <-cq.done:
			if n := cq.Poll(out); n > 0 {
				return n, nil
			}
			return 0, verbs.ErrClosed
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// Close releases the queue. Completions not yet polled stay pollable; new
// ones are dropped.
func (cq *completionQueue) Close() error {
	cq.mu.Lock()
	if cq.closed {
		cq.mu.Unlock()
		return nil
	}
	cq.closed = true
	close(cq.done)
	cq.mu.Unlock()
	cq.pd.forgetCQ(cq)
	return nil
}
