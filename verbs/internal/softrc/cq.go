package softrc

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// CQ implements verbs.CompletionQueue as a ring of completions guarded by
// a mutex, with a one-slot channel to wake waiters.
//
// The capacity is enforced when queue pairs are made, not when completions
// arrive: each queue pair reserves its MaxSend (or MaxRecv) entries, and a
// work request holds its slot in its WorkQueue until its completion is
// polled, so the queue never holds more than its capacity and never drops
// a completion. (Completions of a closed queue pair stay until polled while
// its reservation is already free for new queue pairs; the ring then grows
// rather than drops.)
//
// While Run runs, completions go to its handler instead of a waiter: a
// provider's goroutine that produced them with Queue hands them over
// itself (Deliver) before it next blocks, and Run's own goroutine hands
// over those pushed anywhere else (Push), so that the common path, a
// receiver completing what it received, wakes nobody.
type CQ struct {
	owner    any
	capacity int
	onClose  func()
	wake     chan struct{} // one slot: a waiter should look again
	done     chan struct{} // closed by Close

	mu       sync.Mutex
	ring     []Entry
	head, n  int
	reserved int
	closed   bool
	// handle is Run's handler while it runs; delivering is set while a
	// goroutine hands a batch to it (one at a time, so completions are
	// handled in order), and idle is signalled when it ends. batch
	// belongs to the goroutine delivering.
	handle     func([]verbs.Completion)
	delivering bool
	idle       sync.Cond
	batch      []verbs.Completion
	// gen numbers deliveries: each one that starts takes the next (see
	// DeliveryToken), and Detach moves it on, so that the goroutine whose
	// delivery was detached knows it. resume is the delivering
	// goroutine's (DeliverFrom; nil from Deliver).
	gen    uint64
	resume func()
}

// Entry is a completion and the work queue slots its poll frees.
type Entry struct {
	C     verbs.Completion
	Queue *WorkQueue
	Slots int
}

// NewCQ makes a completion queue of owner (a protection domain) with the
// given capacity. onClose, if not nil, runs once when it is closed.
func NewCQ(owner any, capacity int, onClose func()) (*CQ, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("completion queue capacity %d must be positive", capacity)
	}
	q := &CQ{
		owner:    owner,
		capacity: capacity,
		onClose:  onClose,
		wake:     make(chan struct{}, 1),
		done:     make(chan struct{}),
		ring:     make([]Entry, min(max(capacity, 16), 4096)),
	}
	q.idle.L = &q.mu
	return q, nil
}

// Owner is the domain the queue belongs to.
func (q *CQ) Owner() any { return q.owner }

// Reserve sets aside n entries for a queue pair's work queue.
func (q *CQ) Reserve(n int) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return fmt.Errorf("completion queue: %w", verbs.ErrClosed)
	}
	if q.reserved+n > q.capacity {
		return fmt.Errorf("completion queue of capacity %d has %d entries reserved and cannot take %d more: %w",
			q.capacity, q.reserved, n, verbs.ErrQueueFull)
	}
	q.reserved += n
	return nil
}

// Unreserve returns a reservation.
func (q *CQ) Unreserve(n int) {
	q.mu.Lock()
	q.reserved -= n
	q.mu.Unlock()
}

// Push appends completions and wakes a waiter (or Run). Into a closed
// queue they are dropped, and their slots are freed at once.
func (q *CQ) Push(es ...Entry) {
	if ok, _ := q.push(es); ok {
		q.signal()
	}
}

// Queue appends completions produced by a provider's goroutine that calls
// Deliver before it next blocks (its receiver): while Run runs, nobody is
// woken for them. Without Run it is Push. The caller may hold locks.
func (q *CQ) Queue(es ...Entry) {
	if ok, running := q.push(es); ok && !running {
		q.signal()
	}
}

// Hand appends completions produced by a goroutine that may not deliver
// them: when a delivery to Run's handler is under way (Delivering), that
// delivery takes them before it ends and nobody is woken, as with Queue;
// else it is Push. The caller may hold locks.
func (q *CQ) Hand(es ...Entry) {
	if ok, _, delivering := q.pushAll(es); ok && !delivering {
		q.signal()
	}
}

// Delivering reports whether a goroutine hands completions to Run's
// handler now: what is queued before that delivery ends goes to the
// handler without waking anybody (see Hand).
func (q *CQ) Delivering() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.handle != nil && q.delivering
}

// push appends es and reports whether it did (false: none, or the queue
// is closed and they were dropped) and whether Run is running.
func (q *CQ) push(es []Entry) (ok, running bool) {
	ok, running, _ = q.pushAll(es)
	return ok, running
}

// pushAll is push that also reports whether a delivery was under way as
// es went in (it then takes them).
func (q *CQ) pushAll(es []Entry) (ok, running, delivering bool) {
	if len(es) == 0 {
		return false, false, false
	}
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		for _, e := range es {
			e.free()
		}
		return false, false, false
	}
	for _, e := range es {
		if q.n == len(q.ring) {
			q.grow()
		}
		q.ring[(q.head+q.n)%len(q.ring)] = e
		q.n++
	}
	running = q.handle != nil
	delivering = running && q.delivering
	q.mu.Unlock()
	return true, running, delivering
}

// deliverBatch is how many completions Deliver hands to the handler at
// once.
const deliverBatch = 64

// Deliver hands the queued completions to Run's handler in the calling
// goroutine, unless Run is not running or another goroutine is handing
// them over already (it then takes these too). A provider calls it with
// no locks held, before its goroutine blocks, after Queue; the handler
// runs in it, so that goroutine must not be one the handler could wait
// for (see verbs.CompletionRunner).
func (q *CQ) Deliver() { q.DeliverFrom(nil) }

