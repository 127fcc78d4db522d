package verbstest

import (
	"fmt"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// maxSegmentsTested bounds the segment count of the suite's
// MaxSegments-sized requests, so that a provider reporting an enormous
// MaxSegments does not make the suite build enormous requests.
const maxSegmentsTested = 1 << 16

// maxDepthTested bounds the depth of the MaxQueueDepth queue pair that
// testAttributes makes.
const maxDepthTested = 1 << 16

// maxMemoryTested bounds the memory the suite registers to build a request
// larger than MaxMessageBytes.
const maxMemoryTested = 128 << 20

// testAttributes checks that both domains report honest, usable
// attributes: at least 4 segments, a positive message size, at least one
// outstanding Read, a queue depth the suite (and the default depth) can
// use, and a grant kind. A queue pair of MaxQueueDepth can be made, and a
// Write and a Send of exactly MaxInline bytes work.
func testAttributes(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	closed := false
	defer func() {
		if !closed {
			p.close()
		}
	}()
	for _, s := range []*side{p.a, p.b} {
		a := p.attrs(s)
		t.Logf("%s: side %s: %+v (grants: %v)", env.Name, s.name, a, a.Grants)
		if a.MaxSegments < 4 {
			t.Errorf("%s: side %s: MaxSegments %d, want at least 4", env.Name, s.name, a.MaxSegments)
		}
		if a.MaxMessageBytes <= 0 {
			t.Errorf("%s: side %s: MaxMessageBytes %d, want > 0", env.Name, s.name, a.MaxMessageBytes)
		}
		if a.MaxOutstandingReads < 1 {
			t.Errorf("%s: side %s: MaxOutstandingReads %d, want at least 1", env.Name, s.name, a.MaxOutstandingReads)
		}
		if a.MaxQueueDepth < suiteMaxDepth {
			t.Errorf("%s: side %s: MaxQueueDepth %d, want at least %d (the default depth, and the suite's deepest queue)", env.Name, s.name, a.MaxQueueDepth, suiteMaxDepth)
		}
		if a.MaxInline < 0 {
			t.Errorf("%s: side %s: MaxInline %d, want >= 0", env.Name, s.name, a.MaxInline)
		}
		switch a.Grants {
		case verbs.GrantSoftware, verbs.GrantWindow, verbs.GrantRegistration:
		default:
			t.Errorf("%s: side %s: Grants is %v, want one of the GrantKinds", env.Name, s.name, a.Grants)
		}
		if a != p.attrs(s) {
			t.Errorf("%s: side %s: Attributes changed between two calls", env.Name, s.name)
		}
	}
	if t.Failed() {
		return
	}

	// A queue pair as deep as MaxQueueDepth can be made.
	if d := p.attrs(p.a).MaxQueueDepth; d <= maxDepthTested {
		cq, err := p.a.pd.NewCompletionQueue(2 * d)
		if err != nil {
			t.Fatalf("%s: NewCompletionQueue(%d): %v", env.Name, 2*d, err)
		}
		p.extra = append(p.extra, &side{name: "a-deep", pd: p.a.pd, scq: cq, rcq: cq})
		qp, err := p.a.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: d, MaxRecv: d})
		if err != nil {
			t.Fatalf("%s: NewQueuePair with MaxSend = MaxRecv = MaxQueueDepth %d: %v", env.Name, d, err)
		}
		p.extra[len(p.extra)-1].qp = qp
	} else {
		t.Logf("%s: MaxQueueDepth %d: not making a queue pair that deep", env.Name, d)
	}

	// A Write and a Send of exactly MaxInline bytes, on fresh pairs (the
	// leak checks of the subtests see every goroutine of the process).
	inline := min(p.attrs(p.a).MaxInline, p.attrs(p.b).MaxInline)
	closed = true
	p.close()
	if inline == 0 {
		t.Logf("%s: MaxInline is 0: no inline data to test", env.Name)
		return
	}
	for _, cfgInline := range []int{0, inline} {
		t.Run(fmt.Sprintf("InlineConfig%d", cfgInline), func(t *testing.T) {
			defer leakcheck.Check(t)
			p := newPair(t, env, options{qp: verbs.QueuePairConfig{MaxInline: cfgInline}})
			defer p.close()
			src := p.region(p.a, 2*inline, local)
			dst := p.region(p.b, 2*inline, remote)
			fill(src.Bytes(), 60)
			p.postRecv(p.b, recv(1, dst, inline, inline))
			p.postSend(p.a, write(2, src, 0, inline, dst, 0), send(3, src, inline, inline))
			cs := p.wait(p.a.scq, 2, "write and send of MaxInline bytes")
			if cs[0].ID != 2 || cs[0].Len != inline || cs[1].ID != 3 || cs[1].Len != inline {
				t.Fatalf("%s: completions %v, want write 2 then send 3 of %d bytes", env.Name, describe(cs), inline)
			}
			p.expectOK(cs[:1], verbs.OpWrite, "write of MaxInline bytes")
			p.expectOK(cs[1:], verbs.OpSend, "send of MaxInline bytes")
			rc := p.wait(p.b.rcq, 1, "receive of MaxInline bytes")
			p.expectOK(rc, verbs.OpRecv, "receive of MaxInline bytes")
			checkBytes(t, "MaxInline bytes written and sent", dst.Bytes(), src.Bytes())
		})
	}
}

