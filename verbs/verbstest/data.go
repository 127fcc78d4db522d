package verbstest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

const (
	local  = verbs.AccessLocalWrite
	remote = verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
)

// testWrite writes pieces of different sizes and alignments into a peer
// region and checks the target holds exactly those bytes afterwards.
func testWrite(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	const size = 1 << 20
	src := p.region(p.a, size, local)
	dst := p.region(p.b, size, remote)
	fill(src.Bytes(), 1)
	fill(dst.Bytes(), 2)
	want := append([]byte(nil), dst.Bytes()...)
	pieces := []struct{ off, roff, n int }{
		{0, 0, 1},
		{1, 8, 1000},
		{5000, 4096, 65536},
		{7, size / 2, size / 2},
	}
	var wrs []verbs.SendRequest
	for i, pc := range pieces {
		wrs = append(wrs, write(uint64(i+1), src, pc.off, pc.n, dst, pc.roff))
		copy(want[pc.roff:pc.roff+pc.n], src.Bytes()[pc.off:pc.off+pc.n])
	}
	p.postSend(p.a, wrs...)
	cs := p.wait(p.a.scq, len(pieces), "write completions")
	p.expectOK(cs, verbs.OpWrite, "write")
	got := p.byID(cs, "write")
	for i, pc := range pieces {
		if c, ok := got[uint64(i+1)]; !ok || c.Len != pc.n {
			p.t.Fatalf("%s: write %d: completion %v, want Len %d", env.Name, i+1, describe([]verbs.Completion{c}), pc.n)
		}
	}
	checkBytes(t, "target region after the writes", dst.Bytes(), want)
	p.expectQuiet(p.b.rcq, 20*time.Millisecond, "plain writes must not consume receives")
}

// testWriteImmOrdering posts rounds of many Writes, each round closed by a
// WriteImm, and checks that when a round's RecvImm completes at the target
// every Write of that round is already in place.
func testWriteImmOrdering(t *testing.T, env Env) {
	const (
		rounds   = 8
		perRound = 32 // the last chunk of each round is the WriteImm's
		chunk    = 16 << 10
		size     = rounds * perRound * chunk
		immBase  = 0xabc00000
	)
	p := newPair(t, env, options{qp: verbs.QueuePairConfig{MaxSend: rounds * perRound}})
	defer p.close()
	src := p.region(p.a, size, local)
	dst := p.region(p.b, size, remote)
	rbuf := p.region(p.b, 64, local)
	fill(src.Bytes(), 3)
	for r := range rounds {
		p.postRecv(p.b, recv(uint64(100+r), rbuf, 0, 64))
	}
	var wrs []verbs.SendRequest
	for r := range rounds {
		for i := range perRound {
			off := (r*perRound + i) * chunk
			wr := write(uint64(off/chunk), src, off, chunk, dst, off)
			if i == perRound-1 {
				wr.Op, wr.Imm = verbs.OpWriteImm, uint32(immBase+r)
			}
			wrs = append(wrs, wr)
		}
	}
	p.postSend(p.a, wrs...)
	for r := range rounds {
		cs := p.wait(p.b.rcq, 1, fmt.Sprintf("receive of round %d", r))
		c := cs[0]
		p.expectOK(cs, verbs.OpRecvImm, "receive of a WriteImm")
		if c.ID != uint64(100+r) || !c.HasImm || c.Imm != uint32(immBase+r) || c.Len != chunk {
			t.Fatalf("%s: round %d: receive completion %v, want id %d imm %#x len %d", env.Name, r, describe(cs), 100+r, immBase+r, chunk)
		}
		lo, hi := r*perRound*chunk, (r+1)*perRound*chunk
		checkBytes(t, fmt.Sprintf("round %d at its RecvImm", r), dst.Bytes()[lo:hi], src.Bytes()[lo:hi])
	}
	cs := p.wait(p.a.scq, len(wrs), "write completions")
	for _, c := range cs {
		op := verbs.OpWrite
		if c.ID%perRound == perRound-1 {
			op = verbs.OpWriteImm
		}
		p.expectOK([]verbs.Completion{c}, op, "write or write-with-immediate")
	}
	p.byID(cs, "writes")
}

