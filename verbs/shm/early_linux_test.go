package shm

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// earlySetup connects two ends of size bytes whose Sends wait up to rnr
// for a Recv, fills b's region, maps it at a (one Read) and posts a Send
// from a that b has no Recv for: it waits for its ack on a's Inflight
// when earlySetup returns.
func earlySetup(t *testing.T, size int, rnr time.Duration) (a, b *end, closeAll func()) {
	t.Helper()
	a, b, closeAll = connected(t, size, WithRNRTimeout(rnr))
	pattern(b.mr.Bytes(), 9)
	post(t, a, readOf(100, a, 0, b, 0, 64)) // maps b's region at a
	if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Length: 16}}); err != nil {
		closeAll()
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		a.qp.Mu.Lock()
		waiting := a.qp.executing && len(a.qp.Inflight) == 1
		a.qp.Mu.Unlock()
		if waiting {
			return a, b, closeAll
		}
		if time.Now().After(deadline) {
			closeAll()
			t.Fatal("the Send is not awaiting its ack 10 s after it was posted")
		}
		time.Sleep(time.Millisecond)
	}
}

// waitN waits for n completions of e's queue and returns them.
func waitN(t *testing.T, e *end, n int) []verbs.Completion {
	t.Helper()
	cs := make([]verbs.Completion, 0, n)
	for range n {
		cs = append(cs, waitOne(t, e.cq))
	}
	return cs
}

// expectCompletions checks cs's ids and statuses, in order.
func expectCompletions(t *testing.T, cs []verbs.Completion, ids []uint64, sts []verbs.Status) {
	t.Helper()
	for i, c := range cs {
		if c.ID != ids[i] || c.Status != sts[i] {
			t.Fatalf("completions %+v, want ids %v with statuses %v, in that order", cs, ids, sts)
		}
	}
}

// TestReadsEarlyBehindSendAwaitingAck posts Reads behind a Send that the peer
// has no Recv for: they copy in the poster's goroutine at once, and their
// completions wait for the Send's, which comes with the peer's Recv.
func TestReadsEarlyBehindSendAwaitingAck(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 1 << 20
	a, b, closeAll := earlySetup(t, size, time.Minute)
	defer closeAll()
	reads := []verbs.SendRequest{
		readOf(2, a, 4096, b, 1000, 300<<10),
		readOf(3, a, 512<<10, b, 0, 4096),
	}
	if err := a.qp.PostSend(reads...); err != nil {
		t.Fatal(err)
	}
	// One more, posted on its own, runs early too.
	if err := a.qp.PostSend(readOf(4, a, 600<<10, b, 700<<10, 100<<10)); err != nil {
		t.Fatal(err)
	}
	// Copied already, before the Send's ack: PostSend ran them.
	for _, r := range []struct{ dst, src, n int }{{4096, 1000, 300 << 10}, {512 << 10, 0, 4096}, {600 << 10, 700 << 10, 100 << 10}} {
		if !bytes.Equal(a.mr.Bytes()[r.dst:r.dst+r.n], b.mr.Bytes()[r.src:r.src+r.n]) {
			t.Fatalf("read of %d bytes into offset %d: not copied while the Send awaited its ack", r.n, r.dst)
		}
	}
	var cs [4]verbs.Completion
	if n := a.cq.Poll(cs[:]); n != 0 {
		t.Fatalf("completions %+v before the Send ahead of them completed", cs[:n])
	}
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 7, Local: verbs.Local{Region: b.mr, Offset: size - 64, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess || c.Len != 16 {
		t.Fatalf("the receive: %+v", c)
	}
	got := waitN(t, a, 4)
	ok := verbs.StatusSuccess
	expectCompletions(t, got, []uint64{1, 2, 3, 4}, []verbs.Status{ok, ok, ok, ok})
	// The queue pair is idle again: a Write runs, and a Read after it.
	post(t, a, verbs.SendRequest{ID: 5, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 32},
		Remote: verbs.Remote{Addr: b.mr.Addr() + 64, Key: b.mr.RemoteKey()}}, readOf(6, a, 128, b, 64, 32))
	if !bytes.Equal(a.mr.Bytes()[128:160], a.mr.Bytes()[:32]) {
		t.Fatal("a Read after a Write did not see the Write's bytes")
	}
}

