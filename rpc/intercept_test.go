package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// planes are the data planes the black-box tests run on: both sides allow
// the plane and the fallback, so a session on one that cannot open here
// fails the test instead of silently testing another.
var planes = []string{rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newBytes makes a uint8 tensor of n bytes of the Client's pool, filled
// with seed.
func newBytes(t *testing.T, c *rpc.Client, n int, seed byte) *rpc.Tensor {
	t.Helper()
	x, err := c.NewTensor(testCtx(t), zerocopy.Uint8, []int64{int64(n)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range x.Bytes() {
		x.Bytes()[i] = seed + byte(i)
	}
	return x
}

// seen is what an interceptor saw of one call.
type seen struct {
	op        rpc.Operation
	name      string
	path      string
	transport string
	code      codes.Code
	req, resp int64
	md        metadata.MD
}

// recorder is an interceptor that records every call it sees, in order,
// into a log shared with other recorders (so the order between them
// shows).
type recorder struct {
	name string
	mu   *sync.Mutex
	log  *[]string
	got  []seen
}

func newRecorders(names ...string) []*recorder {
	mu, log := &sync.Mutex{}, &[]string{}
	var rs []*recorder
	for _, n := range names {
		rs = append(rs, &recorder{name: n, mu: mu, log: log})
	}
	return rs
}

func (r *recorder) intercept(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
	r.mu.Lock()
	*r.log = append(*r.log, r.name+">"+string(info.Op))
	r.mu.Unlock()
	err := next(ctx)
	md, _ := metadata.FromIncomingContext(ctx)
	if info.Client {
		md, _ = metadata.FromOutgoingContext(ctx)
	}
	r.mu.Lock()
	*r.log = append(*r.log, r.name+"<"+string(info.Op))
	r.got = append(r.got, seen{op: info.Op, name: info.Name, path: info.Path, transport: info.Transport, code: status.Code(err), req: info.RequestBytes, resp: info.ResponseBytes, md: md})
	r.mu.Unlock()
	return err
}

func interceptors(rs []*recorder) rpc.Option {
	var is []rpc.Interceptor
	for _, r := range rs {
		is = append(is, r.intercept)
	}
	return rpc.WithInterceptors(is...)
}

// inlineInterceptors is interceptors given with WithInlineInterceptors.
func inlineInterceptors(rs []*recorder) rpc.Option {
	var is []rpc.Interceptor
	for _, r := range rs {
		is = append(is, r.intercept)
	}
	return rpc.WithInlineInterceptors(is...)
}

// TestInterceptorsSeeEveryCall: a chain of two interceptors on each side
// sees every Fetch, Send and Call exactly once, in order (the first
// outermost), with the operation, name, path, transport, bytes and status
// of each, on every plane; tensors small enough to go inline and large
// ones that take the data plane; given with WithInterceptors and with
// WithInlineInterceptors (whose calls the server may serve where it reads
// them: the small Fetch, the Inline method's calls).
func TestInterceptorsSeeEveryCall(t *testing.T) {
	for _, plane := range planes {
		for _, inline := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/inline=%v", plane, inline), func(t *testing.T) {
				interceptorsSeeEveryCall(t, plane, inline)
			})
		}
	}
}

