package rendezvous

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/pooltest"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// newPool returns a pool that must hold no buffers when the test ends.
func newPool(t *testing.T) *mempool.Pool { return pooltest.New(t, 1<<20) }

// entry allocates a published tensor of n bytes, each b.
func entry(t *testing.T, p *mempool.Pool, n int, b byte) Entry {
	t.Helper()
	buf, err := p.Alloc(context.Background(), n)
	if err != nil {
		t.Fatal(err)
	}
	for i := range buf.Bytes() {
		buf.Bytes()[i] = b
	}
	zt, err := zerocopy.New(zerocopy.Uint8, []int64{int64(n)}, buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	return Entry{Tensor: zt, Buf: buf}
}

func first(e Entry) byte { return e.Tensor.Bytes()[0] }

func TestPublishFetchTake(t *testing.T) {
	p := newPool(t)
	r := New()
	defer r.Close()
	ctx := context.Background()
	if _, err := r.Fetch(ctx, "k", false, false); !errors.Is(err, ErrNotPublished) {
		t.Fatalf("Fetch of an unpublished key: %v, want ErrNotPublished", err)
	}
	if _, err := r.TryFetch("k"); !errors.Is(err, ErrNotPublished) {
		t.Fatalf("TryFetch of an unpublished key: %v, want ErrNotPublished", err)
	}
	if err := r.Publish("k", entry(t, p, 8, 1)); err != nil {
		t.Fatal(err)
	}
	e, err := r.Fetch(ctx, "k", false, false)
	if err != nil || first(e) != 1 {
		t.Fatalf("Fetch: %v", err)
	}
	e.Buf.Release()
	e, err = r.TryFetch("k")
	if err != nil || first(e) != 1 {
		t.Fatalf("TryFetch: %v", err)
	}
	e.Buf.Release()
	// A second Publish replaces the first and releases it.
	if err := r.Publish("k", entry(t, p, 8, 2)); err != nil {
		t.Fatal(err)
	}
	if got := p.Stats().Allocs; got != 1 {
		t.Fatalf("%d buffers after a replacing Publish, want 1", got)
	}
	e, err = r.Fetch(ctx, "k", true, false)
	if err != nil || first(e) != 2 {
		t.Fatalf("take: %v", err)
	}
	e.Buf.Release()
	if r.Remove("k") {
		t.Fatal("Remove of a taken key reported it published")
	}
}

// TestSeqOrders checks that a Publish numbered before the entry in place
// does not replace it: a pulled Send that lands after a later inline Send.
func TestSeqOrders(t *testing.T) {
	p := newPool(t)
	r := New()
	defer r.Close()
	early, late := r.NextSeq(), r.NextSeq()
	e := entry(t, p, 8, 2)
	e.Seq = late
	if err := r.Publish("k", e); err != nil {
		t.Fatal(err)
	}
	e = entry(t, p, 8, 1)
	e.Seq = early
	if err := r.Publish("k", e); err != nil {
		t.Fatal(err)
	}
	got, err := r.TryFetch("k")
	if err != nil || first(got) != 2 {
		t.Fatalf("TryFetch: %v, first byte %d, want the later Send's 2", err, first(got))
	}
	got.Buf.Release()
	if !r.Remove("k") {
		t.Fatal("Remove of a published key reported it absent")
	}
}

func TestWait(t *testing.T) {
	p := newPool(t)
	r := New()
	defer r.Close()
	done := make(chan error, 1)
	go func() {
		e, err := r.Fetch(context.Background(), "k", true, true)
		if err == nil {
			e.Buf.Release()
		}
		done <- err
	}()
	time.Sleep(10 * time.Millisecond) // usually waiting by now; either way it must succeed
	if err := r.Publish("k", entry(t, p, 8, 1)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("waiting Fetch: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := r.Fetch(ctx, "never", false, true); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiting Fetch past its deadline: %v", err)
	}
	r.mu.Lock()
	n := len(r.waiters)
	r.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d keys with waiters after the wait ended", n)
	}
}

func TestStopAndClose(t *testing.T) {
	p := newPool(t)
	r := New()
	if err := r.Publish("k", entry(t, p, 8, 1)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := r.Fetch(context.Background(), "absent", false, true)
		done <- err
	}()
	r.Stop()
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("waiting Fetch after Stop: %v, want ErrClosed", err)
	}
	// Published entries stay fetchable until Close.
	e, err := r.TryFetch("k")
	if err != nil {
		t.Fatalf("TryFetch after Stop: %v", err)
	}
	e.Buf.Release()
	r.Close()
	r.Close()
	if _, err := r.TryFetch("k"); !errors.Is(err, ErrClosed) {
		t.Fatalf("TryFetch after Close: %v, want ErrClosed", err)
	}
	if err := r.Publish("k", entry(t, p, 8, 1)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Publish after Close: %v, want ErrClosed", err)
	}
}
