package verbstest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// testQPStates walks a queue pair through RESET, RTS and ERR and checks what
// posting does in each.
func testQPStates(t *testing.T, env Env) {
	p := newPair(t, env, options{noConnect: true})
	defer p.close()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, remote)
	for _, s := range []*side{p.a, p.b} {
		if st := s.qp.State(); st != verbs.QPReset {
			t.Fatalf("%s: side %s: new queue pair is in %v, want %v", env.Name, s.name, st, verbs.QPReset)
		}
	}
	if err := p.a.qp.PostSend(write(1, src, 0, 8, dst, 0)); !errors.Is(err, verbs.ErrNotConnected) {
		t.Fatalf("%s: PostSend before Connect: got %v, want ErrNotConnected", env.Name, err)
	}
	p.connect()
	for _, s := range []*side{p.a, p.b} {
		if st := s.qp.State(); st != verbs.QPReadyToSend {
			t.Fatalf("%s: side %s: connected queue pair is in %v, want %v", env.Name, s.name, st, verbs.QPReadyToSend)
		}
	}
	p.postSend(p.a, write(2, src, 0, 8, dst, 0))
	p.expectOK(p.wait(p.a.scq, 1, "write in RTS"), verbs.OpWrite, "write")

	bad := write(3, src, 0, 8, dst, 0)
	bad.Remote.Key ^= 0x5ec7e7
	p.postSend(p.a, bad)
	if c := p.wait(p.a.scq, 1, "write with a bad key")[0]; c.Status != verbs.StatusRemoteAccess {
		t.Fatalf("%s: write with a bad key: %v, want %v", env.Name, describe([]verbs.Completion{c}), verbs.StatusRemoteAccess)
	}
	if st := p.a.qp.State(); st != verbs.QPError {
		t.Fatalf("%s: after a fatal completion the queue pair is in %v, want %v", env.Name, st, verbs.QPError)
	}

	// The peer went to ERR as well.
	p.waitState(p.b, verbs.QPError)

	// In the error state posts fail with ErrQPError and post nothing.
	p.expectErr(p.a.qp.PostSend(write(4, src, 0, 8, dst, 0)), verbs.ErrQPError, "PostSend in ERR")
	p.expectErr(p.a.qp.PostRecv(recv(5, src, 0, 8)), verbs.ErrQPError, "PostRecv in ERR")
	p.expectErr(p.b.qp.PostSend(send(6, dst, 0, 8)), verbs.ErrQPError, "the peer's PostSend in ERR")
	p.expectErr(p.b.qp.PostRecv(recv(7, dst, 0, 8)), verbs.ErrQPError, "the peer's PostRecv in ERR")
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "after the error state")
	p.expectQuiet(p.a.rcq, 20*time.Millisecond, "after the error state")
	p.expectQuiet(p.b.rcq, 20*time.Millisecond, "after the error state")
	if st := p.a.qp.State(); st != verbs.QPError {
		t.Fatalf("%s: queue pair in %v after refused posts in ERR, want %v", env.Name, st, verbs.QPError)
	}
}

// testInvalidInfo passes malformed connection information to Connect, which
// must fail with ErrInvalidInfo at once and leave the queue pair usable.
func testInvalidInfo(t *testing.T, env Env) {
	p := newPair(t, env, options{noConnect: true})
	defer p.close()
	info := p.b.qp.LocalInfo()
	if len(info) == 0 {
		t.Fatalf("%s: LocalInfo is empty", env.Name)
	}
	bad := [][]byte{nil, {}, {0xff}, {0, 0, 0}, info[:len(info)-1], info[:len(info)/2]}
	for _, b := range bad {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		err := p.a.qp.Connect(ctx, b)
		cancel()
		if !errors.Is(err, verbs.ErrInvalidInfo) {
			t.Fatalf("%s: Connect with %d bytes of bad info %x: got %v, want ErrInvalidInfo", env.Name, len(b), b, err)
		}
	}
	if st := p.a.qp.State(); st != verbs.QPReset {
		t.Fatalf("%s: after Connect with bad info the queue pair is in %v, want %v", env.Name, st, verbs.QPReset)
	}
	p.connect()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, local)
	p.postRecv(p.b, recv(1, dst, 0, 64))
	p.postSend(p.a, send(2, src, 0, 64))
	p.expectOK(p.wait(p.b.rcq, 1, "receive after a refused Connect"), verbs.OpRecv, "receive")
	p.expectOK(p.wait(p.a.scq, 1, "send after a refused Connect"), verbs.OpSend, "send")
}