func interceptorsSeeEveryCall(t *testing.T, plane string, inline bool) {
	{
		{
			srvRec := newRecorders("s1", "s2")
			cliRec := newRecorders("c1", "c2")
			with := interceptors
			if inline {
				with = inlineInterceptors
			}
			e := start(t, plane, []rpc.ServerOption{with(srvRec)}, []rpc.DialOption{with(cliRec)})
			e.srv.Handle("double", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
				return &rpc.Message{Metadata: req.Metadata, Tensors: req.Tensors[:1]}, nil
			}, rpc.Inline())
			e.srv.Handle("fail", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
				return nil, status.Error(codes.FailedPrecondition, "no")
			})
			ctx := testCtx(t)
			path := rpc.PathFrame
			if plane == rpc.TransportGRPC {
				path = rpc.PathStream
			}
			type call struct {
				op        rpc.Operation
				name      string
				code      codes.Code
				req, resp int64
			}
			var want []call
			for _, n := range []int{100, 1 << 20} {
				x := newBytes(t, e.c, n, 7)
				key := fmt.Sprintf("k%d", n)
				if err := e.c.Send(ctx, key, x); err != nil {
					t.Fatal(err)
				}
				got, err := e.c.Fetch(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got.Bytes(), x.Bytes()) {
					t.Errorf("Fetch %s: wrong bytes", key)
				}
				got.Release()
				reply, err := e.c.Call(ctx, "double", &rpc.Message{Metadata: []byte("m"), Tensors: []*rpc.Tensor{x, x}})
				if err != nil {
					t.Fatal(err)
				}
				reply.Release()
				x.Release()
				want = append(want,
					call{rpc.OpSend, key, codes.OK, int64(n), 0},
					call{rpc.OpFetch, key, codes.OK, 0, int64(n)},
					call{rpc.OpCall, "double", codes.OK, 2 * int64(n), int64(n)})
			}
			if _, err := e.c.Fetch(ctx, "absent"); status.Code(err) != codes.NotFound {
				t.Errorf("Fetch of an absent key: %v, want NotFound", err)
			}
			if _, err := e.c.Call(ctx, "fail", nil); status.Code(err) != codes.FailedPrecondition {
				t.Errorf("Call of a failing method: %v, want FailedPrecondition", err)
			}
			want = append(want, call{rpc.OpFetch, "absent", codes.NotFound, 0, 0}, call{rpc.OpCall, "fail", codes.FailedPrecondition, 0, 0})

			for _, rs := range [][]*recorder{cliRec, srvRec} {
				var order []string
				for _, w := range want {
					order = append(order, rs[0].name+">"+string(w.op), rs[1].name+">"+string(w.op), rs[1].name+"<"+string(w.op), rs[0].name+"<"+string(w.op))
				}
				rs[0].mu.Lock() // shared by the recorders of rs
				log := strings.Join(*rs[0].log, " ")
				got := [][]seen{rs[0].got, rs[1].got}
				rs[0].mu.Unlock()
				if log != strings.Join(order, " ") {
					t.Errorf("%s,%s saw\n  %s\nwant\n  %s", rs[0].name, rs[1].name, log, strings.Join(order, " "))
				}
				for j, r := range rs {
					if len(got[j]) != len(want) {
						t.Fatalf("%s saw %d calls, want %d: %+v", r.name, len(got[j]), len(want), got[j])
					}
					for i, w := range want {
						g := got[j][i]
						if g.op != w.op || g.name != w.name || g.code != w.code || g.path != path || g.transport != plane {
							t.Errorf("%s call %d: %s %q %s on %s/%s, want %s %q %s on %s/%s", r.name, i, g.op, g.name, g.code, g.transport, g.path, w.op, w.name, w.code, plane, path)
						}
						if w.code == codes.OK && (g.req != w.req || g.resp != w.resp) {
							t.Errorf("%s call %d (%s %q): %d bytes in, %d out; want %d, %d", r.name, i, g.op, g.name, g.req, g.resp, w.req, w.resp)
						}
					}
				}
			}
		}
	}
}

