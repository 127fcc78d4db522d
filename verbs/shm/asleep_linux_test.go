package shm

import (
	"bytes"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestAwakeReceiversLookAfterSleepers: a record in the ring of a receiver
// asleep on its socket gets handled when an awake receiver of the process
// kicks it, which is what a busy process, whose netpoller nobody looks
// at, relies on. b2's receiver sleeps and no wake-up can reach it (its
// sleeping word is cleared, as a poller's claim clears it, so a2 sends
// none); pair 1's receivers spin. a2's Send must still complete at b2,
// with no wake-up message sent.
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
	for round := range 3 {
		// Wait for b2's receiver to sleep, then take its sleeping word away.
		deadline := time.Now().Add(10 * time.Second)
		for !isAsleep(b2.qp) || !b2.qp.rx.sleeping.CompareAndSwap(1, 0) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: b2's receiver never went to sleep", round)
			}
			time.Sleep(time.Millisecond)
		}
		wakes := a2.qp.tx.wakes.Load()
		if err := b2.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: b2.mr, Length: 64}}); err != nil {
			t.Fatal(err)
		}
		if err := a2.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a2.mr, Length: 64}}); err != nil {
			t.Fatal(err)
		}
		if c := waitOne(t, b2.cq); c.Status != verbs.StatusSuccess || c.Len != 64 {
			t.Fatalf("round %d: receive: %+v", round, c)
		}
		if n := a2.qp.tx.wakes.Load() - wakes; n != 0 {
			t.Fatalf("round %d: a2 sent %d wake-ups: the test did not check what it meant to", round, n)
		}
		if c := waitOne(t, a2.cq); c.Status != verbs.StatusSuccess {
			t.Fatalf("round %d: send: %+v", round, c)
		}
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

// TestKickWhileAwake: a kick that lands after its receiver woke (a read
// deadline in the past still set) ends the receiver's next read of the
// socket, here the fd of a region the peer announces, which it then reads
// again instead of failing the queue pair.
func TestKickWhileAwake(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096, withRingSpin(time.Hour)) // a's receiver never sleeps
	defer closeAll()
	pattern(b.mr.Bytes(), 3)
	a.qp.rx.kicked.Store(true)
	a.qp.conn.SetReadDeadline(time.Unix(1, 0))
	post(t, a, readOf(1, a, 0, b, 0, 64)) // maps b's region at a: its fd comes on the socket
	if !bytes.Equal(a.mr.Bytes()[:64], b.mr.Bytes()[:64]) {
		t.Fatal("the Read's bytes differ from the source")
	}
	if a.qp.rx.kicked.Load() {
		t.Error("the read the kick ended did not take the kick back")
	}
}