// oddSizes returns n segment sizes, all odd, varied and small.
func oddSizes(n int) []int {
	sizes := make([]int, n)
	for i := range sizes {
		sizes[i] = (i*131+17)%509 | 1
	}
	return sizes
}

// layout places segments of the given sizes alternately in regions r0 and
// r1, each starting at an odd offset with a gap after it, and returns them.
// The regions must hold sum(sizes)+3*len(sizes) bytes each.
func layout(r0, r1 verbs.MemoryRegion, sizes []int) []verbs.Local {
	segs := make([]verbs.Local, len(sizes))
	off := [2]int{1, 3}
	for i, n := range sizes {
		r := r0
		if i%2 == 1 {
			r = r1
		}
		segs[i] = seg(r, off[i%2], n)
		off[i%2] += n + 3
	}
	return segs
}

// testScatterGather moves data with 4 segments of odd sizes, and with
// MaxSegments segments: a Write gathers them, a Send gathers them into a
// Recv that scatters them into other segments, and a Read scatters into
// them. Every byte lands exactly where it should and no other byte moves.
// A gather source needs no right (one of the source regions has none); a
// Read or Recv destination needs local write.
func testScatterGather(t *testing.T, env Env) {
	p := newPair(t, env, options{noConnect: true})
	maxSeg := min(p.attrs(p.a).MaxSegments, p.attrs(p.b).MaxSegments)
	p.close() // before the subtests' leak checks
	if maxSeg < 4 {
		t.Fatalf("%s: MaxSegments %d, want at least 4", env.Name, maxSeg)
	}
	counts := []int{4}
	if maxSeg > maxSegmentsTested {
		t.Logf("%s: MaxSegments %d: testing %d segments", env.Name, maxSeg, maxSegmentsTested)
		maxSeg = maxSegmentsTested
	}
	if maxSeg != 4 {
		counts = append(counts, maxSeg)
	}
	for _, n := range counts {
		t.Run(fmt.Sprintf("%dSegments", n), func(t *testing.T) {
			defer leakcheck.Check(t)
			sizes := []int{1, 7, 4093, 65537}
			if n != 4 {
				sizes = oddSizes(n)
			}
			total := 0
			for _, s := range sizes {
				total += s + 3
			}
			p := newPair(t, env, options{})
			defer p.close()
			// Sources: one region with local write, one with no right.
			s0 := p.region(p.a, total, local)
			s1 := p.region(p.a, total, 0)
			fill(s0.Bytes(), 61)
			fill(s1.Bytes(), 62)
			src := layout(s0, s1, sizes)
			payload := gather(src)
			// The peer's target (Write, Read source) and receive regions.
			target := p.guardedRegion(p.b, total+64, remote)
			r0 := p.region(p.b, total, local)
			r1 := p.region(p.b, total, local)
			fill(r0.Bytes(), 63)
			fill(r1.Bytes(), 64)
			rwant0 := append([]byte(nil), r0.Bytes()...)
			rwant1 := append([]byte(nil), r1.Bytes()...)
			// The Recv scatters into segments of other sizes: the reversed
			// sizes, so that segment boundaries differ from the Send's.
			rsizes := make([]int, len(sizes))
			for i, s := range sizes {
				rsizes[len(sizes)-1-i] = s
			}
			rsegs := layout(r0, r1, rsizes)
			at := 0
			for _, s := range rsegs {
				want := rwant0
				if s.Region == r1 {
					want = rwant1
				}
				copy(want[s.Offset:s.Offset+s.Length], payload[at:at+s.Length])
				at += s.Length
			}

			p.postRecv(p.b, verbs.RecvRequest{ID: 9, Segments: rsegs})
			w := verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Segments: src,
				Remote: verbs.Remote{Addr: target.mr.Addr() + 5, Key: target.mr.RemoteKey()}}
			sd := verbs.SendRequest{ID: 2, Op: verbs.OpSend, Segments: src}
			p.postSend(p.a, w, sd)
			cs := p.wait(p.a.scq, 2, "scatter-gather write and send")
			if cs[0].ID != 1 || cs[0].Len != len(payload) || cs[1].ID != 2 || cs[1].Len != len(payload) {
				t.Fatalf("%s: completions %v, want write 1 then send 2 of %d bytes", env.Name, describe(cs), len(payload))
			}
			p.expectOK(cs[:1], verbs.OpWrite, "gathering write")
			p.expectOK(cs[1:], verbs.OpSend, "gathering send")
			target.checkOnly(t, "target of the gathering write", 5, payload)
			rc := p.wait(p.b.rcq, 1, "scattering receive")
			p.expectOK(rc, verbs.OpRecv, "scattering receive")
			if rc[0].ID != 9 || rc[0].Len != len(payload) {
				t.Fatalf("%s: receive %v, want id 9 with %d bytes", env.Name, describe(rc), len(payload))
			}
			checkBytes(t, "first receive region after the scattering receive", r0.Bytes(), rwant0)
			checkBytes(t, "second receive region after the scattering receive", r1.Bytes(), rwant1)

			// A Read scatters the target's bytes back into segments laid
			// out like the sources, in two regions with local write.
			d0 := p.region(p.a, total, local)
			d1 := p.region(p.a, total, local)
			fill(d0.Bytes(), 65)
			fill(d1.Bytes(), 66)
			dsegs := layout(d0, d1, sizes)
			dwant0 := append([]byte(nil), d0.Bytes()...)
			dwant1 := append([]byte(nil), d1.Bytes()...)
			at = 0
			for _, s := range dsegs {
				want := dwant0
				if s.Region == d1 {
					want = dwant1
				}
				copy(want[s.Offset:s.Offset+s.Length], payload[at:at+s.Length])
				at += s.Length
			}
			r := verbs.SendRequest{ID: 3, Op: verbs.OpRead, Segments: dsegs,
				Remote: verbs.Remote{Addr: target.mr.Addr() + 5, Key: target.mr.RemoteKey()}}
			p.postSend(p.a, r)
			cs = p.wait(p.a.scq, 1, "scattering read")
			p.expectOK(cs, verbs.OpRead, "scattering read")
			if cs[0].ID != 3 || cs[0].Len != len(payload) {
				t.Fatalf("%s: read %v, want id 3 with %d bytes", env.Name, describe(cs), len(payload))
			}
			checkBytes(t, "first read region", d0.Bytes(), dwant0)
			checkBytes(t, "second read region", d1.Bytes(), dwant1)
			target.checkOnly(t, "target after the scattering read", 5, payload)
		})
	}
}

