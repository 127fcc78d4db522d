package softrc

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// runCQ starts Run on a new queue with handle and returns the queue, the
// work queue whose slots its entries hold, and a channel that receives
// Run's result.
func runCQ(t *testing.T, handle func([]verbs.Completion)) (*CQ, *WorkQueue, chan error) {
	t.Helper()
	q, err := NewCQ(nil, 64, nil)
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- q.Run(context.Background(), handle) }()
	waitFor(t, "Run to start", func() bool {
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.handle != nil
	})
	return q, NewWorkQueue(64), ran
}

// waitFor waits, up to a generous deadline, for cond.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// entry takes a slot of w for the completion of request id.
func entry(t *testing.T, w *WorkQueue, id uint64) Entry {
	t.Helper()
	if err := w.Take(1); err != nil {
		t.Fatal(err)
	}
	e, _ := w.Complete(verbs.Completion{ID: id}, false)
	return e
}

// TestRunDeliverInProducer: completions Queued while Run runs go to its
// handler in the goroutine that calls Deliver, before Deliver returns,
// and free their slots; nobody else is woken for them.
func TestRunDeliverInProducer(t *testing.T) {
	var mu sync.Mutex
	var got []uint64
	var producer atomic.Bool // set while the producing goroutine delivers
	var elsewhere atomic.Int64
	q, w, ran := runCQ(t, func(cs []verbs.Completion) {
		if !producer.Load() {
			elsewhere.Add(1)
		}
		mu.Lock()
		for _, c := range cs {
			got = append(got, c.ID)
		}
		mu.Unlock()
	})
	for i := range uint64(100) {
		q.Queue(entry(t, w, i))
		producer.Store(true)
		q.Deliver()
		producer.Store(false)
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n != int(i)+1 {
			t.Fatalf("after Deliver of completion %d: %d handled, want %d", i, n, i+1)
		}
		if u := w.Outstanding(); u != 0 {
			t.Fatalf("after Deliver of completion %d: %d slots held, want 0", i, u)
		}
	}
	if n := elsewhere.Load(); n != 0 {
		t.Errorf("%d batches were handled outside the producer", n)
	}
	for i, id := range got {
		if id != uint64(i) {
			t.Fatalf("completion %d handled as %d-th", id, i)
		}
	}
	q.Close()
	if err := <-ran; !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("Run after Close: %v, want ErrClosed", err)
	}
}

// TestRunPush: completions Pushed (not by a goroutine that delivers) go to
// the handler in Run's goroutine.
func TestRunPush(t *testing.T) {
	handled := make(chan uint64, 10)
	q, w, ran := runCQ(t, func(cs []verbs.Completion) {
		for _, c := range cs {
			handled <- c.ID
		}
	})
	q.Push(entry(t, w, 7))
	select {
	case id := <-handled:
		if id != 7 {
			t.Errorf("handled %d, want 7", id)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a Pushed completion was not handled")
	}
	waitFor(t, "the slot to be freed", func() bool { return w.Outstanding() == 0 })
	q.Close()
	<-ran
}

// TestHand: a completion Handed while a delivery is under way (from its
// handler, as a provider's writer completing a request it just wrote)
// goes to that delivery's handler before Deliver returns, and Delivering
// says so; Handed with no delivery under way, Run's goroutine handles it.
func TestHand(t *testing.T) {
	var mu sync.Mutex
	var got []uint64
	var inHandler atomic.Bool
	var w *WorkQueue
	var q *CQ
	var sawDelivering atomic.Bool
	q, w, ran := runCQ(t, func(cs []verbs.Completion) {
		inHandler.Store(true)
		defer inHandler.Store(false)
		for _, c := range cs {
			if c.ID == 1 {
				sawDelivering.Store(q.Delivering())
				q.Hand(entry(t, w, 2))
			}
			mu.Lock()
			got = append(got, c.ID)
			mu.Unlock()
		}
	})
	if q.Delivering() {
		t.Fatal("Delivering with no delivery under way")
	}
	q.Queue(entry(t, w, 1))
	q.Deliver()
	mu.Lock()
	n := len(got)
	mu.Unlock()
	if n != 2 || !sawDelivering.Load() {
		t.Fatalf("after the delivery: %d handled (want 2: the one Handed in it too), Delivering in the handler %v", n, sawDelivering.Load())
	}
	q.Hand(entry(t, w, 3))
	waitFor(t, "the Handed completion to be handled by Run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) == 3
	})
	waitFor(t, "the slots to be freed", func() bool { return w.Outstanding() == 0 })
	q.Close()
	<-ran
}