// TestInterceptorsSeeUnaryCalls: a client with only the .proto calls the
// unary methods; the server's interceptors see each call once, as unary,
// with the caller's gRPC metadata in its context, and the handler sees it
// and the caller's deadline too.
func TestInterceptorsSeeUnaryCalls(t *testing.T) {
	srvRec := newRecorders("s1", "s2")
	e := start(t, rpc.TransportTCP, []rpc.ServerOption{interceptors(srvRec)}, nil)
	handlerMD := make(chan metadata.MD, 1)
	handlerDL := make(chan time.Time, 1)
	e.srv.Handle("echo", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		handlerMD <- md
		dl, _ := ctx.Deadline()
		handlerDL <- dl
		return &rpc.Message{Metadata: req.Metadata}, nil
	})
	cc, err := grpc.NewClient(e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	api := pb.NewTensorRPCClient(cc)
	deadline := time.Now().Add(40 * time.Second)
	dctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	ctx := metadata.AppendToOutgoingContext(dctx, "x-user", "ada")
	if _, err := api.Call(ctx, &pb.CallRequest{Method: "echo", Metadata: []byte("hi")}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.Fetch(ctx, &pb.FetchRequest{Key: "absent"}); status.Code(err) != codes.NotFound {
		t.Errorf("Fetch: %v, want NotFound", err)
	}
	if _, err := api.Send(ctx, &pb.SendRequest{Meta: &pb.TensorMeta{Key: "u", Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{3}, ByteLength: 3}, InlineData: []byte{1, 2, 3}}); err != nil {
		t.Fatal(err)
	}
	if md := <-handlerMD; len(md.Get("x-user")) != 1 || md.Get("x-user")[0] != "ada" {
		t.Errorf("handler saw metadata %v", md)
	}
	if dl := <-handlerDL; dl.IsZero() || dl.After(deadline.Add(5*time.Second)) || dl.Before(deadline.Add(-20*time.Second)) {
		t.Errorf("handler deadline %v, caller's %v", dl, deadline)
	}
	want := []struct {
		op   rpc.Operation
		code codes.Code
	}{{rpc.OpCall, codes.OK}, {rpc.OpFetch, codes.NotFound}, {rpc.OpSend, codes.OK}}
	srvRec[0].mu.Lock() // shared by the recorders
	defer srvRec[0].mu.Unlock()
	for _, r := range srvRec {
		if len(r.got) != len(want) {
			t.Fatalf("%s saw %d calls, want %d", r.name, len(r.got), len(want))
		}
		for i, w := range want {
			g := r.got[i]
			if g.op != w.op || g.code != w.code || g.path != rpc.PathUnary {
				t.Errorf("%s call %d: %s %s %s, want %s %s unary", r.name, i, g.op, g.code, g.path, w.op, w.code)
			}
			if v := g.md.Get("x-user"); len(v) != 1 || v[0] != "ada" {
				t.Errorf("%s call %d: metadata %v", r.name, i, g.md)
			}
		}
	}
}

// TestMetadataAndDeadline: on every plane, the handler (and, for Fetch and
// Send, the server's interceptor) sees the caller's metadata, binary
// values included, and its deadline; metadata a client interceptor adds
// arrives too, with metadata.AppendToOutgoingContext or with
// CallInfo.AddMetadata.
func TestMetadataAndDeadline(t *testing.T) {
	for _, plane := range planes {
		t.Run(plane, func(t *testing.T) {
			var mu sync.Mutex
			var seenMD []metadata.MD
			var seenDL []time.Time
			record := func(ctx context.Context) {
				md, _ := metadata.FromIncomingContext(ctx)
				dl, _ := ctx.Deadline()
				mu.Lock()
				seenMD = append(seenMD, md)
				seenDL = append(seenDL, dl)
				mu.Unlock()
			}
			onServer := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				if info.Op != rpc.OpCall {
					record(ctx)
				}
				return next(ctx)
			}
			addTrace := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				return next(metadata.AppendToOutgoingContext(ctx, "traceparent", "00-abc-def-01"))
			}
			addInfo := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				info.AddMetadata("X-Added", "yes")
				return next(ctx)
			}
			e := start(t, plane, []rpc.ServerOption{rpc.WithInterceptors(onServer)}, []rpc.DialOption{rpc.WithInterceptors(addTrace, addInfo)})
			e.srv.Handle("look", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
				record(ctx)
				return nil, nil
			})
			deadline := time.Now().Add(40 * time.Second)
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			defer cancel()
			bin := string([]byte{0, 1, 0xff, '\n'})
			ctx = metadata.AppendToOutgoingContext(ctx, "x-user", "ada", "x-user", "bob", "blob-bin", bin)
			x := newBytes(t, e.c, 1<<20, 3)
			defer x.Release()
			if err := e.c.Send(ctx, "k", x); err != nil {
				t.Fatal(err)
			}
			got, err := e.c.Fetch(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			got.Release()
			if _, err := e.c.Call(ctx, "look", nil); err != nil {
				t.Fatal(err)
			}
			// A request too large for a slot (it travels indirect on a
			// data plane) carries them too.
			if _, err := e.c.Call(ctx, "look", &rpc.Message{Metadata: make([]byte, 64<<10)}); err != nil {
				t.Fatal(err)
			}
			mu.Lock() // the server's goroutines wrote them; over shm no Go synchronisation links the two
			defer mu.Unlock()
			if len(seenMD) != 4 {
				t.Fatalf("saw %d calls, want 4", len(seenMD))
			}
			for i, md := range seenMD {
				if v := md.Get("x-user"); len(v) != 2 || v[0] != "ada" || v[1] != "bob" {
					t.Errorf("call %d: x-user %q", i, v)
				}
				if v := md.Get("blob-bin"); len(v) != 1 || v[0] != bin {
					t.Errorf("call %d: blob-bin %q", i, v)
				}
				if v := md.Get("traceparent"); len(v) != 1 || v[0] != "00-abc-def-01" {
					t.Errorf("call %d: traceparent %q (added by the client's interceptor)", i, v)
				}
				if v := md["x-added"]; len(v) != 1 || v[0] != "yes" {
					t.Errorf("call %d: x-added %q (added with CallInfo.AddMetadata)", i, v)
				}
				// The deadline travels as the time left: the server's is
				// the caller's, give or take the time on the way.
				if dl := seenDL[i]; dl.IsZero() || dl.After(deadline.Add(5*time.Second)) || dl.Before(deadline.Add(-20*time.Second)) {
					t.Errorf("call %d: handler deadline %v, caller's %v", i, dl, deadline)
				}
			}
		})
	}
}