// TestReadEarlyFlushedAfterRefusedSend: the Send ahead of Reads run
// early behind it is refused (no Recv within the RNR timeout); they complete
// after it, flushed.
func TestReadEarlyFlushedAfterRefusedSend(t *testing.T) {
	defer leakcheck.Check(t)
	a, _, closeAll := earlySetup(t, 64<<10, time.Second)
	defer closeAll()
	if err := a.qp.PostSend(readOf(2, a, 0, a, 0, 1024), readOf(3, a, 4096, a, 0, 1024)); err != nil {
		t.Fatal(err)
	}
	got := waitN(t, a, 3)
	expectCompletions(t, got, []uint64{1, 2, 3}, []verbs.Status{verbs.StatusReceiverNotReady, verbs.StatusFlushed, verbs.StatusFlushed})
	if st := a.qp.State(); st != verbs.QPError {
		t.Fatalf("queue pair %v after a refused Send, want ERR", st)
	}
}

// TestReadEarlyFails: a Read run early behind the Send awaiting its ack fails
// (outside the peer's region); once the Send completes, the Read's
// failure follows, the queue pair fails, and the Read after it flushes.
func TestReadEarlyFails(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 64 << 10
	a, b, closeAll := earlySetup(t, size, time.Minute)
	defer closeAll()
	if err := a.qp.PostSend(readOf(2, a, 0, b, size-100, 200), readOf(3, a, 4096, b, 0, 1024)); err != nil {
		t.Fatal(err)
	}
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 7, Local: verbs.Local{Region: b.mr, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	got := waitN(t, a, 3)
	expectCompletions(t, got, []uint64{1, 2, 3}, []verbs.Status{verbs.StatusSuccess, verbs.StatusRemoteAccess, verbs.StatusFlushed})
	if got[1].Err == nil {
		t.Fatalf("failed read without its error: %+v", got[1])
	}
	if st := a.qp.State(); st != verbs.QPError {
		t.Fatalf("queue pair %v after a failed Read, want ERR", st)
	}
}

// TestCloseWithReadsEarly closes the queue pair while Reads run early
// wait for the Send's ack: every request flushes once, in order.
func TestCloseWithReadsEarly(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := earlySetup(t, 64<<10, time.Minute)
	defer closeAll()
	if err := a.qp.PostSend(readOf(2, a, 0, b, 0, 1024), readOf(3, a, 4096, b, 0, 1024)); err != nil {
		t.Fatal(err)
	}
	if err := a.qp.Close(); err != nil {
		t.Fatal(err)
	}
	got := waitN(t, a, 3)
	expectCompletions(t, got, []uint64{1, 2, 3}, []verbs.Status{verbs.StatusFlushed, verbs.StatusFlushed, verbs.StatusFlushed})
	var more [1]verbs.Completion
	if n := a.cq.Poll(more[:]); n != 0 {
		t.Fatalf("a fourth completion after close: %+v", more[0])
	}
}

// TestAckRunsQueuedRequests: requests queued behind a Send awaiting its
// ack are run by the goroutine that handles the ack, small ones only
// (runQueuedLimit), in order; a larger one is left to the sender.
func TestAckRunsQueuedRequests(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 1 << 20
	a, b, closeAll := earlySetup(t, size, time.Minute)
	defer closeAll()
	copy(a.mr.Bytes()[4096:], "second message")
	copy(a.mr.Bytes()[8192:], "third")
	copy(a.mr.Bytes()[12288:], "written")
	big := runQueuedLimit + 1
	wrs := []verbs.SendRequest{
		{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Offset: 4096, Length: 14}},
		{ID: 3, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Offset: 8192, Length: 5}},
		{ID: 4, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Offset: 12288, Length: 7},
			Remote: verbs.Remote{Addr: b.mr.Addr() + 1000, Key: b.mr.RemoteKey()}},
		readOf(5, a, size-big, b, 0, big),
	}
	if err := a.qp.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	a.qp.Mu.Lock()
	queued := len(a.qp.Sendq)
	a.qp.Mu.Unlock()
	if queued != len(wrs) {
		t.Fatalf("%d requests queued behind the Send awaiting its ack, want %d", queued, len(wrs))
	}
	for i := range 3 {
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: uint64(10 + i), Local: verbs.Local{Region: b.mr, Offset: size - 4096*(i+1), Length: 64}}); err != nil {
			t.Fatal(err)
		}
	}
	got := waitN(t, a, 5)
	ok := verbs.StatusSuccess
	expectCompletions(t, got, []uint64{1, 2, 3, 4, 5}, []verbs.Status{ok, ok, ok, ok, ok})
	recvs := waitN(t, b, 3)
	expectCompletions(t, recvs, []uint64{10, 11, 12}, []verbs.Status{ok, ok, ok})
	if m := string(b.mr.Bytes()[size-8192 : size-8192+14]); m != "second message" {
		t.Fatalf("second message arrived as %q", m)
	}
	if m := string(b.mr.Bytes()[1000:1007]); m != "written" {
		t.Fatalf("the Write left %q", m)
	}
	if !bytes.Equal(a.mr.Bytes()[size-big:], b.mr.Bytes()[:big]) {
		t.Fatal("the large Read's bytes differ")
	}
	a.qp.Mu.Lock()
	ran := a.qp.ranQueued
	a.qp.Mu.Unlock()
	if ran != 3 {
		t.Fatalf("the acks' goroutine ran %d queued requests, want 3 (two Sends and the Write; the large Read is the sender's)", ran)
	}
}

