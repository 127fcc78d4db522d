package verbstest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// testLocalErrors posts requests whose local side is wrong: out of the
// region's bounds, a region of the other domain, no region, a Read or Recv
// destination without local write, in Local or in one of several Segments.
// Each is refused at post time with an error wrapping ErrInvalidMemory;
// nothing completes, nothing moves, and the queue pair stays in RTS and
// usable. An invalid opcode is refused too.
func testLocalErrors(t *testing.T, env Env) {
	p := newPair(t, env, options{})
	defer p.close()
	ro := p.region(p.a, 4096, 0)
	rw := p.region(p.a, 4096, local)
	foreign := p.region(p.b, 4096, local)
	target := p.region(p.b, 4096, remote)
	bro := p.region(p.b, 4096, 0)
	brw := p.region(p.b, 4096, local)
	fill(target.Bytes(), 40)
	fill(rw.Bytes(), 41)
	fill(brw.Bytes(), 42)
	targetWas := append([]byte(nil), target.Bytes()...)
	rwWas := append([]byte(nil), rw.Bytes()...)
	brwWas := append([]byte(nil), brw.Bytes()...)
	rem := verbs.Remote{Addr: target.Addr(), Key: target.RemoteKey()}
	withSegs := func(op verbs.Opcode, segs ...verbs.Local) verbs.SendRequest {
		return verbs.SendRequest{ID: 1, Op: op, Segments: segs, Remote: rem}
	}
	sendCases := []struct {
		name string
		wr   verbs.SendRequest
	}{
		{"WritePastRegionEnd", write(1, rw, 4000, 200, target, 0)},
		{"WriteOffsetPastRegionEnd", write(1, rw, 4097, 0, target, 0)},
		{"WriteNegativeOffset", write(1, rw, -1, 16, target, 0)},
		{"WriteNegativeLength", write(1, rw, 16, -1, target, 0)},
		{"WriteNilRegion", verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Length: 64}, Remote: rem}},
		{"WriteForeignRegion", write(1, foreign, 0, 64, target, 0)},
		{"SendPastRegionEnd", send(1, rw, 1, 4096)},
		{"SendForeignRegion", send(1, foreign, 0, 64)},
		{"ReadIntoReadOnly", read(1, ro, 0, 64, target, 0)},
		{"ReadIntoForeignRegion", read(1, foreign, 0, 64, target, 0)},
		{"ReadPastRegionEnd", read(1, rw, 4095, 2, target, 0)},
		{"WriteSegmentPastRegionEnd", withSegs(verbs.OpWrite, seg(rw, 0, 64), seg(rw, 4090, 10))},
		{"WriteSegmentForeign", withSegs(verbs.OpWrite, seg(rw, 0, 64), seg(foreign, 0, 64), seg(rw, 64, 64))},
		{"WriteSegmentNilRegion", withSegs(verbs.OpWrite, seg(rw, 0, 64), seg(nil, 0, 8))},
		{"ReadSegmentReadOnly", withSegs(verbs.OpRead, seg(rw, 0, 64), seg(rw, 64, 64), seg(ro, 0, 64))},
		{"ReadSegmentNegativeOffset", withSegs(verbs.OpRead, seg(rw, -8, 16), seg(rw, 64, 64))},
	}
	for _, c := range sendCases {
		if err := p.a.qp.PostSend(c.wr); !errors.Is(err, verbs.ErrInvalidMemory) {
			t.Errorf("%s: %s: PostSend: got %v, want an error wrapping ErrInvalidMemory", env.Name, c.name, err)
		}
	}
	recvCases := []struct {
		name string
		wr   verbs.RecvRequest
	}{
		{"RecvIntoReadOnly", recv(1, bro, 0, 64)},
		{"RecvIntoForeignRegion", recv(1, rw, 0, 64)},
		{"RecvPastRegionEnd", recv(1, brw, 4000, 200)},
		{"RecvNegativeOffset", recv(1, brw, -1, 64)},
		{"RecvNilRegion", verbs.RecvRequest{ID: 1, Local: verbs.Local{Length: 64}}},
		{"RecvSegmentReadOnly", verbs.RecvRequest{ID: 1, Segments: []verbs.Local{seg(brw, 0, 64), seg(bro, 0, 64)}}},
		{"RecvSegmentPastRegionEnd", verbs.RecvRequest{ID: 1, Segments: []verbs.Local{seg(brw, 0, 64), seg(brw, 4095, 2)}}},
	}
	for _, c := range recvCases {
		if err := p.b.qp.PostRecv(c.wr); !errors.Is(err, verbs.ErrInvalidMemory) {
			t.Errorf("%s: %s: PostRecv: got %v, want an error wrapping ErrInvalidMemory", env.Name, c.name, err)
		}
	}
	for _, op := range []verbs.Opcode{0, verbs.OpRecv, verbs.OpRecvImm, 200} {
		wr := send(1, rw, 0, 8)
		wr.Op = op
		if err := p.a.qp.PostSend(wr); !errors.Is(err, verbs.ErrUnsupported) {
			t.Errorf("%s: PostSend with opcode %v: got %v, want an error wrapping ErrUnsupported", env.Name, op, err)
		}
	}
	// A deregistered region is a bad local segment.
	gone := p.region(p.a, 64, local)
	if err := gone.Deregister(); err != nil {
		t.Fatalf("%s: Deregister: %v", env.Name, err)
	}
	if err := p.a.qp.PostSend(write(1, gone, 0, 64, target, 0)); !errors.Is(err, verbs.ErrInvalidMemory) {
		t.Errorf("%s: Write from a deregistered region: got %v, want an error wrapping ErrInvalidMemory", env.Name, err)
	}
	if t.Failed() {
		t.FailNow()
	}
	p.expectQuiet(p.a.scq, 20*time.Millisecond, "refused requests must not complete")
	p.expectQuiet(p.b.rcq, 20*time.Millisecond, "refused receives must not complete")
	checkBytes(t, "target after refused requests", target.Bytes(), targetWas)
	checkBytes(t, "local region after refused requests", rw.Bytes(), rwWas)
	checkBytes(t, "receive region after refused receives", brw.Bytes(), brwWas)
	for _, s := range []*side{p.a, p.b} {
		if st := s.qp.State(); st != verbs.QPReadyToSend {
			t.Fatalf("%s: side %s: after refused posts the queue pair is in %v, want %v", env.Name, s.name, st, verbs.QPReadyToSend)
		}
	}
	// Both queue pairs are still usable, with nothing left of the refused
	// posts: the next receive takes the next send.
	p.postRecv(p.b, recv(2, brw, 0, 64))
	p.postSend(p.a, send(3, rw, 0, 64), write(4, rw, 0, 64, target, 0))
	rc := p.wait(p.b.rcq, 1, "receive after the refused posts")
	if rc[0].ID != 2 {
		t.Fatalf("%s: receive after the refused posts: %v, want id 2", env.Name, describe(rc))
	}
	p.expectOK(rc, verbs.OpRecv, "receive after the refused posts")
	cs := p.wait(p.a.scq, 2, "send and write after the refused posts")
	if cs[0].ID != 3 || cs[1].ID != 4 {
		t.Fatalf("%s: completions after the refused posts: %v, want send 3 and write 4", env.Name, describe(cs))
	}
	checkBytes(t, "target after the write", target.Bytes()[:64], rw.Bytes()[:64])
}