// TestDeadlinePassesInHandler: a call whose deadline passes while its
// handler runs fails with DeadlineExceeded, and the handler's context is
// done, on every plane.
func TestDeadlinePassesInHandler(t *testing.T) {
	for _, plane := range planes {
		t.Run(plane, func(t *testing.T) {
			e := start(t, plane, nil, nil)
			done := make(chan error, 1)
			e.srv.Handle("slow", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
				select {
				case <-ctx.Done():
					done <- ctx.Err()
					return nil, ctx.Err()
				case <-time.After(30 * time.Second):
					done <- errors.New("the handler's context never ended")
					return nil, nil
				}
			})
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			_, err := e.c.Call(ctx, "slow", nil)
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("Call: %v, want DeadlineExceeded", err)
			}
			if err := <-done; err == nil || !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				t.Errorf("handler's context: %v", err)
			}
		})
	}
}

// TestMetadataTooLarge: metadata over MaxFrameMetadataBytes fails a call on
// a data plane with ResourceExhausted before anything is sent; the session
// goes on.
func TestMetadataTooLarge(t *testing.T) {
	for _, plane := range []string{rpc.TransportSHM, rpc.TransportTCP} {
		t.Run(plane, func(t *testing.T) {
			e := start(t, plane, nil, nil)
			e.srv.Handle("nop", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) { return nil, nil })
			big := metadata.AppendToOutgoingContext(testCtx(t), "x-big", strings.Repeat("a", rpc.MaxFrameMetadataBytes))
			if _, err := e.c.Call(big, "nop", nil); status.Code(err) != codes.ResourceExhausted {
				t.Errorf("Call with %d bytes of metadata: %v, want ResourceExhausted", rpc.MaxFrameMetadataBytes, err)
			}
			if _, err := e.c.Call(testCtx(t), "nop", nil); err != nil {
				t.Errorf("the next call: %v", err)
			}
		})
		// Just under the bound goes, also with the smallest slots (an
		// eager threshold of 0).
		t.Run(plane+"/eager=0", func(t *testing.T) {
			e := start(t, plane, []rpc.ServerOption{rpc.WithEagerThreshold(0)}, nil)
			e.srv.Handle("nop", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) { return nil, nil })
			fits := metadata.AppendToOutgoingContext(testCtx(t), "x-big", strings.Repeat("a", rpc.MaxFrameMetadataBytes-64))
			if _, err := e.c.Call(fits, "nop", nil); err != nil {
				t.Errorf("Call with %d bytes of metadata, eager threshold 0: %v", rpc.MaxFrameMetadataBytes-64, err)
			}
		})
	}
}

