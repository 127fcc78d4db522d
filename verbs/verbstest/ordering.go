package verbstest

import (
	"fmt"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// testUnsignaled checks unsignaled requests: a successful one produces no
// completion, the signaled request after it does, and the unsignaled ones
// keep their place in the send queue (counting against MaxSend) until that
// later signaled request has completed and been polled.
func testUnsignaled(t *testing.T, env Env) {
	const maxSend = 4
	p := newPair(t, env, options{qp: verbs.QueuePairConfig{MaxSend: maxSend}})
	defer p.close()
	const chunk = 4096
	src := p.region(p.a, 3*maxSend*chunk, local)
	dst := p.region(p.b, 3*maxSend*chunk, remote)
	fill(src.Bytes(), 20)
	round := func(r int, signalLast bool) []verbs.SendRequest {
		wrs := make([]verbs.SendRequest, maxSend)
		for i := range wrs {
			k := r*maxSend + i
			wrs[i] = write(uint64(k), src, k*chunk, chunk, dst, k*chunk)
			wrs[i].Unsignaled = !(signalLast && i == maxSend-1)
		}
		return wrs
	}

	// Round 0: three unsignaled Writes and a signaled one fill the queue.
	p.postSend(p.a, round(0, true)...)
	time.Sleep(10 * time.Millisecond)
	p.expectErr(p.a.qp.PostSend(write(100, src, 0, 8, dst, 0)), verbs.ErrQueueFull,
		fmt.Sprintf("PostSend with %d requests outstanding (3 unsignaled), the signaled one not polled", maxSend))
	cs := p.wait(p.a.scq, 1, "completion of the signaled write")
	p.expectOK(cs, verbs.OpWrite, "signaled write after unsignaled ones")
	if cs[0].ID != maxSend-1 || cs[0].Len != chunk {
		t.Fatalf("%s: completion %v, want only the signaled write %d", env.Name, describe(cs), maxSend-1)
	}
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "successful unsignaled writes must not complete")
	checkBytes(t, "target after round 0", dst.Bytes()[:maxSend*chunk], src.Bytes()[:maxSend*chunk])

	// Polling the signaled completion freed all four places.
	p.postSend(p.a, round(1, true)...)
	cs = p.wait(p.a.scq, 1, "completion of the second signaled write")
	p.expectOK(cs, verbs.OpWrite, "signaled write")
	if cs[0].ID != 2*maxSend-1 {
		t.Fatalf("%s: completion %v, want only the signaled write %d", env.Name, describe(cs), 2*maxSend-1)
	}
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "successful unsignaled writes must not complete")
	checkBytes(t, "target after round 1", dst.Bytes()[:2*maxSend*chunk], src.Bytes()[:2*maxSend*chunk])

	// Only unsignaled requests: they succeed, but their places are never
	// freed, so the queue stays full.
	p.postSend(p.a, round(2, false)...)
	time.Sleep(20 * time.Millisecond)
	p.expectErr(p.a.qp.PostSend(write(101, src, 0, 8, dst, 0)), verbs.ErrQueueFull,
		fmt.Sprintf("PostSend after %d unsignaled requests and no signaled one", maxSend))
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "successful unsignaled writes must not complete")
	checkBytes(t, "target after the unsignaled round", dst.Bytes(), src.Bytes())
}

// testUnsignaledFailure posts an unsignaled Write that succeeds, an
// unsignaled Write with a bad remote key, another unsignaled Write and a
// signaled one. The failing request completes with StatusRemoteAccess and
// its ID, the two after it are flushed (the unsignaled one too) and touch
// nothing, and the successful unsignaled one before it stays silent.
func testUnsignaledFailure(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	const chunk = 1024
	src := p.region(p.a, 4*chunk, local)
	dst := p.region(p.b, 4*chunk, remote)
	fill(src.Bytes(), 21)
	fill(dst.Bytes(), 22)
	want := append([]byte(nil), dst.Bytes()...)
	copy(want[:chunk], src.Bytes()[:chunk])
	wrs := make([]verbs.SendRequest, 4)
	for i := range wrs {
		wrs[i] = write(uint64(i+1), src, i*chunk, chunk, dst, i*chunk)
		wrs[i].Unsignaled = i < 3
	}
	wrs[1].Remote.Key ^= 0x5ec7e7
	p.postSend(p.a, wrs...)
	cs := p.wait(p.a.scq, 3, "completions after a failing unsignaled write")
	if c := cs[0]; c.ID != 2 || c.Status != verbs.StatusRemoteAccess {
		t.Fatalf("%s: completions %v, want the unsignaled write 2 with %v first", env.Name, describe(cs), verbs.StatusRemoteAccess)
	}
	for i, c := range cs[1:] {
		if c.ID != uint64(3+i) || c.Status != verbs.StatusFlushed {
			t.Fatalf("%s: completions %v, want writes 3 (unsignaled) and 4 flushed after the failure", env.Name, describe(cs))
		}
	}
	p.expectQuiet(p.a.scq, 50*time.Millisecond, "the successful unsignaled write 1 must not complete")
	checkBytes(t, "target: write 1 landed, nothing after it", dst.Bytes(), want)
	p.waitState(p.a, verbs.QPError)
	p.waitState(p.b, verbs.QPError)
}

