package engine

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestTurn: frame calls take a session's lanes in turn, every lane as
// often as any other.
func TestTurn(t *testing.T) {
	var turn Turn
	if l := turn.Next(nil); l != nil {
		t.Fatalf("a lane of none: %v", l)
	}
	lanes := []*Link{{}, {}, {}}
	if l := turn.Next(lanes[:1]); l != lanes[0] {
		t.Fatal("the only lane was not picked")
	}
	picked := map[*Link]int{}
	for range 3 * len(lanes) {
		picked[turn.Next(lanes)]++
	}
	for i, l := range lanes {
		if picked[l] != 3 {
			t.Fatalf("lane %d picked %d times of %d, want 3", i, picked[l], 3*len(lanes))
		}
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