// onFramePath reports whether the calling goroutine is serving a frame
// where its lane's frames are read (its stack runs through the Server's
// frame handler), not on a goroutine of the call's own.
func onFramePath() bool {
	buf := make([]byte, 64<<10)
	return strings.Contains(string(buf[:runtime.Stack(buf, false)]), "rpc.(*Server).serveFrame(")
}

// TestInlineInterceptorsKeepTheFramePath: with interceptors given by
// WithInlineInterceptors only, a small Fetch of a published tensor and a
// call of an Inline method are served (and intercepted) where the lane's
// frames are read, as without interceptors; one interceptor given by
// WithInterceptors moves every call to a goroutine of its own, on tcp
// and shm.
func TestInlineInterceptorsKeepTheFramePath(t *testing.T) {
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		for _, mode := range []string{"inline", "blocking", "both"} {
			t.Run(plane+"/"+mode, func(t *testing.T) {
				var mu sync.Mutex
				where := map[rpc.Operation][]bool{}
				look := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
					on := onFramePath()
					mu.Lock()
					where[info.Op] = append(where[info.Op], on)
					mu.Unlock()
					return next(ctx)
				}
				pass := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
					return next(ctx)
				}
				var so []rpc.ServerOption
				switch mode {
				case "inline":
					so = []rpc.ServerOption{rpc.WithInlineInterceptors(look)}
				case "blocking":
					so = []rpc.ServerOption{rpc.WithInterceptors(look)}
				case "both":
					so = []rpc.ServerOption{rpc.WithInlineInterceptors(look), rpc.WithInterceptors(pass)}
				}
				e := start(t, plane, so, nil)
				e.srv.Handle("echo", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
					return &rpc.Message{Tensors: req.Tensors}, nil
				}, rpc.Inline())
				ctx := testCtx(t)
				x := newBytes(t, e.c, 256, 1)
				defer x.Release()
				if err := e.srv.Publish(ctx, "small", x); err != nil {
					t.Fatal(err)
				}
				for range 3 {
					got, err := e.c.Fetch(ctx, "small")
					if err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got.Bytes(), x.Bytes()) {
						t.Error("Fetch: wrong bytes")
					}
					got.Release()
					reply, err := e.c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{x}})
					if err != nil {
						t.Fatal(err)
					}
					reply.Release()
				}
				mu.Lock()
				defer mu.Unlock()
				for _, op := range []rpc.Operation{rpc.OpFetch, rpc.OpCall} {
					if len(where[op]) != 3 {
						t.Fatalf("the interceptor saw %d %ss, want 3", len(where[op]), op)
					}
					for i, on := range where[op] {
						if want := mode == "inline"; on != want {
							t.Errorf("%s %d: served on the frame path: %v, want %v", op, i, on, want)
						}
					}
				}
			})
		}
	}
}

