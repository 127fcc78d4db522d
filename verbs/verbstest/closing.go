package verbstest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// testErrClosed checks that every call on a closed object fails with an
// error wrapping ErrClosed, and that closing twice returns nil: queue pairs,
// regions, grants, domains and (through the domain) its completion queues
// and queue pairs.
func testErrClosed(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, remote)
	granted := p.region(p.a, 64, local)
	g, err := p.a.qp.Grant(granted, 0, 64, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatalf("%s: Grant: %v", env.Name, err)
	}
	for i := range 2 {
		if err := p.a.qp.Close(); err != nil {
			t.Fatalf("%s: Close of a queue pair (call %d): %v, want nil", env.Name, i+1, err)
		}
	}
	p.expectQPErr(p.a.qp.PostSend(write(1, src, 0, 8, dst, 0)), verbs.ErrClosed, "PostSend after Close")
	p.expectQPErr(p.a.qp.PostRecv(recv(2, src, 0, 8)), verbs.ErrClosed, "PostRecv after Close")
	_, err = p.a.qp.Grant(granted, 0, 8, verbs.AccessRemoteWrite)
	p.expectQPErr(err, verbs.ErrClosed, "Grant after Close")
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	p.expectQPErr(p.a.qp.Connect(ctx, p.b.qp.LocalInfo()), verbs.ErrClosed, "Connect after Close")
	// The grant died with its queue pair; revoking it is still allowed.
	for i := range 2 {
		if err := g.Revoke(); err != nil {
			t.Fatalf("%s: Revoke of a grant of a closed queue pair (call %d): %v, want nil", env.Name, i+1, err)
		}
	}
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "refused posts must not complete")

	for i := range 2 {
		if err := src.Deregister(); err != nil {
			t.Fatalf("%s: Deregister (call %d): %v, want nil", env.Name, i+1, err)
		}
	}

	for i := range 2 {
		if err := p.a.pd.Close(); err != nil {
			t.Fatalf("%s: Close of a domain (call %d): %v, want nil", env.Name, i+1, err)
		}
	}
	_, err = p.a.pd.RegisterMemory(p.env.NewMemory(t, 64), local)
	p.expectErr(err, verbs.ErrClosed, "RegisterMemory on a closed domain")
	_, err = p.a.pd.NewCompletionQueue(16)
	p.expectErr(err, verbs.ErrClosed, "NewCompletionQueue on a closed domain")
	_, err = p.a.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: p.a.scq, RecvCQ: p.a.rcq})
	p.expectErr(err, verbs.ErrClosed, "NewQueuePair on a closed domain")
	// The domain closed its completion queues and regions; closing them
	// again returns nil (p.close closes the queues).
	_, err = p.a.scq.Wait(ctx, make([]verbs.Completion, 1))
	p.expectErr(err, verbs.ErrClosed, "Wait on a completion queue of a closed domain")
	if err := granted.Deregister(); err != nil {
		t.Fatalf("%s: Deregister of a region of a closed domain: %v, want nil", env.Name, err)
	}

	// b's domain: Close closes what is left (its queue pair, queues and
	// regions) and everything closes again with nil.
	bqp, brcq := p.b.qp, p.b.rcq
	if err := p.b.pd.Close(); err != nil {
		t.Fatalf("%s: Close of a domain with open objects: %v", env.Name, err)
	}
	// Connect, not a post: a post would name a region, which the domain
	// closed too, and the contract does not order the two refusals.
	p.expectErr(bqp.Connect(ctx, p.a.qp.LocalInfo()), verbs.ErrClosed, "Connect on a queue pair of a closed domain")
	if err := dst.Deregister(); err != nil {
		t.Fatalf("%s: Deregister of a region of a closed domain: %v, want nil", env.Name, err)
	}
	_, err = brcq.Wait(ctx, make([]verbs.Completion, 1))
	if !errors.Is(err, verbs.ErrClosed) {
		// The receive queue may hold flushed completions: drain them.
		for err == nil {
			_, err = brcq.Wait(ctx, make([]verbs.Completion, 16))
		}
		p.expectErr(err, verbs.ErrClosed, "Wait on a drained receive queue of a closed domain")
	}
	// p.close closes b's queue pair, queues and domain again.
}