// testRead reads pieces of a peer region into a local one.
func testRead(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	const size = 1 << 20
	dst := p.region(p.a, size, local)
	src := p.region(p.b, size, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	fill(src.Bytes(), 4)
	fill(dst.Bytes(), 5)
	want := append([]byte(nil), dst.Bytes()...)
	pieces := []struct{ off, roff, n int }{
		{0, 0, 1},
		{8, 3, 777},
		{4096, 65536, 65536},
		{size / 2, 1, size / 2},
	}
	var wrs []verbs.SendRequest
	for i, pc := range pieces {
		wrs = append(wrs, read(uint64(i+1), dst, pc.off, pc.n, src, pc.roff))
		copy(want[pc.off:pc.off+pc.n], src.Bytes()[pc.roff:pc.roff+pc.n])
	}
	p.postSend(p.a, wrs...)
	cs := p.wait(p.a.scq, len(pieces), "read completions")
	p.expectOK(cs, verbs.OpRead, "read")
	got := p.byID(cs, "read")
	for i, pc := range pieces {
		if c := got[uint64(i+1)]; c.Len != pc.n {
			t.Fatalf("%s: read %d: completion %v, want Len %d", env.Name, i+1, describe([]verbs.Completion{c}), pc.n)
		}
	}
	checkBytes(t, "local region after the reads", dst.Bytes(), want)
}

// testSendRecv sends messages of several sizes and checks they land in the
// receives in posting order.
func testSendRecv(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	sizes := []int{1, 100, 4096, 3000, 65536}
	const slot = 65536
	src := p.region(p.a, len(sizes)*slot, local)
	dst := p.region(p.b, len(sizes)*slot, local)
	fill(src.Bytes(), 6)
	for i := range sizes {
		p.postRecv(p.b, recv(uint64(10+i), dst, i*slot, slot))
	}
	for i, n := range sizes {
		p.postSend(p.a, send(uint64(1+i), src, i*slot, n))
	}
	rcs := p.wait(p.b.rcq, len(sizes), "receive completions")
	p.expectOK(rcs, verbs.OpRecv, "receive")
	for i, c := range rcs {
		if c.ID != uint64(10+i) || c.Len != sizes[i] || c.HasImm {
			t.Fatalf("%s: receive %d: completion %v, want id %d len %d without immediate (receives complete in order)", env.Name, i, describe([]verbs.Completion{c}), 10+i, sizes[i])
		}
		checkBytes(t, fmt.Sprintf("message %d", i), dst.Bytes()[i*slot:i*slot+sizes[i]], src.Bytes()[i*slot:i*slot+sizes[i]])
	}
	scs := p.wait(p.a.scq, len(sizes), "send completions")
	p.expectOK(scs, verbs.OpSend, "send")
	for i, c := range scs {
		if c.ID != uint64(1+i) || c.Len != sizes[i] {
			t.Fatalf("%s: send %d: completion %v, want id %d len %d (sends complete in order)", env.Name, i, describe([]verbs.Completion{c}), 1+i, sizes[i])
		}
	}
}

// testSendWithImm checks that a Send's immediate value reaches the receive.
func testSendWithImm(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, local)
	fill(src.Bytes(), 7)
	p.postRecv(p.b, recv(1, dst, 0, 64))
	wr := send(2, src, 0, 48)
	wr.Imm, wr.HasImm = 0xfeedf00d, true
	p.postSend(p.a, wr)
	cs := p.wait(p.b.rcq, 1, "receive completion")
	p.expectOK(cs, verbs.OpRecv, "receive")
	if c := cs[0]; c.ID != 1 || c.Len != 48 || !c.HasImm || c.Imm != 0xfeedf00d {
		t.Fatalf("%s: receive completion %v, want id 1 len 48 imm 0xfeedf00d", env.Name, describe(cs))
	}
	checkBytes(t, "message", dst.Bytes()[:48], src.Bytes()[:48])
	p.expectOK(p.wait(p.a.scq, 1, "send completion"), verbs.OpSend, "send")
}

