// White-box: these tests check the frame protocol of calls through links, frame counters and server sessions.

package rpc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// framedPair is a pair whose client counts the unary calls it makes.
func framedPair(t *testing.T, transport string) (*Server, *Client, *rpctest.MethodCalls) {
	t.Helper()
	u := rpctest.NewMethodCalls()
	s, c := pair(t, transport, nil, []DialOption{withUnaryCounter(u.Intercept)})
	if c.last.link == nil || c.last.link.Frames == nil {
		t.Fatal("no frames")
	}
	return s, c, u
}

// echo returns its request, tensors copied into new pool tensors, and
// metadata of replyMeta bytes when the request's metadata asks for it.
func echo(s *Server) Handler {
	return func(ctx context.Context, in *Message) (*Message, error) {
		out := &Message{Metadata: in.Metadata}
		if len(in.Metadata) > 0 && in.Metadata[0] == 'M' {
			out.Metadata = bytes.Repeat([]byte{'r'}, 200<<10)
		}
		for _, t := range in.Tensors {
			o, err := s.NewTensor(ctx, t.DType(), t.Shape())
			if err != nil {
				out.Release()
				return nil, err
			}
			copy(o.Bytes(), t.Bytes())
			out.Tensors = append(out.Tensors, o)
		}
		return out, nil
	}
}

// TestFramesPullForeignGrant: a client that names, in its own SEND_REQ,
// a location another session granted gets an error, and nothing is
// published; the other session goes on.
func TestFramesPullForeignGrant(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, _, dial := hostileSetup(t, tr, 1<<20)
			victim, thief := dial(), dial()
			vs, err := victim.session(ctxT(t))
			if err != nil {
				t.Fatal(err)
			}
			ts, err := thief.session(ctxT(t))
			if err != nil {
				t.Fatal(err)
			}
			secret := wrapped(t, 1<<20, 9)
			defer secret.Release()
			loc, free, err := victim.grantSource(ctxT(t), vs, vs.link, outgoing{meta: metaOf("stolen", secret.Tensor, false), t: secret})
			if err != nil {
				t.Fatal(err)
			}
			defer free()
			meta := metaOf("stolen", secret.Tensor, false)
			meta.Location = loc
			r, ref, err := thief.roundTrip(ctxT(t), ts, ts.link, wire.FrameSendReq, 0, nil, &pb.SendRequest{Meta: meta}, func(uint16) proto.Message { return &pb.SendResponse{} }, nil)
			if err == nil {
				err = thief.replyError(ts, ref, r)
			}
			if err == nil {
				t.Fatal("a SEND_REQ naming another session's grant succeeded")
			}
			if code := status.Code(err); code != codes.PermissionDenied && code != codes.Unavailable {
				t.Fatalf("foreign grant: %v, want PermissionDenied or Unavailable", err)
			}
			if got, err := s.Fetch(ctxT(t), "stolen"); err == nil {
				got.Release()
				t.Fatal("the stolen tensor was published")
			}
			got, err := victim.Fetch(ctxT(t), "secret")
			if err != nil {
				t.Fatalf("victim's session after the attempt: %v", err)
			}
			got.Release()
		})
	}
}

// TestFramesReleasesPiggyback: the releases of many Fetches ride on frames
// (no Release method) and every server transfer ends. (Without landings,
// which make no transfer to release.)
func TestFramesReleasesPiggyback(t *testing.T) {
	for _, lanes := range []int{1, 3} {
		t.Run(fmt.Sprintf("lanes%d", lanes), func(t *testing.T) {
			u := rpctest.NewMethodCalls()
			s, c := pair(t, TransportTCP, []ServerOption{WithLanes(lanes)}, []DialOption{WithLanes(lanes), withUnaryCounter(u.Intercept), WithFetchLanding(0)})
			publishBytes(t, s, "big", 256<<10, 4)
			ctx := ctxT(t)
			for range 200 {
				got, err := c.Fetch(ctx, "big")
				if err != nil {
					t.Fatal(err)
				}
				got.Release()
			}
			ss := serverSessionOf(t, s)
			deadline := time.Now().Add(10 * time.Second)
			for {
				n := ss.Holding().Transfers
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d transfers still held after every Fetch released", n)
				}
				time.Sleep(5 * time.Millisecond)
			}
			if n := u.Total(); n != 0 {
				t.Fatalf("%d unary calls", n)
			}
			// Every release came in on a lane's frames (calls one after
			// another take the least busy lane, and their releases with
			// them).
			var in uint64
			for _, l := range ss.lanes {
				in += l.Frames.ReleasedIn.Load()
			}
			if in < 200 {
				t.Errorf("%d releases came in on %d lanes' frames, want the 200 Fetches'", in, lanes)
			}
		})
	}
}

