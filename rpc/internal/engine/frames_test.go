package engine

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/pooltest"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// Protocol tests of the framing on a bare pair of links: a client link
// (no serve function) and a server link whose serve function the test
// gives. Nothing of package rpc is involved.

// framedPair connects a client link to a server link over tcp, frames
// enabled on both, and marks both verified (the negotiation's round trip
// is negotiate_test's). serve gets the server link and every request.
func framedPair(t *testing.T, serve func(srv *Link, h frameHeader, body []byte)) (client, server *Link) {
	t.Helper()
	return framedPairWith(t, serve, func([]uint64) func() { return nil })
}

// framedPairWith is framedPair whose server link hands the transfer ids
// a client's frame carries to releases.
func framedPairWith(t *testing.T, serve func(srv *Link, h frameHeader, body []byte), releases func([]uint64) func()) (client, server *Link) {
	t.Helper()
	t.Cleanup(func() { leakcheck.Check(t) }) // last: after the links close
	open := func(role verbs.ConnectRole) *Link {
		ctl := pooltest.New(t, 1<<20)
		dom, err := OpenDomain(tcp.New(), pooltest.New(t, 1<<20), ctl)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(dom.Close)
		l, err := NewLink(context.Background(), dom, ctl, netip.AddrFrom4([4]byte{127, 0, 0, 1}), role)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close(errors.New("test over")) })
		return l
	}
	client, server = open(verbs.RoleDial), open(verbs.RoleAccept)
	client.EnableFrames(SlotSizeFor(0), nil, nil)
	server.EnableFrames(SlotSizeFor(0), func(h frameHeader, body []byte) { serve(server, h, body) }, releases)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var cerr, serr error
	wg.Go(func() { cerr = client.Connect(ctx, server.QP.LocalInfo()) })
	wg.Go(func() { serr = server.Connect(ctx, client.QP.LocalInfo()) })
	wg.Wait()
	if cerr != nil || serr != nil {
		t.Fatalf("connect: client %v, server %v", cerr, serr)
	}
	client.Verified.Store(true)
	server.Verified.Store(true)
	return client, server
}

// okAnswer is an answer body: an OK status, then m.
func okAnswer(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return append(AppendStatus(nil, nil, 0), b...)
}

func fetchAnswer() func(uint16) proto.Message {
	return func(uint16) proto.Message { return &pb.FetchResponse{} }
}

// TestFramesRoundTrip: a request frame reaches the server's serve
// function with its ref and body, and the answer the server sends with
// that ref reaches the pending call, decoded.
func TestFramesRoundTrip(t *testing.T) {
	var answers sync.WaitGroup
	client, _ := framedPair(t, func(srv *Link, h frameHeader, body []byte) {
		if h.Type != frameFetchReq || string(body) != "key" {
			srv.Fail(errors.New("unexpected request"))
			return
		}
		answers.Go(func() {
			srv.SendFrame(context.Background(), frameFetchResp, 0, h.Ref, okAnswer(t, &pb.FetchResponse{InlineData: []byte("bytes")}), nil)
		})
	})
	t.Cleanup(answers.Wait) // before the links close
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc := client.Frames.Expect(7, frameFetchResp, fetchAnswer())
	if _, err := client.SendFrame(ctx, frameFetchReq, 0, 7, []byte("key"), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pc.Ch:
		r := pc.Reply()
		if r.Bad != nil || r.Status != nil || string(r.Msg.(*pb.FetchResponse).InlineData) != "bytes" {
			t.Fatalf("answer: %+v", r)
		}
	case <-ctx.Done():
		t.Fatal("no answer")
	}
}

// TestFramesWrongTypeAnswerFailsLink: an answer of another type than the
// pending request awaits breaks the protocol: the client's link fails
// (its session ends), and the pending call hears it through Dead.
func TestFramesWrongTypeAnswerFailsLink(t *testing.T) {
	var answers sync.WaitGroup
	client, _ := framedPair(t, func(srv *Link, h frameHeader, body []byte) {
		answers.Go(func() {
			srv.SendFrame(context.Background(), frameCallResp, 0, h.Ref, okAnswer(t, &pb.CallResponse{}), nil)
		})
	})
	t.Cleanup(answers.Wait)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc := client.Frames.Expect(1, frameFetchResp, fetchAnswer())
	if _, err := client.SendFrame(ctx, frameFetchReq, 0, 1, []byte("key"), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pc.Ch:
		r := pc.Reply()
		t.Fatalf("the pending Fetch got an answer of another type: %+v", r)
	case <-client.Dead:
	case <-ctx.Done():
		t.Fatal("the link survived an answer of another type")
	}
	if err := client.Failure; err == nil || !strings.Contains(err.Error(), "a response of type") {
		t.Fatalf("failure: %v, want the protocol error", err)
	}
}