// testTooLarge posts requests beyond the device's attributes: more segments
// than MaxSegments, and (where the suite can build one without registering
// more than 128 MiB) segments whose total exceeds MaxMessageBytes. Each is
// refused at post time with ErrTooLarge, and nothing is posted.
func testTooLarge(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	at := p.attrs(p.a)
	dst := p.region(p.b, 4096, remote)
	if at.MaxSegments >= maxSegmentsTested {
		t.Logf("%s: MaxSegments %d: not building a request with more segments", env.Name, at.MaxSegments)
	} else {
		src := p.region(p.a, at.MaxSegments+1, local)
		segs := make([]verbs.Local, at.MaxSegments+1)
		for i := range segs {
			segs[i] = seg(src, i, 1)
		}
		for _, op := range []verbs.Opcode{verbs.OpWrite, verbs.OpWriteImm, verbs.OpSend, verbs.OpRead} {
			err := p.a.qp.PostSend(verbs.SendRequest{ID: 1, Op: op, Segments: segs,
				Remote: verbs.Remote{Addr: dst.Addr(), Key: dst.RemoteKey()}})
			p.expectErr(err, verbs.ErrTooLarge, fmt.Sprintf("%v with MaxSegments+1 = %d segments", op, len(segs)))
		}
		rsrc := p.region(p.b, at.MaxSegments+1, local)
		rsegs := make([]verbs.Local, at.MaxSegments+1)
		for i := range rsegs {
			rsegs[i] = seg(rsrc, i, 1)
		}
		p.expectErr(p.b.qp.PostRecv(verbs.RecvRequest{ID: 3, Segments: rsegs}), verbs.ErrTooLarge,
			fmt.Sprintf("Recv with MaxSegments+1 = %d segments", len(rsegs)))
	}

	// Total length over MaxMessageBytes: MaxSegments segments that all name
	// the same region, each of length MaxMessageBytes/MaxSegments + 1.
	nseg := min(at.MaxSegments, maxSegmentsTested)
	segLenB := at.MaxMessageBytes/int64(nseg) + 1
	if segLenB > maxMemoryTested {
		t.Logf("%s: MaxMessageBytes %d with %d segments needs a %d-byte region: not testing a request over MaxMessageBytes (the suite registers at most %d bytes)",
			env.Name, at.MaxMessageBytes, nseg, segLenB, maxMemoryTested)
	} else {
		big := p.region(p.a, int(segLenB), local)
		segs := make([]verbs.Local, nseg)
		for i := range segs {
			segs[i] = seg(big, 0, int(segLenB))
		}
		if int64(segLen(segs)) <= at.MaxMessageBytes {
			t.Fatalf("suite bug: %d bytes in %d segments is not over %d", segLen(segs), nseg, at.MaxMessageBytes)
		}
		for _, op := range []verbs.Opcode{verbs.OpWrite, verbs.OpSend} {
			err := p.a.qp.PostSend(verbs.SendRequest{ID: 4, Op: op, Segments: segs,
				Remote: verbs.Remote{Addr: dst.Addr(), Key: dst.RemoteKey()}})
			p.expectErr(err, verbs.ErrTooLarge, fmt.Sprintf("%v of %d bytes (MaxMessageBytes %d) in %d segments", op, segLen(segs), at.MaxMessageBytes, nseg))
		}
		if at.MaxMessageBytes < int64(segLenB) {
			err := p.a.qp.PostSend(write(5, big, 0, int(at.MaxMessageBytes)+1, dst, 0))
			p.expectErr(err, verbs.ErrTooLarge, fmt.Sprintf("Write of MaxMessageBytes+1 = %d bytes in Local", at.MaxMessageBytes+1))
		}
	}
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "requests refused as too large must not complete")
	p.expectQuiet(p.b.rcq, 20*time.Millisecond, "receives refused as too large must not complete")
	// The queue pair is still usable.
	src := p.region(p.a, 64, local)
	p.postSend(p.a, write(6, src, 0, 64, dst, 0))
	p.expectOK(p.wait(p.a.scq, 1, "write after the refused requests"), verbs.OpWrite, "write after the refused requests")
}