// testCloseFlushes closes queue pairs that have work outstanding: every
// request completes exactly once.
func testCloseFlushes(t *testing.T, env Env) {
	t.Run("PostedReceives", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		dst := p.region(p.b, 64, local)
		const n = 8
		for i := range n {
			p.postRecv(p.b, recv(uint64(i), dst, 0, 64))
		}
		if err := p.b.qp.Close(); err != nil {
			t.Fatalf("%s: Close: %v", env.Name, err)
		}
		cs := p.wait(p.b.rcq, n, "flushed receives")
		for i, c := range cs {
			if c.ID != uint64(i) || c.Status != verbs.StatusFlushed {
				t.Fatalf("%s: receive completions %v, want ids 0..%d flushed, in order", env.Name, describe(cs), n-1)
			}
		}
		p.expectQuiet(p.b.rcq, 100*time.Millisecond, "after the flush")
	})

	t.Run("SendsWithoutReceives", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		src := p.region(p.a, 64, local)
		const n = 8
		for i := range n {
			p.postSend(p.a, send(uint64(i), src, 0, 64))
		}
		time.Sleep(20 * time.Millisecond)
		if err := p.a.qp.Close(); err != nil {
			t.Fatalf("%s: Close: %v", env.Name, err)
		}
		cs := p.wait(p.a.scq, n, "flushed sends")
		for i, c := range cs {
			if c.ID != uint64(i) || c.Status != verbs.StatusFlushed {
				t.Fatalf("%s: send completions %v, want ids 0..%d flushed, in order", env.Name, describe(cs), n-1)
			}
		}
		p.expectQuiet(p.a.scq, 100*time.Millisecond, "after the flush")
	})

	t.Run("WritesInFlight", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		const size, n = 1 << 20, 16
		src := p.region(p.a, size, local)
		dst := p.region(p.b, size, remote)
		for i := range n {
			p.postSend(p.a, write(uint64(i), src, 0, size, dst, 0))
		}
		if err := p.a.qp.Close(); err != nil {
			t.Fatalf("%s: Close: %v", env.Name, err)
		}
		cs := p.wait(p.a.scq, n, "writes outstanding at Close")
		// Writes that completed before Close succeeded; every later one is
		// flushed. Where the boundary falls is a race; that there is one
		// boundary is not.
		flushed := false
		for i, c := range cs {
			flushed = flushed || c.Status != verbs.StatusSuccess
			want := verbs.StatusSuccess
			if flushed {
				want = verbs.StatusFlushed
			}
			if c.ID != uint64(i) || c.Status != want {
				t.Fatalf("%s: completions %v, want ids 0..%d in order: successes, then only flushed", env.Name, describe(cs), n-1)
			}
		}
		p.expectQuiet(p.a.scq, 100*time.Millisecond, "after the flush")
	})
}

// testPeerClose closes the target's queue pair, or its whole domain, while
// large writes to it are in flight. The survivor gets one completion per
// write, in order: successes (writes done before the close), then the first
// failure with StatusTransport (the peer is gone), then only flushed ones.
// Then its queue pair is in ERR and posts fail with ErrQPError.
func testPeerClose(t *testing.T, env Env) {
	for _, what := range []string{"QueuePair", "Domain"} {
		t.Run(what, func(t *testing.T) {
			defer leakcheck.Check(t)
			p := newPair(t, env, options{})
			defer p.close()
			const size, n = 4 << 20, 16
			src := p.region(p.a, size, local)
			dst := p.region(p.b, size, remote)
			for i := range n {
				p.postSend(p.a, write(uint64(i), src, 0, size, dst, 0))
			}
			var err error
			if what == "QueuePair" {
				err = p.b.qp.Close()
			} else {
				err = p.b.pd.Close()
			}
			if err != nil {
				t.Fatalf("%s: closing the peer's %s: %v", env.Name, what, err)
			}
			cs := p.wait(p.a.scq, n, "writes in flight when the peer closed")
			failed := -1
			for i, c := range cs {
				want := verbs.StatusSuccess
				switch {
				case failed < 0 && c.Status != verbs.StatusSuccess:
					failed = i
					want = verbs.StatusTransport
				case failed >= 0:
					want = verbs.StatusFlushed
				}
				if c.ID != uint64(i) || c.Status != want {
					t.Fatalf("%s: completions %v, want ids 0..%d in order: successes, then one transport error, then only flushed", env.Name, describe(cs), n-1)
				}
			}
			if failed < 0 {
				// Every write finished before the close took effect; the
				// next request is the one that finds the peer gone. Until
				// the local queue pair has noticed, a post is accepted and
				// fails with StatusTransport; once it has, posts fail with
				// ErrQPError. Which one applies is a race the suite cannot
				// control, so both are accepted here (and only here).
				t.Logf("%s: all %d writes completed before the peer's close", env.Name, n)
				err := p.a.qp.PostSend(write(n, src, 0, 64, dst, 0))
				if err == nil {
					c := p.wait(p.a.scq, 1, "write posted after the peer closed")[0]
					if c.ID != n || c.Status != verbs.StatusTransport {
						t.Fatalf("%s: write posted after the peer closed: %v, want a transport error", env.Name, describe([]verbs.Completion{c}))
					}
				} else if !errors.Is(err, verbs.ErrQPError) {
					t.Fatalf("%s: PostSend after the peer closed: got %v, want ErrQPError or a transport error completion", env.Name, err)
				}
			}
			p.waitState(p.a, verbs.QPError)
			p.expectErr(p.a.qp.PostSend(write(n+1, src, 0, 64, dst, 0)), verbs.ErrQPError, "PostSend after the peer closed")
			p.expectQuiet(p.a.scq, 20*time.Millisecond, "after the peer closed")
		})
	}
}