// testRecvBeforeConnect posts a receive while the queue pair is still in
// RESET, which lets a protocol have receives ready before the peer can send.
func testRecvBeforeConnect(t *testing.T, env Env) {
	p := newPair(t, env, options{noConnect: true})
	defer p.close()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, local)
	fill(src.Bytes(), 8)
	p.postRecv(p.b, recv(1, dst, 0, 64))
	// No round trip: its Send would land in the receive posted above. The
	// Send below is the proof that the connection works.
	p.connectOnly()
	p.postSend(p.a, send(2, src, 0, 64))
	p.expectOK(p.wait(p.b.rcq, 1, "receive completion"), verbs.OpRecv, "receive posted before Connect")
	checkBytes(t, "message", dst.Bytes(), src.Bytes())
	p.expectOK(p.wait(p.a.scq, 1, "send completion"), verbs.OpSend, "send")
}

// testSharedCQ uses one completion queue per side for sends and receives.
func testSharedCQ(t *testing.T, env Env) {
	p := newPair(t, env, options{sharedCQ: true})
	defer p.close()
	src := p.region(p.a, 4096, local)
	dst := p.region(p.b, 4096, remote)
	fill(src.Bytes(), 9)
	p.postRecv(p.b, recv(1, dst, 0, 1024))
	p.postRecv(p.a, recv(9, src, 3072, 1024))
	p.postSend(p.a, write(2, src, 0, 1024, dst, 2048), send(3, src, 1024, 512))
	bcs := p.wait(p.b.rcq, 1, "receive completion")
	p.expectOK(bcs, verbs.OpRecv, "receive")
	acs := p.wait(p.a.scq, 2, "send completions")
	if acs[0].ID != 2 || acs[0].Op != verbs.OpWrite || acs[1].ID != 3 || acs[1].Op != verbs.OpSend {
		t.Fatalf("%s: completions on the shared queue %v, want write 2 then send 3", env.Name, describe(acs))
	}
	p.expectOK(acs[:1], verbs.OpWrite, "write")
	p.expectOK(acs[1:], verbs.OpSend, "send")
	checkBytes(t, "written bytes", dst.Bytes()[2048:3072], src.Bytes()[:1024])
	checkBytes(t, "sent bytes", dst.Bytes()[:512], src.Bytes()[1024:1536])
}

// testZeroLength posts a zero-length operation of every kind.
func testZeroLength(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	src := p.region(p.a, 64, local)
	dst := p.region(p.b, 64, remote)
	fill(dst.Bytes(), 10)
	before := append([]byte(nil), dst.Bytes()...)
	p.postRecv(p.b, recv(11, dst, 0, 64), recv(12, dst, 0, 64))
	wi := write(3, src, 0, 0, dst, 0)
	wi.Op, wi.Imm = verbs.OpWriteImm, 42
	p.postSend(p.a, write(1, src, 0, 0, dst, 0), read(2, src, 0, 0, dst, 0), wi, send(4, src, 0, 0))
	acs := p.wait(p.a.scq, 4, "completions of zero-length requests")
	ops := []verbs.Opcode{verbs.OpWrite, verbs.OpRead, verbs.OpWriteImm, verbs.OpSend}
	for i, c := range acs {
		p.expectOK([]verbs.Completion{c}, ops[i], "zero-length request")
		if c.ID != uint64(i+1) || c.Len != 0 {
			t.Fatalf("%s: completion %v, want id %d with Len 0", env.Name, describe([]verbs.Completion{c}), i+1)
		}
	}
	bcs := p.wait(p.b.rcq, 2, "receive completions")
	if c := bcs[0]; c.ID != 11 || c.Op != verbs.OpRecvImm || c.Status != verbs.StatusSuccess || !c.HasImm || c.Imm != 42 || c.Len != 0 {
		t.Fatalf("%s: first receive %v, want id 11 RecvImm imm 42 len 0", env.Name, describe(bcs))
	}
	if c := bcs[1]; c.ID != 12 || c.Op != verbs.OpRecv || c.Status != verbs.StatusSuccess || c.Len != 0 {
		t.Fatalf("%s: second receive %v, want id 12 Recv len 0", env.Name, describe(bcs))
	}
	checkBytes(t, "target after zero-length requests", dst.Bytes(), before)
}

