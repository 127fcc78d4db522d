package tcp

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// completionQueue implements verbs.CompletionQueue as a ring of completions
// guarded by a mutex, with a one-slot channel to wake waiters.
//
// The capacity is enforced when queue pairs are made, not when completions
// arrive: each queue pair reserves its MaxSend (or MaxRecv) entries, and a
// work request counts against those until its completion is polled, so the
// queue never holds more than its capacity and never drops a completion.
// (Completions of a closed queue pair stay until polled while its
// reservation is already free for new queue pairs; the ring then grows
// rather than drops.)
type completionQueue struct {
	pd       *domain
	capacity int
	wake     chan struct{} // one slot: a waiter should look again
	done     chan struct{} // closed by Close

	mu       sync.Mutex
	ring     []entry
	head, n  int
	reserved int
	closed   bool
}

// entry is a completion and the outstanding counter of the queue it
// belongs to, decremented when the completion is polled.
type entry struct {
	c           verbs.Completion
	outstanding *atomic.Int64
}

func newCompletionQueue(pd *domain, capacity int) *completionQueue {
	return &completionQueue{
		pd:       pd,
		capacity: capacity,
		wake:     make(chan struct{}, 1),
		done:     make(chan struct{}),
		ring:     make([]entry, max(capacity, 16)),
	}
}

// reserve sets aside n entries for a queue pair.
func (q *completionQueue) reserve(n int) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return fmt.Errorf("tcp: completion queue: %w", verbs.ErrClosed)
	}
	if q.reserved+n > q.capacity {
		return fmt.Errorf("tcp: completion queue of capacity %d has %d entries reserved and cannot take %d more outstanding requests: %w",
			q.capacity, q.reserved, n, verbs.ErrQueueFull)
	}
	q.reserved += n
	return nil
}

func (q *completionQueue) unreserve(n int) {
	q.mu.Lock()
	q.reserved -= n
	q.mu.Unlock()
}

// push appends completions. Into a closed queue they are dropped, and their
// requests stop counting as outstanding at once.
func (q *completionQueue) push(es ...entry) {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		for _, e := range es {
			e.outstanding.Add(-1)
		}
		return
	}
	for _, e := range es {
		if q.n == len(q.ring) {
			q.grow()
		}
		q.ring[(q.head+q.n)%len(q.ring)] = e
		q.n++
	}
	q.mu.Unlock()
	q.signal()
}

func (q *completionQueue) grow() {
	ring := make([]entry, 2*len(q.ring))
	for i := range q.n {
		ring[i] = q.ring[(q.head+i)%len(q.ring)]
	}
	q.ring, q.head = ring, 0
}

func (q *completionQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// Poll moves up to len(out) completions into out without blocking.
func (q *completionQueue) Poll(out []verbs.Completion) int {
	if len(out) == 0 {
		return 0
	}
	q.mu.Lock()
	k := min(len(out), q.n)
	for i := range k {
		e := &q.ring[q.head]
		out[i] = e.c
		e.outstanding.Add(-1)
		*e = entry{}
		q.head = (q.head + 1) % len(q.ring)
	}
	q.n -= k
	more := q.n > 0
	q.mu.Unlock()
	if more {
		q.signal() // another waiter may take the rest
	}
	return k
}

// Wait blocks until a completion is available, ctx ends or the queue is
// closed.
func (q *completionQueue) Wait(ctx context.Context, out []verbs.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	for {
		if n := q.Poll(out); n > 0 {
			return n, nil
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		select {
		case <-q.done:
			if n := q.Poll(out); n > 0 {
				return n, nil
			}
			return 0, fmt.Errorf("tcp: completion queue: %w", verbs.ErrClosed)
		default:
		}
		select {
		case <-q.wake:
		case <-q.done:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// Close releases the queue and wakes blocked waiters. Completions already
// queued can still be polled; later ones are dropped.
func (q *completionQueue) Close() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return fmt.Errorf("tcp: completion queue: %w", verbs.ErrClosed)
	}
	q.closed = true
	q.mu.Unlock()
	close(q.done)
	q.pd.removeCQ(q)
	return nil
}