// testFence posts a Read of remote bytes followed by a fenced Write that
// overwrites them: the Read returns the old bytes, the target ends up with
// the new ones. It repeats with several Reads before the fenced Write.
func testFence(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	const size = 256 << 10
	target := p.region(p.b, size, remote)
	readBuf := p.region(p.a, 4*size, local)
	newBytes := p.region(p.a, size, local)
	for round := range 8 {
		reads := 1 + round%4
		fill(target.Bytes(), uint64(30+round))
		old := append([]byte(nil), target.Bytes()...)
		fill(newBytes.Bytes(), uint64(50+round))
		clear(readBuf.Bytes())
		var wrs []verbs.SendRequest
		for i := range reads {
			wrs = append(wrs, read(uint64(i), readBuf, i*size, size, target, 0))
		}
		w := write(uint64(reads), newBytes, 0, size, target, 0)
		w.Fence = true
		wrs = append(wrs, w)
		p.postSend(p.a, wrs...)
		cs := p.wait(p.a.scq, reads+1, fmt.Sprintf("round %d: reads and the fenced write", round))
		for i, c := range cs {
			op := verbs.OpRead
			if i == reads {
				op = verbs.OpWrite
			}
			p.expectOK([]verbs.Completion{c}, op, "read or fenced write")
			if c.ID != uint64(i) || c.Len != size {
				t.Fatalf("%s: round %d: completions %v, want ids 0..%d in order, each of %d bytes", env.Name, round, describe(cs), reads, size)
			}
		}
		for i := range reads {
			checkBytes(t, fmt.Sprintf("round %d: read %d before the fenced write", round, i), readBuf.Bytes()[i*size:(i+1)*size], old)
		}
		checkBytes(t, fmt.Sprintf("round %d: target after the fenced write", round), target.Bytes(), newBytes.Bytes())
	}
}

// testOutstandingReads posts more Reads than MaxOutstandingReads at once:
// the later ones wait their turn, and all complete in order with the right
// bytes.
func testOutstandingReads(t *testing.T, env Env) {
	const maxN = 257
	p := newPair(t, env, options{qp: verbs.QueuePairConfig{MaxSend: maxN}})
	defer p.close()
	maxReads := p.attrs(p.a).MaxOutstandingReads
	n := min(4*max(maxReads, 1)+1, maxN)
	const chunk = 4099
	src := p.region(p.b, n*chunk, verbs.AccessRemoteRead)
	dst := p.region(p.a, n*chunk, local)
	fill(src.Bytes(), 23)
	wrs := make([]verbs.SendRequest, n)
	for i := range wrs {
		// Read chunk i of the source into chunk n-1-i of the destination.
		wrs[i] = read(uint64(i), dst, (n-1-i)*chunk, chunk, src, i*chunk)
	}
	p.postSend(p.a, wrs...)
	cs := p.wait(p.a.scq, n, fmt.Sprintf("%d reads (MaxOutstandingReads %d)", n, maxReads))
	p.expectOK(cs, verbs.OpRead, "read")
	for i, c := range cs {
		if c.ID != uint64(i) || c.Len != chunk {
			t.Fatalf("%s: completions %v, want ids 0..%d in order, each of %d bytes", env.Name, describe(cs), n-1, chunk)
		}
		checkBytes(t, fmt.Sprintf("read %d", i), dst.Bytes()[(n-1-i)*chunk:(n-i)*chunk], src.Bytes()[i*chunk:(i+1)*chunk])
	}
}