// testConcurrentPosts posts a full send queue (suiteMaxDepth) of small
// writes from several goroutines at once on one queue pair and counts the
// completions exactly.
func testConcurrentPosts(t *testing.T, env Env) {
	const (
		workers = 4
		each    = suiteMaxDepth / workers
		total   = workers * each
	)
	p := newPair(t, env, options{cqCapacity: 2 * total, qp: verbs.QueuePairConfig{MaxSend: total}})
	defer p.close()
	src := p.region(p.a, total*8, local)
	dst := p.region(p.b, total*8, remote)
	for i := range total {
		binary.LittleEndian.PutUint64(src.Bytes()[i*8:], uint64(i)<<8|0x5a)
	}
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			var err error
			defer func() { errs <- err }()
			for i := 0; i < each; {
				batch := min(1+(i+w)%8, each-i)
				wrs := make([]verbs.SendRequest, batch)
				for j := range wrs {
					k := w*each + i + j
					wrs[j] = write(uint64(k), src, k*8, 8, dst, k*8)
				}
				if err = p.a.qp.PostSend(wrs...); err != nil {
					err = fmt.Errorf("worker %d: PostSend at request %d: %w", w, i, err)
					return
				}
				i += batch
			}
		}()
	}
	cs := p.wait(p.a.scq, total, "completions of concurrent writes")
	for range workers {
		if err := <-errs; err != nil {
			t.Fatalf("%s: %v", env.Name, err)
		}
	}
	p.expectOK(cs, verbs.OpWrite, "concurrent write")
	got := p.byID(cs, "concurrent writes")
	for k := range total {
		if _, ok := got[uint64(k)]; !ok {
			t.Fatalf("%s: no completion for write %d", env.Name, k)
		}
	}
	checkBytes(t, "target after concurrent writes", dst.Bytes(), src.Bytes())
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "after all concurrent writes completed")
}

// testCreditLoop checks that a work request is outstanding until its
// completion is polled, as in InfiniBand: MaxSend requests can be posted
// without polling and the next fails with ErrQueueFull; the same holds for
// MaxRecv. Then several goroutines post through a small send queue, retrying
// on ErrQueueFull while the test polls.
func testCreditLoop(t *testing.T, env Env) {
	const (
		maxSend = 16
		maxRecv = 8
		workers = 4
		each    = 500
		total   = workers * each
	)
	p := newPair(t, env, options{cqCapacity: 256, qp: verbs.QueuePairConfig{MaxSend: maxSend, MaxRecv: maxRecv}})
	defer p.close()
	src := p.region(p.a, total*8, local)
	dst := p.region(p.b, total*8, remote)
	for i := range total {
		binary.LittleEndian.PutUint64(src.Bytes()[i*8:], uint64(i)<<8|0xa5)
	}

	for i := range maxRecv {
		p.postRecv(p.b, recv(uint64(i), dst, 0, 8))
	}
	if err := p.b.qp.PostRecv(recv(maxRecv, dst, 0, 8)); !errors.Is(err, verbs.ErrQueueFull) {
		t.Fatalf("%s: PostRecv beyond MaxRecv %d: got %v, want ErrQueueFull", env.Name, maxRecv, err)
	}
	for i := range maxSend {
		p.postSend(p.a, write(uint64(1000+i), src, 0, 8, dst, 0))
	}
	// The writes may all have completed; none has been polled yet.
	time.Sleep(10 * time.Millisecond)
	if err := p.a.qp.PostSend(write(9999, src, 0, 8, dst, 0)); !errors.Is(err, verbs.ErrQueueFull) {
		t.Fatalf("%s: PostSend beyond MaxSend %d with no completion polled: got %v, want ErrQueueFull", env.Name, maxSend, err)
	}
	p.expectOK(p.wait(p.a.scq, maxSend, "completions of the first writes"), verbs.OpWrite, "write")

	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				k := w*each + i
				for {
					err := p.a.qp.PostSend(write(uint64(k), src, k*8, 8, dst, k*8))
					if err == nil {
						break
					}
					if !errors.Is(err, verbs.ErrQueueFull) || ctx.Err() != nil {
						errs <- fmt.Errorf("worker %d: PostSend of write %d: %w", w, k, err)
						return
					}
					time.Sleep(20 * time.Microsecond)
				}
			}
		})
	}
	cs, err := collect(ctx, p.a.scq, total)
	cancel()
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Errorf("%s: %v", env.Name, e)
	}
	if err != nil {
		t.Fatalf("%s: %v (got %v)", env.Name, err, describe(cs))
	}
	p.expectOK(cs, verbs.OpWrite, "write through the credit loop")
	if got := p.byID(cs, "writes through the credit loop"); len(got) != total {
		t.Fatalf("%s: %d distinct completions, want %d", env.Name, len(got), total)
	}
	checkBytes(t, "target after the credit loop", dst.Bytes(), src.Bytes())
}