// TestReadEarlyBehindQueuedSend: a Read posted behind a Send that is only
// queued (another awaits its ack) copies at once too, and completes after
// both Sends; a Read behind a queued Write waits for its turn, and sees
// the Write's bytes.
func TestReadEarlyBehindQueuedSend(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 1 << 20
	a, b, closeAll := earlySetup(t, size, time.Minute)
	defer closeAll()
	copy(a.mr.Bytes()[4096:], "queued message")
	copy(a.mr.Bytes()[8192:], "new bytes")
	early := readOf(3, a, 64<<10, b, 128<<10, 256<<10)
	if err := a.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Offset: 4096, Length: 14}}, early); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.mr.Bytes()[64<<10:320<<10], b.mr.Bytes()[128<<10:384<<10]) {
		t.Fatal("a Read behind a queued Send was not copied as it was posted")
	}
	// Behind a Write to the bytes it reads: it must see the new ones.
	if err := a.qp.PostSend(
		verbs.SendRequest{ID: 4, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Offset: 8192, Length: 9},
			Remote: verbs.Remote{Addr: b.mr.Addr() + 500<<10, Key: b.mr.RemoteKey()}},
		readOf(5, a, 600<<10, b, 500<<10, 9)); err != nil {
		t.Fatal(err)
	}
	var cs [4]verbs.Completion
	if n := a.cq.Poll(cs[:]); n != 0 {
		t.Fatalf("completions %+v before the Send ahead of them completed", cs[:n])
	}
	for i := range 2 {
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: uint64(10 + i), Local: verbs.Local{Region: b.mr, Offset: size - 4096*(i+1), Length: 64}}); err != nil {
			t.Fatal(err)
		}
	}
	got := waitN(t, a, 5)
	ok := verbs.StatusSuccess
	expectCompletions(t, got, []uint64{1, 2, 3, 4, 5}, []verbs.Status{ok, ok, ok, ok, ok})
	if m := string(a.mr.Bytes()[600<<10 : 600<<10+9]); m != "new bytes" {
		t.Fatalf("the Read behind the Write found %q, want the Write's bytes", m)
	}
	if m := string(b.mr.Bytes()[size-8192 : size-8192+14]); m != "queued message" {
		t.Fatalf("the queued Send arrived as %q", m)
	}
}

// TestEarlyReadsInterleaved posts a random mix of Sends, Reads and Writes
// in small batches while the peer posts its Recvs late, so that Sends
// await their acks and Reads run early behind them: every request
// completes once, in posting order, and every Read finds what the Writes
// posted before it left (and nothing a later Write put there). With
// closeAt set, the queue pair closes part way: the completions are the
// successes in order, then the rest flushed in order, each once.
func TestEarlyReadsInterleaved(t *testing.T) {
	for _, closeAt := range []int{-1, 60} {
		t.Run(fmt.Sprintf("close=%d", closeAt), func(t *testing.T) { earlyInterleaved(t, closeAt) })
	}
}