// testCQReservation checks that NewQueuePair reserves MaxSend entries of
// its send queue and MaxRecv of its receive queue, refuses with
// ErrQueueFull when a queue has no room (reserving nothing), and that
// closing a queue pair returns its room.
func testCQReservation(t *testing.T, env Env) {
	p := newPair(t, env, options{noConnect: true})
	defer p.close()
	newCQ := func(n int) verbs.CompletionQueue {
		cq, err := p.a.pd.NewCompletionQueue(n)
		if err != nil {
			t.Fatalf("%s: NewCompletionQueue(%d): %v", env.Name, n, err)
		}
		p.extra = append(p.extra, &side{name: "a-cq", pd: p.a.pd, scq: cq, rcq: cq})
		return cq
	}
	newQP := func(scq, rcq verbs.CompletionQueue, maxSend, maxRecv int) (verbs.QueuePair, error) {
		qp, err := p.a.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: scq, RecvCQ: rcq, MaxSend: maxSend, MaxRecv: maxRecv})
		if err == nil {
			p.extra = append(p.extra, &side{name: "a-qp", pd: p.a.pd, qp: qp})
		}
		return qp, err
	}
	mustQP := func(scq, rcq verbs.CompletionQueue, maxSend, maxRecv int, what string) verbs.QueuePair {
		t.Helper()
		qp, err := newQP(scq, rcq, maxSend, maxRecv)
		if err != nil {
			t.Fatalf("%s: %s: NewQueuePair(MaxSend %d, MaxRecv %d): %v", env.Name, what, maxSend, maxRecv, err)
		}
		return qp
	}
	full := func(scq, rcq verbs.CompletionQueue, maxSend, maxRecv int, what string) {
		t.Helper()
		_, err := newQP(scq, rcq, maxSend, maxRecv)
		p.expectErr(err, verbs.ErrQueueFull, what)
	}

	// One queue for sends and receives.
	shared := newCQ(16)
	q1 := mustQP(shared, shared, 8, 8, "filling a shared queue of 16")
	full(shared, shared, 1, 1, "NewQueuePair on a full shared queue")
	full(shared, shared, 0, 0, "NewQueuePair with the default depths on a full shared queue")
	if err := q1.Close(); err != nil {
		t.Fatalf("%s: Close: %v", env.Name, err)
	}
	full(shared, shared, 10, 10, "NewQueuePair needing 20 entries of a queue of 16")
	// The refused queue pair reserved nothing, and q1 returned its room.
	q2 := mustQP(shared, shared, 8, 8, "a shared queue of 16 after its queue pair closed")
	if err := q2.Close(); err != nil {
		t.Fatalf("%s: Close: %v", env.Name, err)
	}

	// Separate queues: each is counted on its own.
	scq, rcq := newCQ(16), newCQ(16)
	q3 := mustQP(scq, rcq, 16, 1, "filling a send queue of 16")
	full(scq, rcq, 1, 1, "NewQueuePair whose send queue is full")
	mustQP(rcq, rcq, 14, 1, "filling the receive queue with another queue pair")
	if err := q3.Close(); err != nil {
		t.Fatalf("%s: Close: %v", env.Name, err)
	}
	// Now the send queue is empty and the receive queue has 1 entry left.
	full(scq, rcq, 1, 2, "NewQueuePair whose receive queue has too little room")
	mustQP(scq, rcq, 16, 1, "both queues after a queue pair closed")

	// A queue pair on a queue of exactly its size works to the full depth.
	cqA := newCQ(4)
	cqB, err := p.b.pd.NewCompletionQueue(4)
	if err != nil {
		t.Fatalf("%s: NewCompletionQueue(4): %v", env.Name, err)
	}
	p.extra = append(p.extra, &side{name: "b-cq", pd: p.b.pd, scq: cqB, rcq: cqB})
	qa := mustQP(cqA, cqA, 2, 2, "a queue pair on a queue of exactly its size")
	qb, err := p.b.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cqB, RecvCQ: cqB, MaxSend: 2, MaxRecv: 2})
	if err != nil {
		t.Fatalf("%s: side b: NewQueuePair on a queue of exactly its size: %v", env.Name, err)
	}
	sb := &side{name: "b-small", pd: p.b.pd, scq: cqB, rcq: cqB, qp: qb}
	p.extra = append(p.extra, sb)
	sa := &side{name: "a-small", pd: p.a.pd, scq: cqA, rcq: cqA, qp: qa}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := Connect(ctx, qa, qb); err != nil {
		t.Fatalf("%s: %v", env.Name, err)
	}
	p.verify(sa, sb)
	src := p.region(sa, 64, local)
	dst := p.region(sb, 64, local)
	p.postRecv(sb, recv(1, dst, 0, 32), recv(2, dst, 32, 32))
	p.postSend(sa, send(3, src, 0, 32), send(4, src, 32, 32))
	p.expectOK(p.wait(cqA, 2, "sends filling a queue of exactly their queue pair's size"), verbs.OpSend, "send")
	p.expectOK(p.wait(cqB, 2, "receives filling a queue of exactly their queue pair's size"), verbs.OpRecv, "receive")
}