// TestFramesStrayAnswerIgnored: an answer to a ref no request awaits (a
// late answer to a forgotten call) is dropped; the link lives on and the
// next call gets its own answer.
func TestFramesStrayAnswerIgnored(t *testing.T) {
	var answers sync.WaitGroup
	client, _ := framedPair(t, func(srv *Link, h frameHeader, body []byte) {
		answers.Go(func() {
			ctx := context.Background()
			srv.SendFrame(ctx, frameFetchResp, 0, h.Ref+1000, okAnswer(t, &pb.FetchResponse{InlineData: []byte("stray")}), nil)
			srv.SendFrame(ctx, frameFetchResp, 0, h.Ref, okAnswer(t, &pb.FetchResponse{InlineData: []byte("mine")}), nil)
		})
	})
	t.Cleanup(answers.Wait)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc := client.Frames.Expect(3, frameFetchResp, fetchAnswer())
	if _, err := client.SendFrame(ctx, frameFetchReq, 0, 3, []byte("key"), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pc.Ch:
		r := pc.Reply()
		if r.Msg == nil || string(r.Msg.(*pb.FetchResponse).InlineData) != "mine" {
			t.Fatalf("answer: %+v", r)
		}
	case <-client.Dead:
		t.Fatalf("a stray answer failed the link: %v", client.Failure)
	case <-ctx.Done():
		t.Fatal("no answer")
	}
}

// TestFramesRequestToClientFailsLink: a server that sends the client a
// request breaks the protocol: the client's link fails.
func TestFramesRequestToClientFailsLink(t *testing.T) {
	client, server := framedPair(t, func(*Link, frameHeader, []byte) {})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := server.SendFrame(ctx, frameFetchReq, 0, 1, []byte("key"), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-client.Dead:
	case <-ctx.Done():
		t.Fatal("the client's link survived a request from the server")
	}
	if err := client.Failure; err == nil || !strings.Contains(err.Error(), "a request to the client") {
		t.Fatalf("failure: %v, want the protocol error", err)
	}
}

// TestAbandonedPostDoesNotBlockCompletions: the onFail of a request whose
// poster stopped waiting may wait (package rpc's free a device
// registration, which on shm waits for the peer); it runs aside, not
// where completions are handled, which on tcp and shm is the provider's
// receiver: here it waits for the answer of a later request, which only
// that receiver can deliver.
func TestAbandonedPostDoesNotBlockCompletions(t *testing.T) {
	var answers sync.WaitGroup
	client, _ := framedPair(t, func(srv *Link, h frameHeader, body []byte) {
		if h.Type != frameFetchReq {
			return // the credit-only frames of the abandoned Sends
		}
		answers.Go(func() {
			srv.SendFrame(context.Background(), frameFetchResp, 0, h.Ref, okAnswer(t, &pb.FetchResponse{InlineData: []byte("bytes")}), nil)
		})
	})
	t.Cleanup(answers.Wait)
	gate := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(open) // so that a failing test still ends
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// A valid frame (credit-only, returning nothing) Sent under a context
	// that has ended: its poster does not wait for its completion, and
	// its onFail, run with the completion, waits for the gate.
	for i := 0; ; i++ {
		if i == 100 {
			// PostWith picks at random between a completion and an ended
			// context that are both ready: 100 misses mean it no longer
			// gives up waiting on an ended context.
			t.Fatal("in 100 Sends under an ended context, PostWith never returned before the Send completed")
		}
		buf, err := client.CtlPool.Alloc(ctx, frameHeaderLen)
		if err != nil {
			t.Fatal(err)
		}
		PutFrameHeader(buf.Bytes(), frameHeader{Type: frameCredit}, 0)
		local, err := client.Domain.Ctl.Local(buf)
		if err != nil {
			t.Fatal(err)
		}
		local.Length = frameHeaderLen
		gone, stop := context.WithCancel(ctx)
		stop()
		var returned atomic.Bool
		entered, early := make(chan struct{}), make(chan struct{})
		err = client.PostWith(gone, verbs.SendRequest{Op: verbs.OpSend, Local: local}, func() {
			if !returned.Load() {
				// At once, or before PostWith returned: not the case
				// this test needs.
				buf.Release()
				close(early)
				return
			}
			close(entered)
			<-gate // until the later request has its answer
			buf.Release()
		}, true, nil)
		returned.Store(true)
		if err == nil {
			buf.Release()
			continue
		}
		select {
		case <-early:
			continue
		case <-entered:
		case <-ctx.Done():
			t.Fatal("the abandoned Send never completed")
		}
		break
	}

	// The abandoned Send's onFail waits for this answer.
	pc := client.Frames.Expect(9, frameFetchResp, fetchAnswer())
	if _, err := client.SendFrame(ctx, frameFetchReq, 0, 9, []byte("key"), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pc.Ch:
		r := pc.Reply()
		if r.Bad != nil || r.Status != nil {
			t.Fatalf("answer: %+v", r)
		}
	case <-ctx.Done():
		t.Fatal("no answer: an abandoned request's onFail held up the link's completions")
	}
	open()
}

