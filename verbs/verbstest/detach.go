package verbstest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// testDetach checks, for a provider whose completion queues run their
// handler in the provider's receiver and can detach a delivery
// (verbs.CompletionRunner, verbs.Detacher), that a handler which waits
// for the peer's next message does not wait forever: it gets a token in
// the receiver's delivery, Detach from another goroutine makes the
// provider receive on without it, and the next message's completion
// reaches the handler, in another goroutine, while the first still
// waits. Closing afterwards leaves no goroutine behind (the suite's leak
// check).
func testDetach(t *testing.T, env Env) {
	p := newPair(t, env, options{sharedCQ: true})
	defer p.close()
	run, isRunner := p.b.rcq.(verbs.CompletionRunner)
	det, isDetacher := p.b.rcq.(verbs.Detacher)
	switch {
	case !isRunner && isDetacher:
		t.Fatalf("%s: a verbs.Detacher that is not a verbs.CompletionRunner: no handler runs in its deliveries", env.Name)
	case !isRunner:
		// Polled with Wait (ibv's): whoever polls hands its own role
		// over (the engine's waitPoller); nothing of the provider's.
		return
	case !isDetacher:
		t.Fatalf("%s: a verbs.CompletionRunner that is not a verbs.Detacher: a handler that waits in its receiver holds the queue pair up", env.Name)
	}
	// A completion the receiver queued may still be handed over by Run's
	// goroutine (no token): as Run starts, or when it came while Run's
	// goroutine was still in the handler (which takes what is queued
	// before it waits again). Each such one has another goroutine send
	// the next message once the handler has returned, a little later each
	// time, up to tries. (Sent from the handler, every message of a
	// receiver quicker than the handler's return came that way: seen in
	// CI on shm.)
	const tries = 8
	src := p.region(p.a, (tries+1)*64, local)
	dst := p.region(p.b, (tries+1)*64, local)
	for i := range tries + 1 {
		p.postRecv(p.b, recv(uint64(1+i), dst, i*64, 64))
	}
	sent := 1
	next := make(chan verbs.Completion, 1)
	result := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	detached := false
	retry := make(chan int, 1)
	posted := make(chan struct{})
	defer func() { cancel(); <-posted }() // before p.close, on every way out
	go func() {
		defer close(posted)
		for {
			select {
			case i := <-retry:
				time.Sleep(time.Millisecond << i)
				p.postSend(p.a, send(uint64(10+i), src, i*64, 64))
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		ran <- run.Run(ctx, func(cs []verbs.Completion) {
			for _, c := range cs {
				if detached {
					next <- c
					continue
				}
				tok := det.DeliveryToken()
				if tok == 0 {
					if sent == tries {
						result <- fmt.Errorf("none of %d Recv completions was delivered with a token", tries)
						return
					}
					retry <- sent
					sent++
					continue
				}
				detached = true
				go func() {
					if !det.Detach(tok) {
						result <- errors.New("Detach of the delivery under way failed")
					}
				}()
				// Wait for the next message: only a receiver that moved on
				// can bring it.
				p.postSend(p.a, send(uint64(10+sent), src, sent*64, 64))
				sent++
				select {
				case c2 := <-next:
					if c2.ID != c.ID+1 || c2.Status != verbs.StatusSuccess {
						result <- fmt.Errorf("the completion after Recv %d is %v", c.ID, describe([]verbs.Completion{c2}))
						return
					}
					result <- nil
				case <-time.After(waitTimeout):
					result <- errors.New("the next message's completion never came while the handler waited: the delivery was not detached")
				}
			}
		})
	}()
	p.postSend(p.a, send(10, src, 0, 64))
	if err := <-result; err != nil {
		t.Fatalf("%s: %v", env.Name, err)
	}
	p.wait(p.a.scq, sent, "send completions")
	cancel()
	<-posted
	if err := <-ran; !errors.Is(err, context.Canceled) {
		t.Fatalf("%s: Run: %v", env.Name, err)
	}
}