// testAllOrNone posts batches whose third request cannot be posted (a bad
// local segment, too many segments, a bad opcode, no room in the queue).
// The call fails, nothing of the batch is posted (no completion for the
// first two, no byte moves), and the queue has all its room afterwards:
// exactly MaxSend (or MaxRecv) requests can be posted, in order.
func testAllOrNone(t *testing.T, env Env) {
	t.Run("PostSend", func(t *testing.T) {
		defer leakcheck.Check(t)
		const maxSend = 8
		p := newPair(t, env, options{qp: verbs.QueuePairConfig{MaxSend: maxSend}})
		defer p.close()
		src := p.region(p.a, 4096, local)
		dst := p.region(p.b, 4096, remote)
		rbuf := p.region(p.b, 4096, local)
		fill(src.Bytes(), 43)
		fill(dst.Bytes(), 44)
		dstWas := append([]byte(nil), dst.Bytes()...)
		p.postRecv(p.b, recv(500, rbuf, 0, 4096))
		good := func(id uint64) verbs.SendRequest { return write(id, src, int(id%8)*64, 64, dst, int(id%8)*64) }
		type batch struct {
			name  string
			third verbs.SendRequest
			n     int   // requests in the batch: 3, or maxSend+1
			want  error // nil: any error
		}
		batches := []batch{
			{"BadLocalThird", write(3, src, 4090, 64, dst, 0), 3, verbs.ErrInvalidMemory},
			{"ReadOnlyDestinationThird", read(3, p.region(p.a, 64, 0), 0, 64, dst, 0), 3, verbs.ErrInvalidMemory},
			{"BadOpcodeThird", verbs.SendRequest{ID: 3, Op: verbs.OpRecv, Local: seg(src, 0, 8)}, 3, nil},
			{"BeyondRoom", good(3), maxSend + 1, verbs.ErrQueueFull},
		}
		if ms := p.attrs(p.a).MaxSegments; ms < maxSegmentsTested {
			segs := make([]verbs.Local, ms+1)
			for i := range segs {
				segs[i] = seg(src, i, 1)
			}
			batches = append(batches, batch{"TooManySegmentsThird",
				verbs.SendRequest{ID: 3, Op: verbs.OpWrite, Segments: segs, Remote: verbs.Remote{Addr: dst.Addr(), Key: dst.RemoteKey()}},
				3, verbs.ErrTooLarge})
		}
		for _, b := range batches {
			// A Send first (to the receive posted at the peer, so that a
			// wrongly posted Send would show there), a Write, then the
			// third request; BeyondRoom is good requests, one too many.
			wrs := []verbs.SendRequest{send(1, src, 0, 64), good(2), b.third}
			for len(wrs) < b.n {
				wrs = append(wrs, good(uint64(len(wrs)+1)))
			}
			err := p.a.qp.PostSend(wrs...)
			if err == nil || (b.want != nil && !errors.Is(err, b.want)) {
				t.Fatalf("%s: %s: PostSend of %d requests: got %v, want an error wrapping %v", env.Name, b.name, len(wrs), err, b.want)
			}
			p.expectQuiet(p.a.scq, 20*time.Millisecond, b.name+": nothing of a refused batch may complete")
			p.expectQuiet(p.b.rcq, 20*time.Millisecond, b.name+": the Send of a refused batch must not arrive")
			checkBytes(t, b.name+": target after a refused batch", dst.Bytes(), dstWas)
			// The whole queue is free: exactly maxSend more fit.
			room := make([]verbs.SendRequest, maxSend)
			for i := range room {
				room[i] = write(uint64(100+i), src, 0, 8, dst, 4000)
			}
			p.postSend(p.a, room...)
			p.expectErr(p.a.qp.PostSend(good(1)), verbs.ErrQueueFull, b.name+": PostSend beyond MaxSend after a refused batch")
			cs := p.wait(p.a.scq, maxSend, b.name+": the writes that fill the queue")
			p.expectOK(cs, verbs.OpWrite, "write")
			for i, c := range cs {
				if c.ID != uint64(100+i) {
					t.Fatalf("%s: %s: completions %v, want ids 100..%d", env.Name, b.name, describe(cs), 100+maxSend-1)
				}
			}
			copy(dstWas[4000:], src.Bytes()[:8])
		}
	})

	t.Run("PostRecv", func(t *testing.T) {
		defer leakcheck.Check(t)
		const maxRecv = 4
		p := newPair(t, env, options{qp: verbs.QueuePairConfig{MaxRecv: maxRecv}})
		defer p.close()
		src := p.region(p.a, 64, local)
		rbuf := p.region(p.b, 4096, local)
		ro := p.region(p.b, 64, 0)
		fill(src.Bytes(), 45)
		good := func(id uint64) verbs.RecvRequest { return recv(id, rbuf, int(id%maxRecv)*64, 64) }
		type batch struct {
			name  string
			third verbs.RecvRequest
			n     int
			want  error
		}
		batches := []batch{
			{"BadLocalThird", recv(3, rbuf, 4090, 64), 3, verbs.ErrInvalidMemory},
			{"ReadOnlyThird", recv(3, ro, 0, 64), 3, verbs.ErrInvalidMemory},
			{"BeyondRoom", good(3), maxRecv + 1, verbs.ErrQueueFull},
		}
		if ms := p.attrs(p.b).MaxSegments; ms < maxSegmentsTested {
			segs := make([]verbs.Local, ms+1)
			for i := range segs {
				segs[i] = seg(rbuf, i, 1)
			}
			batches = append(batches, batch{"TooManySegmentsThird", verbs.RecvRequest{ID: 3, Segments: segs}, 3, verbs.ErrTooLarge})
		}
		next := uint64(100)
		for _, b := range batches {
			wrs := []verbs.RecvRequest{good(1), good(2), b.third}
			for len(wrs) < b.n {
				wrs = append(wrs, good(uint64(len(wrs)+1)))
			}
			if err := p.b.qp.PostRecv(wrs...); !errors.Is(err, b.want) {
				t.Fatalf("%s: %s: PostRecv of %d requests: got %v, want an error wrapping %v", env.Name, b.name, len(wrs), err, b.want)
			}
			p.expectQuiet(p.b.rcq, 20*time.Millisecond, b.name+": nothing of a refused batch may complete")
			// The whole queue is free: exactly maxRecv more fit, and they
			// take the next Sends in order.
			room := make([]verbs.RecvRequest, maxRecv)
			for i := range room {
				room[i] = recv(next+uint64(i), rbuf, i*64, 64)
			}
			p.postRecv(p.b, room...)
			p.expectErr(p.b.qp.PostRecv(good(1)), verbs.ErrQueueFull, b.name+": PostRecv beyond MaxRecv after a refused batch")
			sends := make([]verbs.SendRequest, maxRecv)
			for i := range sends {
				sends[i] = send(uint64(i), src, 0, 64)
			}
			p.postSend(p.a, sends...)
			p.expectOK(p.wait(p.a.scq, maxRecv, b.name+": sends"), verbs.OpSend, "send")
			cs := p.wait(p.b.rcq, maxRecv, b.name+": receives")
			p.expectOK(cs, verbs.OpRecv, "receive")
			for i, c := range cs {
				if c.ID != next+uint64(i) || c.Len != 64 {
					t.Fatalf("%s: %s: receives %v, want ids %d..%d of 64 bytes (nothing of the refused batch)", env.Name, b.name, describe(cs), next, next+maxRecv-1)
				}
			}
			p.expectQuiet(p.b.rcq, 20*time.Millisecond, fmt.Sprintf("%s: after %d receives", b.name, maxRecv))
			next += 100
		}
	})
}