// DeliverFrom is Deliver for a provider's receiver that can hand its role
// to a new goroutine (verbs.Detacher): if the handler Detaches this
// delivery while it runs, resume is called, in the detaching goroutine,
// to continue the receiver in a goroutine of its own, and DeliverFrom
// returns true once the handler returns: the calling goroutine is then no
// longer the receiver, and must return without touching the receiver's
// state. resume runs while the calling goroutine is still in the
// handler, so the receiver's state must be at rest before DeliverFrom.
// With a nil resume a delivery cannot be detached.
func (q *CQ) DeliverFrom(resume func()) (detached bool) {
	q.mu.Lock()
	if q.handle == nil || q.delivering || q.n == 0 {
		q.mu.Unlock()
		return false
	}
	q.delivering = true
	q.gen++
	gen := q.gen
	q.resume = resume
	if q.batch == nil {
		q.batch = make([]verbs.Completion, deliverBatch)
	}
	batch := q.batch
	for q.n > 0 && q.handle != nil {
		handle := q.handle
		k := q.takeLocked(batch)
		q.mu.Unlock()
		handle(batch[:k])
		clear(batch[:k])
		q.mu.Lock()
		if q.gen != gen {
			// Detached: another goroutine delivers now, with a batch
			// of its own; this one was ours alone.
			q.mu.Unlock()
			return true
		}
	}
	q.delivering = false
	q.resume = nil
	q.idle.Broadcast()
	q.mu.Unlock()
	return false
}

// DeliveryToken names the delivery under way, for its handler to Detach:
// called in the handler, it returns a non-zero token when the goroutine
// delivering can hand its role over (DeliverFrom with a resume), else 0.
func (q *CQ) DeliveryToken() uint64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.delivering || q.resume == nil {
		return 0
	}
	return q.gen
}

// Detach ends the delivery named tok while its handler still runs (in
// another goroutine): the queue is free for another goroutine to deliver,
// the receiver that was delivering continues in a new goroutine (its
// resume), and Run's goroutine is woken for what is queued. It reports
// false, doing nothing, when that delivery is over.
func (q *CQ) Detach(tok uint64) bool {
	q.mu.Lock()
	if tok == 0 || !q.delivering || q.gen != tok || q.resume == nil {
		q.mu.Unlock()
		return false
	}
	resume := q.resume
	q.gen++
	q.delivering = false
	q.resume = nil
	q.batch = nil // the detached goroutine's until its handler returns
	q.idle.Broadcast()
	more := q.n > 0
	q.mu.Unlock()
	resume()
	if more {
		q.signal()
	}
	return true
}

// Run implements verbs.CompletionRunner: until ctx ends or the queue is
// closed, completions go to handle, in order and one batch at a time,
// in the goroutine that Queued them (Deliver) or else in Run's. Once the
// queue is closed it hands over what is left, then returns ErrClosed.
// Before it returns, a Deliver under way has finished; later completions
// wait for Poll or Wait again.
func (q *CQ) Run(ctx context.Context, handle func([]verbs.Completion)) error {
	q.mu.Lock()
	if q.handle != nil {
		q.mu.Unlock()
		return errors.New("completion queue: Run is running already")
	}
	q.handle = handle
	q.mu.Unlock()
	defer func() {
		q.mu.Lock()
		for q.delivering {
			q.idle.Wait()
		}
		q.handle = nil
		more := q.n > 0
		q.mu.Unlock()
		if more {
			q.signal()
		}
	}()
	for {
		q.Deliver()
		select {
		case <-q.wake:
		case <-q.done:
			q.Deliver()
			return fmt.Errorf("completion queue: %w", verbs.ErrClosed)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (e *Entry) free() {
	if e.Queue != nil {
		e.Queue.used.Add(-int64(e.Slots))
	}
}

func (q *CQ) grow() {
	ring := make([]Entry, 2*len(q.ring))
	for i := range q.n {
		ring[i] = q.ring[(q.head+i)%len(q.ring)]
	}
	q.ring, q.head = ring, 0
}

func (q *CQ) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// Poll moves up to len(out) completions into out without blocking.
func (q *CQ) Poll(out []verbs.Completion) int {
	if len(out) == 0 {
		return 0
	}
	q.mu.Lock()
	k := q.takeLocked(out)
	more := q.n > 0
	q.mu.Unlock()
	if more && k > 0 {
		q.signal() // another waiter may take the rest
	}
	return k
}

// takeLocked moves up to len(out) completions into out and frees their
// slots; the caller holds mu.
func (q *CQ) takeLocked(out []verbs.Completion) int {
	k := min(len(out), q.n)
	for i := range k {
		e := &q.ring[q.head]
		out[i] = e.C
		e.free()
		*e = Entry{}
		q.head = (q.head + 1) % len(q.ring)
	}
	q.n -= k
	return k
}

// Wait blocks until a completion is available, ctx ends or the queue is
// closed and empty.
func (q *CQ) Wait(ctx context.Context, out []verbs.Completion) (int, error) {
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
			return 0, fmt.Errorf("completion queue: %w", verbs.ErrClosed)
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
// queued can still be polled; later ones are dropped. It is idempotent.
func (q *CQ) Close() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return nil
	}
	q.closed = true
	q.mu.Unlock()
	close(q.done)
	if q.onClose != nil {
		q.onClose()
	}
	return nil
}
