package tcp

import (
	"context"
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// writerWatch counts the parks and wakes of the writer goroutines of the
// test's queue pairs.
type writerWatch struct {
	mu           sync.Mutex
	parks, wakes map[*queuePair]int
}

func watchWriters(t *testing.T) *writerWatch {
	w := &writerWatch{parks: map[*queuePair]int{}, wakes: map[*queuePair]int{}}
	writerParks = func(q *queuePair, woke bool) {
		w.mu.Lock()
		defer w.mu.Unlock()
		if woke {
			w.wakes[q]++
		} else {
			w.parks[q]++
		}
	}
	t.Cleanup(func() { writerParks = nil })
	return w
}

// Wakes is how many times q's writer was woken.
func (w *writerWatch) Wakes(q *queuePair) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.wakes[q]
}

// awaitParked waits until q's writer waits for something to write.
func (w *writerWatch) awaitParked(t *testing.T, q *queuePair) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		w.mu.Lock()
		parked := w.parks[q] > w.wakes[q]
		w.mu.Unlock()
		if parked {
			return
		}
	}
	t.Fatal("the writer goroutine never waited")
}

// TestPosterLeavesItsSendToTheHolder: a poster that finds another
// goroutine writing (writeMu held) leaves its request to that goroutine,
// which writes it as it lets go (combine), and wakes no writer goroutine:
// a Send posted before the holder took the queue goes with its batch, one
// posted after it, in a batch of its own right after.
func TestPosterLeavesItsSendToTheHolder(t *testing.T) {
	defer leakcheck.Check(t)
	watch := watchWriters(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	aq := a.qp.(*queuePair)
	amem, bmem := []byte("combinedlefttoit"), make([]byte, 16)
	amr, bmr := registerPair(t, a, b, amem, bmem)
	for i := range 2 {
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: uint64(i), Local: verbs.Local{Region: bmr, Offset: 8 * i, Length: 8}}); err != nil {
			t.Fatal(err)
		}
	}
	aq.Mu.Lock()
	conn, raw := aq.ConnLocked(), aq.raw
	aq.Mu.Unlock()
	if raw == nil {
		t.Fatal("the connection has no raw connection: nothing is written without blocking")
	}
	watch.awaitParked(t, aq) // done with the connection's start
	wakes := watch.Wakes(aq)
	aq.writeMu.Lock() // a write under way
	if err := a.qp.PostSend(verbs.SendRequest{ID: 10, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Length: 8}}); err != nil {
		aq.writeMu.Unlock()
		t.Fatal(err)
	}
	if !aq.pending.Load() {
		t.Error("the poster did not leave its Send to the holder (pending unset)")
	}
	var once sync.Once
	afterTake = func() {
		// The holder has taken the queue (the first Send): the second
		// is posted behind its back.
		once.Do(func() {
			posted := make(chan error)
			go func() {
				posted <- a.qp.PostSend(verbs.SendRequest{ID: 11, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Offset: 8, Length: 8}})
			}()
			if err := <-posted; err != nil {
				t.Error(err)
			}
		})
	}
	defer func() { afterTake = nil }()
	aq.combine(conn, true, nil, raw) // the holder lets go
	for i := range 2 {
		if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != uint64(i) || c.Status != verbs.StatusSuccess {
			t.Fatalf("b's receive %d: %+v, %v (a Send left behind?)", i, c, ok)
		}
		if c, ok := waitCompletion(t, a.cq, 10*time.Second); !ok || c.ID != uint64(10+i) || c.Status != verbs.StatusSuccess {
			t.Fatalf("a's Send %d: %+v, %v", 10+i, c, ok)
		}
	}
	if string(bmem) != string(amem) {
		t.Errorf("b received %q, want %q", bmem, amem)
	}
	if n := watch.Wakes(aq) - wakes; n != 0 {
		t.Errorf("the writer goroutine woke %d times for Sends the holder wrote", n)
	}
}

// TestConcurrentPostersKeepEverySend: posters on several goroutines at
// once, each finding the others writing, lose no Send and keep each
// one's own order (the queue pair's is the posting order).
func TestConcurrentPostersKeepEverySend(t *testing.T) {
	defer leakcheck.Check(t)
	watch := watchWriters(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	const posters, each, size = 8, 120, 8 // at most 1024 requests outstanding
	const total = posters * each
	amem, bmem := make([]byte, total*size), make([]byte, total*size)
	amr, bmr := registerPair(t, a, b, amem, bmem)
	for i := range total {
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: uint64(i), Local: verbs.Local{Region: bmr, Offset: i * size, Length: size}}); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var received, sent []verbs.Completion
	var wg sync.WaitGroup
	wg.Go(func() { received = drain(ctx, b.cq, total) })
	wg.Go(func() { sent = drain(ctx, a.cq, total) })
	var posted sync.WaitGroup
	for p := range posters {
		posted.Go(func() {
			for k := range each {
				i := p*each + k
				binary.LittleEndian.PutUint32(amem[i*size:], uint32(p))
				binary.LittleEndian.PutUint32(amem[i*size+4:], uint32(k))
				if err := a.qp.PostSend(verbs.SendRequest{ID: uint64(i), Op: verbs.OpSend, Local: verbs.Local{Region: amr, Offset: i * size, Length: size}}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	posted.Wait()
	wg.Wait()
	if len(received) != total || len(sent) != total {
		t.Fatalf("%d of %d Sends completed, %d of %d receives (a request left behind?)", len(sent), total, len(received), total)
	}
	for _, c := range append(received, sent...) {
		if c.Status != verbs.StatusSuccess {
			t.Fatalf("completion %+v", c)
		}
	}
	next := make([]uint32, posters)
	for i, c := range received {
		if c.ID != uint64(i) || c.Len != size {
			t.Fatalf("receive %d: %+v", i, c)
		}
		p, k := binary.LittleEndian.Uint32(bmem[i*size:]), binary.LittleEndian.Uint32(bmem[i*size+4:])
		if p >= posters || k != next[p] {
			t.Fatalf("receive %d holds poster %d's Send %d, want its %d", i, p, k, next[min(p, posters-1)])
		}
		next[p]++
	}
	t.Logf("%d Sends from %d goroutines, %d wakes of their writer", total, posters, watch.Wakes(a.qp.(*queuePair)))
}

// drain collects n completions from cq, or what came before ctx ended.
func drain(ctx context.Context, cq verbs.CompletionQueue, n int) []verbs.Completion {
	var got []verbs.Completion
	out := make([]verbs.Completion, 64)
	for len(got) < n {
		k, err := cq.Wait(ctx, out)
		got = append(got, out[:k]...)
		if err != nil {
			break
		}
	}
	return got
}

// registerPair registers amem on a's domain and bmem on b's, for local
// writes.
func registerPair(t *testing.T, a, b end, amem, bmem []byte) (amr, bmr verbs.MemoryRegion) {
	t.Helper()
	var err error
	if amr, err = a.pd.RegisterMemory(verbs.Memory{Bytes: amem}, verbs.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	if bmr, err = b.pd.RegisterMemory(verbs.Memory{Bytes: bmem}, verbs.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	return amr, bmr
}