// testTwoQueuePairs connects two queue pairs between the same two domains at
// the same time and checks that their traffic stays apart.
func testTwoQueuePairs(t *testing.T, env Env) {
	p := newPair(t, env, options{noConnect: true})
	defer p.close()
	var extra []*side
	defer func() {
		for _, s := range extra {
			p.checkClose("queue pair", s.name, s.qp.Close())
			p.checkClose("completion queue", s.name, s.scq.Close())
		}
	}()
	for _, s := range []*side{p.a, p.b} {
		cq, err := s.pd.NewCompletionQueue(4096)
		if err != nil {
			t.Fatalf("%s: side %s: NewCompletionQueue: %v", env.Name, s.name, err)
		}
		qp, err := s.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq})
		if err != nil {
			cq.Close()
			t.Fatalf("%s: side %s: NewQueuePair: %v", env.Name, s.name, err)
		}
		extra = append(extra, &side{name: s.name + "2", pd: s.pd, scq: cq, rcq: cq, qp: qp})
	}
	a2, b2 := extra[0], extra[1]
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Connect(ctx, a2.qp, b2.qp) }()
	err1 := Connect(ctx, p.a.qp, p.b.qp)
	if err2 := <-done; err1 != nil || err2 != nil {
		t.Fatalf("%s: connecting two queue pairs at once: %v", env.Name, errors.Join(err1, err2))
	}
	p.verify(p.a, p.b)
	p.verify(a2, b2)
	src := p.region(p.a, 128, local)
	dst := p.region(p.b, 128, local)
	fill(src.Bytes(), 11)
	p.postRecv(p.b, recv(1, dst, 0, 64))
	p.postRecv(b2, recv(2, dst, 64, 64))
	p.postSend(a2, send(20, src, 64, 64))
	p.postSend(p.a, send(10, src, 0, 64))
	if c := p.wait(b2.rcq, 1, "receive on the second pair"); c[0].ID != 2 || c[0].Status != verbs.StatusSuccess {
		t.Fatalf("%s: second pair received %v, want receive 2", env.Name, describe(c))
	}
	if c := p.wait(p.b.rcq, 1, "receive on the first pair"); c[0].ID != 1 || c[0].Status != verbs.StatusSuccess {
		t.Fatalf("%s: first pair received %v, want receive 1", env.Name, describe(c))
	}
	checkBytes(t, "messages", dst.Bytes(), src.Bytes())
	p.expectOK(p.wait(p.a.scq, 1, "send on the first pair"), verbs.OpSend, "send")
	p.expectOK(p.wait(a2.scq, 1, "send on the second pair"), verbs.OpSend, "send")
}