// TestRunOrderOneAtATime: producers Queueing and Delivering and others
// Pushing at once: the handler never runs in two goroutines at once, and
// each producer's completions are handled in the order it queued them.
func TestRunOrderOneAtATime(t *testing.T) {
	const producers, each = 4, 500
	var inside atomic.Int32
	var overlap atomic.Bool
	last := make([]int64, producers)
	var bad atomic.Value
	q, _, ran := runCQ(t, func(cs []verbs.Completion) {
		if inside.Add(1) != 1 {
			overlap.Store(true)
		}
		for _, c := range cs {
			p, i := c.ID/each, int64(c.ID%each)
			if i != last[p]+1 {
				bad.Store(c.ID)
			}
			last[p] = i
		}
		inside.Add(-1)
	})
	for p := range last {
		last[p] = -1
	}
	w := NewWorkQueue(producers * each)
	var wg sync.WaitGroup
	for p := range uint64(producers) {
		wg.Go(func() {
			for i := range uint64(each) {
				if err := w.Take(1); err != nil {
					panic(err)
				}
				e, _ := w.Complete(verbs.Completion{ID: p*each + i}, false)
				if p%2 == 0 {
					q.Queue(e)
					q.Deliver()
				} else {
					q.Push(e)
				}
			}
		})
	}
	wg.Wait()
	waitFor(t, "every completion to be handled", func() bool { return w.Outstanding() == 0 })
	if overlap.Load() {
		t.Error("the handler ran in two goroutines at once")
	}
	if id := bad.Load(); id != nil {
		t.Errorf("completion %d was handled out of its producer's order", id)
	}
	q.Close()
	<-ran
}

// TestRunClose: Run hands over what was queued before Close, waits for a
// Deliver under way, and returns ErrClosed; what is queued after Close is
// dropped with its slots freed; Wait works again once Run has returned.
func TestRunClose(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	var handled atomic.Int64
	q, w, ran := runCQ(t, func(cs []verbs.Completion) {
		if cs[0].ID == 1 {
			close(entered)
			<-release
		}
		handled.Add(int64(len(cs)))
	})
	q.Queue(entry(t, w, 1))
	go q.Deliver() // a producer's Deliver, held in the handler
	<-entered
	q.Push(entry(t, w, 2)) // taken by the Deliver under way once it is released
	q.Close()
	select {
	case err := <-ran:
		t.Fatalf("Run returned (%v) while a Deliver was under way", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	if err := <-ran; !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("Run after Close: %v, want ErrClosed", err)
	}
	if n := handled.Load(); n != 2 {
		t.Errorf("%d completions handled, want 2", n)
	}
	q.Queue(entry(t, w, 3))
	if u := w.Outstanding(); u != 0 {
		t.Errorf("%d slots held after Queue into a closed queue, want 0", u)
	}
	if _, err := q.Wait(context.Background(), make([]verbs.Completion, 4)); !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("Wait after Close: %v, want ErrClosed", err)
	}
}