// withUnaryCounter makes the client's unary calls go through f.
func withUnaryCounter(f grpc.UnaryClientInterceptor) DialOption {
	return WithGRPCDialOptions(grpc.WithUnaryInterceptor(f))
}

// TestStalePullEndsSession: a Read of the client's memory that stays
// unanswered past the reservation timeout ends the session, as an
// unwritten destination does.
func TestStalePullEndsSession(t *testing.T) {
	s, c := pair(t, TransportTCP, []ServerOption{WithReservationTimeout(50 * time.Millisecond)}, nil)
	if _, err := c.session(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	done := serverSessionOf(t, s).Pulling() // as pull does around its Reads
	defer done()
	deadline := time.Now().Add(10 * time.Second)
	for !sessionGone(c) {
		if time.Now().After(deadline) {
			t.Fatal("the session outlived a stale read")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestFrameResponseOfWrongType: a response whose type is not the one its
// request awaits fails the link.
func TestFrameResponseOfWrongType(t *testing.T) {
	_, c, _ := framedPair(t, TransportTCP)
	l := c.last.link
	l.Frames.Expect(77, wire.FrameSendResp, func(uint16) proto.Message { return &pb.SendResponse{} })
	body := engine.AppendStatus(nil, nil, 64)
	frame := hdr(wire.FrameCallResp, 0, 0, 77, len(body), body)
	if err := l.HandleFrame(frame); err == nil || !errors.Is(err, wire.ErrInvalidFrame) {
		t.Fatalf("a CALL_RESP to a SEND_REQ: %v, want a frame error", err)
	}
	l.Frames.Forget(77)
}

// TestFetchNow: a Fetch of a published key (inline or a transfer), and one
// of a key not published, are answered in the polling goroutine
// (fetchNow) with what the call path answers; a waiting one takes the call
// path. fetchNow declines when no credit or buffer is at hand at that
// instant (the call path then answers), so the counts allow a few misses.
func TestFetchNow(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c, _ := framedPair(t, tr)
			ctx := ctxT(t)
			want := map[string][]byte{
				"small": publishBytes(t, s, "small", 4<<10, 3),
				"large": publishBytes(t, s, "large", 1<<20, 4),
			}
			ss := serverSessionOf(t, s)
			for _, key := range []string{"small", "large"} {
				before := ss.answeredNow.Load()
				for range 20 {
					got, err := c.Fetch(ctx, key)
					if err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got.Bytes(), want[key]) {
						t.Fatalf("%s fetch: wrong bytes", key)
					}
					got.Release()
				}
				if n := ss.answeredNow.Load() - before; n < 15 {
					t.Fatalf("%d of 20 %s fetches answered at once", n, key)
				}
			}
			_, errNow := c.Fetch(ctx, "absent")
			_, errCall := pb.NewTensorRPCClient(c.cc).Fetch(ctx, &pb.FetchRequest{SessionId: c.SessionID(), Key: "absent"})
			if status.Code(errNow) != codes.NotFound || status.Convert(errNow).Message() != status.Convert(errCall).Message() {
				t.Fatalf("absent key: %v, the Fetch method says %v", errNow, errCall)
			}
			before := ss.answeredNow.Load()
			done := make(chan error, 1)
			go func() {
				got, err := c.Fetch(ctx, "later", WaitForKey())
				if err == nil {
					got.Release()
				}
				done <- err
			}()
			time.Sleep(20 * time.Millisecond)
			publishBytes(t, s, "later", 100, 5)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if n := ss.answeredNow.Load(); n != before {
				t.Fatalf("a waiting fetch was answered at once (%d -> %d)", before, n)
			}
		})
	}
}

// TestCallRequestChargedToQuota: the request tensors a call brings into
// the server's pool (here small ones, inline) count against the session's
// quota while the call runs: a call past it is ResourceExhausted before
// its handler runs, the session goes on, and nothing stays charged.
func TestCallRequestChargedToQuota(t *testing.T) {
	for _, mode := range []string{"frames"} {
		t.Run(mode, func(t *testing.T) {
			s, c := pair(t, TransportTCP, []ServerOption{WithSessionQuota(256 << 10)}, nil)
			var ran atomic.Int64
			s.Handle("count", func(ctx context.Context, in *Message) (*Message, error) {
				ran.Add(1)
				return &Message{Metadata: fmt.Appendf(nil, "%d", len(in.Tensors))}, nil
			})
			ctx := ctxT(t)
			call := func(k int) (*Message, error) {
				req := &Message{}
				for i := range k {
					req.Tensors = append(req.Tensors, wrapped(t, 4<<10, byte(i)))
				}
				return c.Call(ctx, "count", req)
			}
			first := c.SessionID()
			_, err := call(100) // 400 KiB
			if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "quota") {
				t.Fatalf("a call of 400 KiB with a 256 KiB quota: %v, want ResourceExhausted naming the quota", err)
			}
			if ran.Load() != 0 {
				t.Fatal("the handler ran for a call past the quota")
			}
			reply, err := call(10)
			if err != nil {
				t.Fatal(err)
			}
			if string(reply.Metadata) != "10" {
				t.Fatalf("the handler got %s tensors, want 10", reply.Metadata)
			}
			reply.Release()
			if c.SessionID() != first {
				t.Fatal("the refused call ended the session")
			}
			ss := serverSessionOf(t, s)
			ss.mu.Lock()
			left := ss.reserved
			ss.mu.Unlock()
			if left != 0 {
				t.Fatalf("%d bytes still charged after the calls", left)
			}
		})
	}
}

