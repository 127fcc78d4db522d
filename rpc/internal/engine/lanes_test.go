package engine

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestLeastBusy: a frame call takes the first lane with the fewest
// requests awaiting answers.
func TestLeastBusy(t *testing.T) {
	if l := LeastBusy(nil); l != nil {
		t.Fatalf("a lane of none: %v", l)
	}
	lanes := make([]*Link, 3)
	for i := range lanes {
		lanes[i] = &Link{Frames: &Framing{Pending: map[uint64]*PendingCall{}}}
	}
	expect := func(i int, ref uint64) {
		lanes[i].Frames.Expect(ref, frameFetchResp, fetchAnswer())
	}
	for range 3 {
		if l := LeastBusy(lanes); l != lanes[0] {
			t.Fatal("with no request in flight, the first lane was not picked")
		}
	}
	expect(0, 1)
	if l := LeastBusy(lanes); l != lanes[1] {
		t.Fatal("a busy lane was picked over an idle one")
	}
	expect(1, 2)
	expect(2, 3)
	expect(2, 4)
	if l := LeastBusy(lanes); l != lanes[0] {
		t.Fatal("with loads 1, 1, 2 the first of the least busy was not picked")
	}
	lanes[2].Frames.Forget(3)
	lanes[2].Frames.Forget(4)
	if l := LeastBusy(lanes); l != lanes[2] {
		t.Fatal("a lane whose requests were answered was not picked")
	}

	// A one-sided request under way (a Fetch's Read, after its answer)
	// makes its lane busy too.
	for i := range lanes {
		lanes[i].room = make(chan struct{}, sendRoom)
	}
	lanes[2].room <- struct{}{}
	lanes[0].Frames.Forget(1)
	lanes[1].Frames.Forget(2)
	if l := LeastBusy(lanes); l != lanes[0] {
		t.Fatal("with loads 0, 0, 1 (a Read) the first lane was not picked")
	}
	lanes[0].room <- struct{}{}
	if l := LeastBusy(lanes); l != lanes[1] {
		t.Fatal("a lane reading was picked over an idle one")
	}
	lanes[1].room <- struct{}{}
	lanes[1].room <- struct{}{}
	if got := []int{lanes[0].Busy(), lanes[1].Busy(), lanes[2].Busy()}; !slices.Equal(got, []int{1, 2, 1}) {
		t.Fatalf("Busy: %v, want [1 2 1]", got)
	}
	if l := LeastBusy(lanes); l != lanes[0] {
		t.Fatal("with loads 1, 2, 1 the first of the least busy was not picked")
	}
	<-lanes[0].room
	<-lanes[1].room
	<-lanes[1].room
	<-lanes[2].room
	if l := LeastBusy(lanes); l != lanes[0] {
		t.Fatal("with the Reads done the first lane was not picked")
	}
}

// TestOnDead: the first lane to fail runs died, once, with its failure;
// AwaitDead waits for every lane, at most its timeout.
func TestOnDead(t *testing.T) {
	defer leakcheck.Check(t) // the test closes both lanes
	lanes := testLanes(t, verbs.RoleDial, 2)
	var wg sync.WaitGroup
	died := make(chan error, 2)
	OnDead(lanes, &wg, func(err error) { died <- err })
	start := time.Now()
	AwaitDead(lanes, 20*time.Millisecond)
	if time.Since(start) < 20*time.Millisecond {
		t.Fatal("AwaitDead returned before its timeout with every lane alive")
	}
	select {
	case err := <-died:
		t.Fatalf("died ran with every lane alive: %v", err)
	default:
	}
	broken := errors.New("lane 1 broke")
	lanes[1].Close(broken)
	if err := <-died; !errors.Is(err, broken) {
		t.Fatalf("died with %v, want %v", err, broken)
	}
	lanes[0].Close(errors.New("later"))
	AwaitDead(lanes, time.Minute) // at once: both are dead
	wg.Wait()
	if len(died) != 0 {
		t.Fatal("died ran twice")
	}
}

// TestRowRuns: pairs whose rows follow each other on both sides merge
// into one run; anything else starts a new one.
func TestRowRuns(t *testing.T) {
	idx := []int64{5, 6, 7, 7, 2, 3, 9}
	got := RowRuns(len(idx), func(i int) (int64, int64) { return idx[i], int64(i) })
	want := []RowRun{{5, 0, 3}, {7, 3, 1}, {2, 4, 2}, {9, 6, 1}}
	if !slices.Equal(got, want) {
		t.Fatalf("RowRuns = %v, want %v", got, want)
	}
}