// TestQueueWithoutRun: without Run, Queue is Push: a waiter wakes.
func TestQueueWithoutRun(t *testing.T) {
	q, err := NewCQ(nil, 8, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	w := NewWorkQueue(8)
	go func() {
		time.Sleep(time.Millisecond)
		q.Queue(entry(t, w, 5))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := make([]verbs.Completion, 4)
	n, err := q.Wait(ctx, out)
	if err != nil || n != 1 || out[0].ID != 5 {
		t.Fatalf("Wait = %d, %v (%v), want completion 5", n, err, out[:n])
	}
	if u := w.Outstanding(); u != 0 {
		t.Errorf("%d slots held after Wait, want 0", u)
	}
}

// TestRunStopsWithContext: Run returns ctx.Err() when ctx ends, after
// which completions wait for Wait again, and a second Run may start.
func TestRunStopsWithContext(t *testing.T) {
	q, err := NewCQ(nil, 8, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- q.Run(ctx, func([]verbs.Completion) {}) }()
	waitFor(t, "Run to start", func() bool {
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.handle != nil
	})
	if err := q.Run(context.Background(), nil); err == nil {
		t.Error("a second Run while one runs did not fail")
	}
	cancel()
	if err := <-ran; !errors.Is(err, context.Canceled) {
		t.Errorf("Run after cancel: %v, want context.Canceled", err)
	}
	w := NewWorkQueue(8)
	q.Queue(entry(t, w, 9))
	q.Deliver() // no handler: nothing happens
	out := make([]verbs.Completion, 4)
	if n := q.Poll(out); n != 1 || out[0].ID != 9 {
		t.Errorf("Poll after Run = %d (%v), want completion 9", n, out[:n])
	}
}

// TestDeliverDetach: a handler running in a receiver's delivery
// (DeliverFrom) gets a token, and Detach from another goroutine while it
// runs calls the receiver's resume once and frees the queue: completions
// queued after it go to the handler in another goroutine's Deliver while
// the first handler still runs, and the first DeliverFrom reports the
// detach once its handler returns. A plain Deliver's handler gets no
// token, and a token whose delivery ended detaches nothing.
func TestDeliverDetach(t *testing.T) {
	var q *CQ
	release := make(chan struct{})
	tokens := make(chan uint64, 4)
	var handled atomic.Int32
	q, w, ran := runCQ(t, func(cs []verbs.Completion) {
		for _, c := range cs {
			handled.Add(1)
			tokens <- q.DeliveryToken()
			if c.ID == 1 {
				<-release
			}
		}
	})
	// A plain Deliver: no token.
	q.Queue(entry(t, w, 0))
	q.Deliver()
	if tok := <-tokens; tok != 0 {
		t.Fatalf("a plain Deliver's handler got token %d, want 0", tok)
	}
	var resumed atomic.Int32
	detached := make(chan bool, 1)
	q.Queue(entry(t, w, 1))
	go func() { detached <- q.DeliverFrom(func() { resumed.Add(1) }) }()
	tok := <-tokens
	if tok == 0 {
		t.Fatal("a receiver's delivery gave its handler no token")
	}
	// Held in the handler: another goroutine cannot deliver yet.
	q.Queue(entry(t, w, 2))
	q.Deliver()
	if n := handled.Load(); n != 2 {
		t.Fatalf("%d completions handled while the first delivery holds the queue, want 2", n)
	}
	if !q.Detach(tok) {
		t.Fatal("Detach of the delivery under way failed")
	}
	if q.Detach(tok) {
		t.Fatal("a second Detach of the same delivery succeeded")
	}
	if resumed.Load() != 1 {
		t.Fatalf("resume ran %d times, want 1", resumed.Load())
	}
	// Completion 2 was queued: Run's goroutine, woken by Detach, or this
	// Deliver hands it over while the first handler still runs.
	q.Deliver()
	waitFor(t, "completion 2 after the detach", func() bool { return handled.Load() == 3 })
	<-tokens
	select {
	case <-detached:
		t.Fatal("DeliverFrom returned while its handler still ran")
	default:
	}
	close(release)
	if !<-detached {
		t.Fatal("the detached DeliverFrom reported false")
	}
	if q.Detach(tok) {
		t.Fatal("Detach of an ended delivery succeeded")
	}
	// The queue delivers as before.
	q.Queue(entry(t, w, 3))
	q.Deliver()
	if handled.Load() != 4 {
		t.Fatalf("%d handled after the detached delivery ended, want 4", handled.Load())
	}
	<-tokens
	if u := w.Outstanding(); u != 0 {
		t.Fatalf("%d slots held, want 0", u)
	}
	q.Close()
	if err := <-ran; !errors.Is(err, verbs.ErrClosed) {
		t.Fatalf("Run: %v", err)
	}
}