// TestFrameCallsTakeNoServerLock: frame calls never take the server-wide
// lock (a session opening or closing holds it): with it held, a Fetch, a
// Send and a Call as frames complete.
func TestFrameCallsTakeNoServerLock(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			s.Handle("nop", func(ctx context.Context, req *Message) (*Message, error) { return req, nil })
			x := wrapped(t, 4<<10, 3)
			defer x.Release()
			ctx := ctxT(t)
			if err := c.Send(ctx, "k", x); err != nil {
				t.Fatal(err)
			}
			s.mu.Lock()
			done := make(chan error, 1)
			go func() {
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				got, err := c.Fetch(cctx, "k")
				if err == nil {
					got.Release()
					err = c.Send(cctx, "k2", x)
				}
				if err == nil {
					var m *Message
					if m, err = c.Call(cctx, "nop", &Message{Tensors: []*Tensor{x}}); err == nil {
						m.Release()
					}
				}
				done <- err
			}()
			err := <-done
			s.mu.Unlock()
			if err != nil {
				t.Fatalf("calls with the server's lock held: %v", err)
			}
		})
	}
}

// TestCreditorOutlivesTransientError: a credit-only frame that fails to
// post once (a full send queue) does not end the lane's creditor for
// good. 40 Fetches wait for a key, so the server's 40 answers come with
// no request between them: past its 31 credits the server needs the
// client's credit-only frame, whose first try fails.
func TestCreditorOutlivesTransientError(t *testing.T) {
	var armed atomic.Bool // the next PostSend fails as a full send queue does
	fail := func(verbs.SendRequest) error {
		if armed.CompareAndSwap(true, false) {
			return verbs.ErrQueueFull
		}
		return nil
	}
	s, c := pair(t, TransportTCP, nil, []DialOption{WithLanes(1), WithProvider(hookProvider{Provider: tcp.New(), OnPost: fail})})
	const n = 40
	errs := make(chan error, n)
	for range n {
		go func() {
			got, err := c.Fetch(shortCtx(t, 20*time.Second), "later", WaitForKey())
			if err == nil {
				got.Release()
			}
			errs <- err
		}()
	}
	ss := serverSessionOf(t, s)
	waitFor(t, "the Fetches to wait on the server", func() bool {
		return ss.Holding().InFlight >= n
	})
	armed.Store(true)
	publishBytes(t, s, "later", 100, 1)
	for range n {
		if err := <-errs; err != nil {
			t.Fatalf("a Fetch after the creditor's failed post: %v", err)
		}
	}
	if armed.Load() {
		t.Error("the credit-only frame was never tried")
	}
}