func earlyInterleaved(t *testing.T, closeAt int) {
	defer leakcheck.Check(t)
	const (
		slot    = 4096
		slots   = 32      // read/write targets in b, at 0
		recvOff = 1 << 20 // b's receive buffers
		srcOff  = 1 << 20 // a's Write and Send sources
		n       = 120     // under MaxSend (128): completions are taken at the end
		size    = 4 << 20
	)
	a, b, closeAll := connected(t, size, WithRNRTimeout(time.Minute))
	defer closeAll()
	rng := rand.New(rand.NewPCG(1, uint64(closeAt+2)))
	pattern(b.mr.Bytes()[:slots*slot], 3)
	model := make([][]byte, slots) // what b's slots hold after the Writes posted so far
	for i := range model {
		model[i] = append([]byte(nil), b.mr.Bytes()[i*slot:(i+1)*slot]...)
	}
	post(t, a, readOf(1000, a, 0, b, 0, 64)) // maps b's region at a
	type want struct {
		dst  int
		data []byte
	}
	reads := map[uint64]want{}
	sends := 0
	recvs := make(chan int, n)
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		for i := range recvs {
			time.Sleep(time.Duration(100+i%5*50) * time.Microsecond)
			if b.qp.PostRecv(verbs.RecvRequest{ID: uint64(i), Local: verbs.Local{Region: b.mr, Offset: recvOff + i*slot, Length: slot}}) != nil {
				return
			}
		}
	}()
	posted := 0
	for posted < n {
		var batch []verbs.SendRequest
		for k := 1 + rng.IntN(3); k > 0 && posted < n; k-- {
			id := uint64(posted)
			switch r := rng.IntN(20); {
			case r < 6:
				src := srcOff + posted*slot
				pattern(a.mr.Bytes()[src:src+64], byte(posted))
				batch = append(batch, verbs.SendRequest{ID: id, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Offset: src, Length: 64}})
				recvs <- sends
				sends++
			case r < 7: // few Writes: a queued one holds the Reads behind it to their turn
				s := rng.IntN(slots)
				src := srcOff + posted*slot
				pattern(a.mr.Bytes()[src:src+slot], byte(7*posted+1))
				model[s] = append([]byte(nil), a.mr.Bytes()[src:src+slot]...)
				batch = append(batch, verbs.SendRequest{ID: id, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Offset: src, Length: slot},
					Remote: verbs.Remote{Addr: b.mr.Addr() + uint64(s*slot), Key: b.mr.RemoteKey()}})
			default:
				s := rng.IntN(slots)
				dst := 2*size/4 + posted*slot // a's read targets, from 2 MiB
				reads[id] = want{dst: dst, data: append([]byte(nil), model[s]...)}
				batch = append(batch, readOf(id, a, dst, b, s*slot, slot))
			}
			posted++
		}
		if err := a.qp.PostSend(batch...); err != nil {
			t.Fatal(err)
		}
		if closeAt >= 0 && posted >= closeAt {
			a.qp.Close()
			break
		}
	}
	close(recvs)
	got := waitN(t, a, posted)
	failed := false
	for i, c := range got {
		if c.ID != uint64(i) {
			t.Fatalf("completion %d is of request %d, want posting order", i, c.ID)
		}
		if c.Status != verbs.StatusSuccess {
			if closeAt < 0 {
				t.Fatalf("request %d: %v", i, verbs.CompletionError(c))
			}
			if failed && c.Status != verbs.StatusFlushed {
				t.Fatalf("request %d after the first failure: %v, want flushed", i, c.Status)
			}
			failed = true
			continue
		}
		if failed {
			t.Fatalf("request %d succeeded after an earlier one failed", i)
		}
		if w, ok := reads[c.ID]; ok && !bytes.Equal(a.mr.Bytes()[w.dst:w.dst+slot], w.data) {
			t.Fatalf("read %d did not find what the Writes before it left", i)
		}
	}
	var more [1]verbs.Completion
	if k := a.cq.Poll(more[:]); k != 0 {
		t.Fatalf("a completion past the %d posted: %+v", posted, more[0])
	}
	a.qp.Mu.Lock()
	early := a.qp.ranEarly
	a.qp.Mu.Unlock()
	if closeAt < 0 && early == 0 {
		t.Fatal("no Read ran early: the test did not exercise what it is for")
	}
	t.Logf("%d of %d Reads ran early", early, len(reads))
	a.qp.Close()
	<-recvDone
}