// TestPostFrame: a request posted without waiting for its Send's
// completion gets its answer; its frame buffer goes back once the Send
// completes; on a closed link nothing is posted and the credit it took
// comes back.
func TestPostFrame(t *testing.T) {
	var answers sync.WaitGroup
	client, _ := framedPair(t, func(srv *Link, h frameHeader, body []byte) {
		answers.Go(func() {
			srv.SendFrame(context.Background(), frameFetchResp, 0, h.Ref, okAnswer(t, &pb.FetchResponse{InlineData: body}), nil)
		})
	})
	t.Cleanup(answers.Wait)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	base := client.CtlPool.Stats().Allocs
	var sent atomic.Int64
	for ref := uint64(1); ref <= 3*FrameSlots; ref++ { // more than the credits: they come back
		pc := client.Frames.Expect(ref, frameFetchResp, fetchAnswer())
		if posted, err := client.PostFrame(ctx, frameFetchReq, 0, ref, []byte("key"), nil, func() { sent.Add(1) }); err != nil || !posted {
			t.Fatalf("request %d: posted %v, %v", ref, posted, err)
		}
		select {
		case <-pc.Ch:
			r := pc.Reply()
			if r.Bad != nil || r.Status != nil || string(r.Msg.(*pb.FetchResponse).InlineData) != "key" {
				t.Fatalf("answer %d: %+v", ref, r)
			}
		case <-ctx.Done():
			t.Fatalf("request %d: no answer", ref)
		}
	}
	for client.CtlPool.Stats().Allocs != base || sent.Load() != 3*FrameSlots {
		select {
		case <-ctx.Done():
			t.Fatalf("%d frame buffers still held, %d of %d Sends reported sent", client.CtlPool.Stats().Allocs-base, sent.Load(), 3*FrameSlots)
		case <-time.After(time.Millisecond):
		}
	}

	client.Fail(errors.New("test: link down"))
	client.Frames.Mu.Lock()
	credits := client.Frames.Credits
	client.Frames.Mu.Unlock()
	if posted, err := client.PostFrame(ctx, frameFetchReq, 0, 99, []byte("key"), nil, func() { t.Error("sent ran for a frame that was not posted") }); err == nil || posted {
		t.Fatalf("on a failed link: posted %v, %v", posted, err)
	}
	client.Frames.Mu.Lock()
	after := client.Frames.Credits
	client.Frames.Mu.Unlock()
	if after != credits {
		t.Errorf("credits %d after a frame that was not posted, want %d", after, credits)
	}
}