// testCQWait checks that Wait honours its context and Close.
func testCQWait(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	out := make([]verbs.Completion, 4)
	if n := p.a.scq.Poll(out); n != 0 {
		t.Fatalf("%s: Poll on an empty queue moved %d completions", env.Name, n)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	start := time.Now()
	n, err := p.a.scq.Wait(ctx, out)
	cancel()
	if n != 0 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%s: Wait with a 50ms deadline on an empty queue: %d, %v; want 0, context.DeadlineExceeded", env.Name, n, err)
	}
	if d := time.Since(start); d > waitTimeout/2 {
		t.Fatalf("%s: Wait with a 50ms deadline returned after %v", env.Name, d)
	}

	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	if n, err := p.a.scq.Wait(ctx, out); n != 0 || !errors.Is(err, context.Canceled) {
		t.Fatalf("%s: Wait with a canceled context: %d, %v; want 0, context.Canceled", env.Name, n, err)
	}

	// A blocked Wait wakes when a completion arrives.
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, local)
	p.postRecv(p.b, recv(1, dst, 0, 64))
	type result struct {
		n   int
		err error
		c   verbs.Completion
	}
	woke := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		buf := make([]verbs.Completion, 4)
		n, err := p.b.rcq.Wait(ctx, buf)
		woke <- result{n, err, buf[0]}
	}()
	time.Sleep(10 * time.Millisecond)
	p.postSend(p.a, send(2, src, 0, 64))
	if r := <-woke; r.n != 1 || r.err != nil || r.c.ID != 1 || r.c.Status != verbs.StatusSuccess {
		t.Fatalf("%s: blocked Wait woke with %d, %v, %v; want the receive", env.Name, r.n, r.err, describe([]verbs.Completion{r.c}))
	}
	p.wait(p.a.scq, 1, "send completion")

	// A blocked Wait is canceled by its context.
	ctx, cancel = context.WithCancel(context.Background())
	canceled := make(chan error, 1)
	go func() {
		_, err := p.a.scq.Wait(ctx, out[:1])
		canceled <- err
	}()
	time.Sleep(10 * time.Millisecond)
	cancel()
	select {
	case err := <-canceled:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("%s: blocked Wait after cancel: %v, want context.Canceled", env.Name, err)
		}
	case <-time.After(waitTimeout):
		t.Fatalf("%s: blocked Wait did not return after its context was canceled", env.Name)
	}

	// Close wakes a blocked Wait with ErrClosed.
	cq, err := p.a.pd.NewCompletionQueue(16)
	if err != nil {
		t.Fatalf("%s: NewCompletionQueue: %v", env.Name, err)
	}
	closed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		_, err := cq.Wait(ctx, make([]verbs.Completion, 1))
		closed <- err
	}()
	time.Sleep(10 * time.Millisecond)
	if err := cq.Close(); err != nil {
		t.Fatalf("%s: closing a completion queue: %v", env.Name, err)
	}
	if err := <-closed; !errors.Is(err, verbs.ErrClosed) {
		t.Fatalf("%s: Wait blocked when its queue closed: %v, want ErrClosed", env.Name, err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if _, err := cq.Wait(ctx, out); !errors.Is(err, verbs.ErrClosed) {
		t.Fatalf("%s: Wait on a closed queue: %v, want ErrClosed", env.Name, err)
	}
	if err := cq.Close(); err != nil {
		t.Fatalf("%s: second Close of a completion queue: %v, want nil", env.Name, err)
	}
	if n := cq.Poll(out); n != 0 {
		t.Fatalf("%s: Poll on a closed, empty completion queue moved %d completions", env.Name, n)
	}
}
