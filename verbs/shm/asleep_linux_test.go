package shm

import (
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestAwakeReceiversLookAfterSleepers: a record in the ring of a receiver
// asleep on its socket is handled by an awake receiver of the process,
// which is what a busy process, whose netpoller nobody looks at, relies
// on. b2's receiver sleeps and no wake-up can reach it (its sleeping word
// is cleared, as a poller's claim clears it, so a2 sends none); pair 1's
// receivers spin. a2's Send must still complete at b2, with b2's receiver
// asleep throughout.
func TestAwakeReceiversLookAfterSleepers(t *testing.T) {
	defer leakcheck.Check(t)
	_, _, close1 := connected(t, 4096, withRingSpin(time.Hour)) // awake until closed
	a2, b2, close2 := connected(t, 4096, withRingSpin(0))       // asleep whenever idle
	defer func() {
		close2()
		close1()
		if n := asleep.n.Load(); n != 0 {
			t.Errorf("%d receivers still listed asleep after every queue pair closed", n)
		}
	}()
	// Wait for b2's receiver to sleep, then take its sleeping word away.
	deadline := time.Now().Add(10 * time.Second)
	for !isAsleep(b2.qp) || !b2.qp.rx.sleeping.CompareAndSwap(1, 0) {
		if time.Now().After(deadline) {
			t.Fatal("b2's receiver never went to sleep")
		}
		time.Sleep(time.Millisecond)
	}
	if err := b2.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: b2.mr, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	if err := a2.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a2.mr, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, b2.cq); c.Status != verbs.StatusSuccess || c.Len != 64 {
		t.Fatalf("receive: %+v", c)
	}
	if c := waitOne(t, a2.cq); c.Status != verbs.StatusSuccess {
		t.Fatalf("send: %+v", c)
	}
	if !isAsleep(b2.qp) {
		t.Error("b2's receiver woke: the test did not check what it meant to")
	}
}

// isAsleep reports whether qp's receiver is listed asleep.
func isAsleep(qp *queuePair) bool {
	asleep.mu.Lock()
	defer asleep.mu.Unlock()
	for _, q := range asleep.qps {
		if q == qp {
			return true
		}
	}
	return false
}

// TestAsleepList: receivers leave the list in any order, and every one
// still listed is found where it says it is.
func TestAsleepList(t *testing.T) {
	qps := make([]*queuePair, 6)
	for i := range qps {
		qps[i] = &queuePair{}
		sleepBegins(qps[i])
	}
	defer func() {
		for _, qp := range qps {
			if isAsleep(qp) {
				sleepEnds(qp)
			}
		}
	}()
	for _, i := range []int{2, 5, 0, 3} {
		sleepEnds(qps[i])
		if isAsleep(qps[i]) {
			t.Fatalf("queue pair %d still listed after it woke", i)
		}
		asleep.mu.Lock()
		for at, qp := range asleep.qps {
			if qp.asleepAt != at {
				t.Errorf("listed at %d, says %d", at, qp.asleepAt)
			}
		}
		if n := asleep.n.Load(); int(n) != len(asleep.qps) {
			t.Errorf("count %d, list of %d", n, len(asleep.qps))
		}
		asleep.mu.Unlock()
	}
	for _, i := range []int{1, 4} {
		if !isAsleep(qps[i]) {
			t.Errorf("queue pair %d, still asleep, is not listed", i)
		}
	}
}