// TestFetchNowIntercepted: with inline interceptors only, a Fetch of a
// published key (inline or a transfer) or of one not published is looked
// up and answered where its frame was read, the interceptors around it,
// each call seen once; an interceptor that fails the call after its work
// gets its error to the client and what the work made is freed; one that
// returns without running the work fails the call Internal; one that runs
// it twice gets the second answer (the first is freed); an answer
// that finds no credit or buffer goes aside and still arrives (the pair's
// cleanup checks that no buffer or goroutine is left).
func TestFetchNowIntercepted(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			var mode atomic.Value
			mode.Store("pass")
			var seen atomic.Int64
			look := func(ctx context.Context, info *CallInfo, next func(context.Context) error) error {
				seen.Add(1)
				switch mode.Load() {
				case "fail":
					if err := next(ctx); err != nil {
						return err
					}
					return status.Error(codes.PermissionDenied, "not after all")
				case "skip":
					return nil
				case "twice":
					if err := next(ctx); err != nil {
						return err
					}
					return next(ctx)
				}
				return next(ctx)
			}
			s, c := pair(t, tr, []ServerOption{WithInlineInterceptors(look)}, nil)
			ctx := ctxT(t)
			want := map[string][]byte{
				"small": publishBytes(t, s, "small", 4<<10, 3),
				"large": publishBytes(t, s, "large", 1<<20, 4),
			}
			ss := serverSessionOf(t, s)
			// A call with a deadline runs as any other (runFrameCall);
			// one without is answered at once.
			calls := map[bool]context.Context{true: ctx, false: context.WithoutCancel(ctx)}
			for _, aside := range []bool{false, true} {
				for _, deadline := range []bool{true, false} {
					ctx := calls[deadline]
					answerAsideForTest.Store(aside)
					for _, m := range []string{"pass", "fail", "skip", "twice"} {
						mode.Store(m)
						for _, key := range []string{"small", "large", "absent"} {
							before, now := seen.Load(), ss.answeredNow.Load()
							got, err := c.Fetch(ctx, key)
							wantCode := map[string]codes.Code{"pass": codes.OK, "fail": codes.PermissionDenied, "skip": codes.Internal, "twice": codes.OK}[m]
							if key == "absent" && m != "skip" {
								wantCode = codes.NotFound
							}
							if status.Code(err) != wantCode {
								t.Fatalf("aside=%v deadline=%v %s %s: %v, want %v", aside, deadline, m, key, err, wantCode)
							}
							if err == nil {
								if !bytes.Equal(got.Bytes(), want[key]) {
									t.Fatalf("aside=%v %s: wrong bytes", aside, key)
								}
								got.Release()
							}
							if n := seen.Load() - before; n != 1 {
								t.Errorf("aside=%v %s %s: the interceptor saw it %d times", aside, m, key, n)
							}
							if !aside && !deadline && ss.answeredNow.Load() == now && m == "pass" && key == "small" {
								// A miss can happen (no credit at that
								// instant); a second one in a row would be odd.
								got, err := c.Fetch(ctx, key)
								if err != nil {
									t.Fatal(err)
								}
								got.Release()
								if ss.answeredNow.Load() == now {
									t.Errorf("%s %s was not answered where its frame was read", m, key)
								}
							}
						}
					}
				}
			}
			answerAsideForTest.Store(false)
		})
	}
}

// TestAnswerBeforeDeath: an answer the receiver handed over before the
// link died (the server answered, then closed the connection) is the
// call's, every time, though both are at hand when the caller looks.
func TestAnswerBeforeDeath(t *testing.T) {
	_, c, _ := framedPair(t, TransportTCP)
	s, err := c.session(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	l := c.last.link
	l.Fail(status.Error(codes.Unavailable, "the server closed the connection"))
	for i := range 100 {
		ref := uint64(1<<40 + i)
		pc := l.Frames.Expect(ref, wire.FrameSendResp, func(uint16) proto.Message { return &pb.SendResponse{} })
		pc.Deliver(engine.FrameReply{Msg: &pb.SendResponse{}})
		held := 0
		r, err := c.awaitReply(ctxT(t), s, l, ref, pc, func() { held++ })
		l.Frames.Forget(ref)
		if err != nil || r.Msg == nil || held != 1 {
			t.Fatalf("try %d: %v, %v, hold ran %d times; want the answer", i, r.Msg, err, held)
		}
	}
}

// TestCallAnswerAside: a call answered where its frame was read whose
// answer finds no credit or buffer at hand sends it aside, with the pool
// tensor its reply views; the answer arrives, and once the Server has
// stopped that tensor is back in the pool (the pair's cleanup checks),
// even when the session ends right after the answer arrived.
func TestCallAnswerAside(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			s.Handle("echo", func(ctx context.Context, in *Message) (*Message, error) {
				o, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(len(in.Tensors[0].Bytes()))})
				if err != nil {
					return nil, err
				}
				copy(o.Bytes(), in.Tensors[0].Bytes())
				return &Message{Tensors: []*Tensor{o}}, nil
			}, Inline())
			answerAsideForTest.Store(true)
			defer answerAsideForTest.Store(false)
			for i := range 5 {
				b := make([]byte, 4<<10)
				pattern(b, byte(i))
				reply, err := c.Call(ctxT(t), "echo", &Message{Tensors: []*Tensor{WrapTensor(mustTensorInternal(t, b))}})
				if err != nil {
					t.Fatalf("call %d: %v", i, err)
				}
				if !bytes.Equal(reply.Tensors[0].Bytes(), b) {
					t.Fatalf("call %d: the reply differs", i)
				}
				reply.Release()
			}
		})
	}
}

func mustTensorInternal(t *testing.T, b []byte) zerocopy.Tensor {
	t.Helper()
	zt, err := zerocopy.New(zerocopy.Uint8, []int64{int64(len(b))}, b)
	if err != nil {
		t.Fatal(err)
	}
	return zt
}