// TestFramesReleasesAfterFetch: the releases a Fetch request carries are
// taken at once (the releases function runs before the request is
// served), and what finishes them runs once the Fetch is served; those
// a Call request carries are finished before it is served, as are those
// of a RELEASE frame of their own.
func TestFramesReleasesAfterFetch(t *testing.T) {
	var mu sync.Mutex
	var events []string
	note := func(e string) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	}
	served := make(chan struct{}, 16)
	client, _ := framedPairWith(t, func(_ *Link, h frameHeader, _ []byte) {
		note(fmt.Sprint("serve ", h.Type))
		served <- struct{}{}
	}, func(ids []uint64) func() {
		note(fmt.Sprint("take ", ids))
		return func() { note(fmt.Sprint("finish ", ids)) }
	})
	for _, c := range []struct {
		typ  uint8
		late bool
	}{{frameFetchReq, true}, {frameCallReq, false}, {frameSendReq, false}} {
		carried := false
		for try := uint64(1); try <= 20 && !carried; try++ {
			mu.Lock()
			events = events[:0]
			mu.Unlock()
			id := uint64(c.typ)*100 + try
			client.Frames.QueueRelease(id, 0)
			if _, err := client.SendFrame(context.Background(), c.typ, 0, id, []byte("key"), nil); err != nil {
				t.Fatal(err)
			}
			<-served
			if h := client.Frames.QueuedReleases(); h != 0 {
				t.Fatalf("%d releases left queued after a frame", h)
			}
			mu.Lock()
			got := strings.Join(events, "; ")
			mu.Unlock()
			take, fin := fmt.Sprint("take [", id, "]"), fmt.Sprint("finish [", id, "]")
			if strings.Contains(got, fmt.Sprint("serve ", frameRelease)) {
				// The releaser sent it alone before the request took it
				// along: finished before that frame is served.
				<-served
				continue
			}
			carried = true
			want := []string{take, fmt.Sprint("serve ", c.typ), fin}
			if !c.late {
				want = []string{take, fin, fmt.Sprint("serve ", c.typ)}
			}
			if got != strings.Join(want, "; ") {
				t.Errorf("frame type %d carrying a release: %q, want %q", c.typ, got, strings.Join(want, "; "))
			}
		}
		if !carried {
			t.Errorf("frame type %d: no request took its release along in 20 tries", c.typ)
		}
	}
}

// TestReleaserDelays: a release that no frame takes along goes in a
// RELEASE frame of its own once its delay passed; not before, while the
// delay runs; and a cancellation queued meanwhile cuts that wait to the
// cancellation's delay, its ref in the same frame.
func TestReleaserDelays(t *testing.T) {
	pair := func(t *testing.T, release, cancel time.Duration) (*Link, chan []uint64, chan []uint64) {
		// Set before the links start, restored after they ended (the
		// cleanups run last first).
		old, oldCancel := releaseDelay, cancelDelay
		t.Cleanup(func() { releaseDelay, cancelDelay = old, oldCancel })
		releaseDelay, cancelDelay = release, cancel
		released, cancelled := make(chan []uint64, 8), make(chan []uint64, 8)
		client, _ := framedPairWith(t, func(_ *Link, h frameHeader, body []byte) {
			if h.Type == frameRelease {
				if refs := ReadU64s(body); len(refs) > 0 {
					cancelled <- refs
				}
			}
		}, func(ids []uint64) func() {
			released <- ids
			return func() {}
		})
		return client, released, cancelled
	}
	wait := func(t *testing.T, ch chan []uint64, want uint64, what string) {
		t.Helper()
		select {
		case got := <-ch:
			if !slices.Equal(got, []uint64{want}) {
				t.Fatalf("%s %v, want [%d]", what, got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s %d: not sent in 10 s", what, want)
		}
	}
	t.Run("alone", func(t *testing.T) {
		client, released, _ := pair(t, time.Millisecond, time.Millisecond)
		client.Frames.QueueRelease(5, 0)
		wait(t, released, 5, "released")
	})
	t.Run("cancellation-cuts-the-wait", func(t *testing.T) {
		client, released, cancelled := pair(t, time.Hour, time.Millisecond)
		client.Frames.QueueRelease(7, 0)
		select {
		case ids := <-released:
			t.Fatalf("released %v within 50 ms of a release delay of an hour, with nothing else queued", ids)
		case <-time.After(50 * time.Millisecond):
		}
		client.Frames.QueueRelease(0, 9)
		wait(t, released, 7, "released")
		wait(t, cancelled, 9, "cancelled")
	})
}