// TestAfterAnswer: what a server interceptor defers with AfterAnswer runs
// once per call, after the answer has gone where the call travelled as a
// frame: here it waits for the client to have its answer, which it could
// not have if it ran first. On the grpc plane, and on the client, it runs
// as the interceptors return. Fetch and Call, inline interceptors.
func TestAfterAnswer(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			frames := tr != rpc.TransportGRPC
			var got atomic.Int32 // calls the client has its answer of
			var ran atomic.Int32 // deferred funcs run on the server
			var clientRan atomic.Int32
			fail := make(chan string, 16)
			serverSide := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				want := got.Load() + 1
				info.AfterAnswer(func() {
					if frames {
						deadline := time.Now().Add(10 * time.Second)
						for got.Load() < want {
							if time.Now().After(deadline) {
								fail <- fmt.Sprintf("%s %s: ran before its answer reached the client", info.Op, info.Name)
								break
							}
							runtime.Gosched()
						}
					}
					ran.Add(1)
				})
				return next(ctx)
			}
			clientSide := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				err := next(ctx)
				info.AfterAnswer(func() { clientRan.Add(1) })
				return err
			}
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithInlineInterceptors(serverSide)}, []rpc.DialOption{rpc.WithInlineInterceptors(clientSide)})
			s.Handle("echo", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				return &rpc.Message{Metadata: in.Metadata}, nil
			})
			ctx := ctxT(t)
			publishBytes(t, s, "small", 4<<10, 1)
			const calls = 5
			for i := range calls {
				// Without a deadline: answered where the frame is read
				// (fetchNowIntercepted); the Call runs runFrameCall.
				tt, err := c.Fetch(context.Background(), "small")
				if err != nil {
					t.Fatal(err)
				}
				tt.Release()
				got.Add(1)
				reply, err := c.Call(ctx, "echo", &rpc.Message{Metadata: []byte{byte(i)}})
				if err != nil {
					t.Fatal(err)
				}
				reply.Release()
				got.Add(1)
			}
			waitFor(t, "every deferred func", func() bool { return ran.Load() == 2*calls })
			select {
			case msg := <-fail:
				t.Fatal(msg)
			default:
			}
			if n := clientRan.Load(); n != 2*calls {
				t.Fatalf("client: deferred funcs ran %d times, want %d", n, 2*calls)
			}
		})
	}
}

// TestIncomingMetadata: a server interceptor reads the call's metadata
// from its CallInfo, on every plane, for a Fetch and a Call: what the
// client sent (with the metadata package or AddMetadata), nil when it sent
// none, and the same from its context (which a Fetch answered where its
// frame was read decodes only then); a client's CallInfo has none.
func TestIncomingMetadata(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			var mu sync.Mutex
			var seen []string
			server := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				md := info.IncomingMetadata()
				// The context carries the same, however it is read.
				fromCtx, _ := metadata.FromIncomingContext(ctx)
				if a, b, c := fmt.Sprint(md.Get("k"), md.Get("added")), fmt.Sprint(fromCtx.Get("k"), fromCtx.Get("added")), fmt.Sprint(metadata.ValueFromIncomingContext(ctx, "k"), metadata.ValueFromIncomingContext(ctx, "added")); a != b || len(md.Get("k"))+len(md.Get("added")) != len(metadata.ValueFromIncomingContext(ctx, "k"))+len(metadata.ValueFromIncomingContext(ctx, "added")) {
					t.Errorf("%s: IncomingMetadata has %s, the context %s and %s", info.Op, a, b, c)
				}
				mu.Lock()
				seen = append(seen, fmt.Sprintf("%s:%v:%v", info.Op, md.Get("k"), md.Get("added")))
				mu.Unlock()
				return next(ctx)
			}
			add := true
			client := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				if info.IncomingMetadata() != nil {
					t.Error("a client's CallInfo has incoming metadata")
				}
				if add {
					info.AddMetadata("Added", "a")
				}
				return next(ctx)
			}
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithInlineInterceptors(server)}, []rpc.DialOption{rpc.WithInlineInterceptors(client)})
			s.Handle("echo", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) { return &rpc.Message{}, nil })
			publishBytes(t, s, "small", 64, 1)
			call := func(ctx context.Context) {
				tt, err := c.Fetch(ctx, "small")
				if err != nil {
					t.Fatal(err)
				}
				tt.Release()
				reply, err := c.Call(ctx, "echo", &rpc.Message{})
				if err != nil {
					t.Fatal(err)
				}
				reply.Release()
			}
			call(metadata.AppendToOutgoingContext(context.Background(), "k", "v"))
			add = false
			call(context.Background())
			mu.Lock()
			defer mu.Unlock()
			want := "[Fetch:[v]:[a] Call:[v]:[a] Fetch:[]:[] Call:[]:[]]"
			if got := fmt.Sprint(seen); got != want {
				t.Fatalf("the server's interceptor read %s, want %s", got, want)
			}
		})
	}
}
