// White-box: a hostile server speaks frames on the client's own links to attack the client.

package rpc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
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
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Attacks on the client's frame handling, by a hostile or broken server:
// a real Server whose session lanes hand the client's request frames to
// the test instead of serving them, and answer with the frames the test
// sends. Whatever the server does, a client call returns within its
// context, never panics, never gets another call's answer, and leaks
// nothing; Client.Close returns in bounded time.

// hostileReq is a request frame the hostile server took.
type hostileReq struct {
	lane int
	h    wire.FrameHeader
	body []byte
}

// hostileServer is a real server's session whose lanes the test drives.
type hostileServer struct {
	t     *testing.T
	s     *Server
	c     *Client
	ss    *serverSession
	reqs  chan hostileReq
	serve atomic.Bool // forward requests to the real server
}

// newHostileServer starts a pair over transport with frames, takes the
// server's session and makes its lanes give every request frame to the
// test (unless serve is set). The client is closed at the end, in bounded
// time, with nothing of its pools left.
func newHostileServer(t *testing.T, transport string, serverOpts []ServerOption, clientOpts []DialOption) *hostileServer {
	t.Helper()
	hs := &hostileServer{t: t, reqs: make(chan hostileReq, 4096)}
	var first atomic.Pointer[serverSession]
	// The hook is in place before the session's lanes poll: only the
	// first session's lanes are hostile; later ones serve as usual.
	hook := serverOption(func(o *options) {
		o.frameServe = func(ss *serverSession, i int, orig func(wire.FrameHeader, []byte)) func(wire.FrameHeader, []byte) {
			if !first.CompareAndSwap(nil, ss) && first.Load() != ss {
				return orig
			}
			return func(h wire.FrameHeader, body []byte) {
				if hs.serve.Load() {
					orig(h, body)
					return
				}
				if h.Flags&wire.FlagHeaders != 0 { // the hostile server reads the body alone
					if _, rest, err := splitHeaders(body); err == nil {
						body = rest
					}
				}
				select {
				case hs.reqs <- hostileReq{lane: i, h: h, body: bytes.Clone(body)}:
				default:
				}
			}
		}
	})
	// One lane unless the test asks for more: the tests follow a
	// session's calls on its lane.
	serverOpts = append([]ServerOption{WithLanes(1)}, serverOpts...)
	clientOpts = append([]DialOption{WithLanes(1)}, clientOpts...)
	s, c := pair(t, transport, append(slices.Clone(serverOpts), hook), clientOpts)
	if c.last.link == nil || c.last.link.Frames == nil {
		t.Fatal("no frames")
	}
	hs.s, hs.c, hs.ss = s, c, serverSessionOf(t, s)
	if first.Load() != hs.ss {
		t.Fatal("the hostile lanes are not the session's")
	}
	t.Cleanup(func() { closeWithin(t, c, 15*time.Second) })
	return hs
}

// closeWithin closes c, failing when that takes longer than d or leaves
// buffers of its pools in use.
func closeWithin(t *testing.T, c *Client, d time.Duration) {
	t.Helper()
	closeOrRelease(t, c, d, func() {})
	if n := c.ctl.Stats().InUse; n != 0 {
		t.Errorf("client control pool: %d bytes in use after Close", n)
	}
}

// next is the next request frame the server took (RELEASE frames
// skipped).
func (hs *hostileServer) next(within time.Duration) hostileReq {
	hs.t.Helper()
	deadline := time.After(within)
	for {
		select {
		case r := <-hs.reqs:
			if r.h.Type == wire.FrameRelease {
				continue
			}
			return r
		case <-deadline:
			hs.t.Fatal("no request frame reached the server")
			return hostileReq{}
		}
	}
}

// lane is a sender of raw frames on the server's lane i.
func (hs *hostileServer) lane(i int) *attacker {
	return &attacker{t: hs.t, l: hs.ss.lanes[i]}
}

// answer sends a response frame on the lane the request came on.
func (hs *hostileServer) answer(r hostileReq, typ uint8, flags uint16, body []byte) {
	hs.t.Helper()
	hs.answerRef(r.lane, typ, flags, r.h.Ref, body)
}

func (hs *hostileServer) answerRef(lane int, typ uint8, flags uint16, ref uint64, body []byte) {
	hs.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := hs.lane(lane).send(ctx, wire.FrameHeader{Type: typ, Flags: flags, Ref: ref}, body, nil); err != nil {
		hs.t.Logf("sending a frame of type %d: %v", typ, err)
	}
}

// offer makes a real transfer of the published key on lane i, as the
// server's Fetch does: its FetchResponse.
func (hs *hostileServer) offer(i int, ref uint64, key string) *pb.FetchResponse {
	hs.t.Helper()
	e, err := hs.s.rv.TryFetch(key)
	if err != nil {
		hs.t.Fatal(err)
	}
	resp := &pb.FetchResponse{}
	resp.Meta, resp.InlineData, resp.TransferId, err = hs.s.offer(hs.ss.Context(), hs.ss, hs.ss.lanes[i], ref, key, e.Tensor, e.Buf, -1, nil)
	if err != nil {
		hs.t.Fatal(err)
	}
	resp.Meta.TransferId = 0
	return resp
}

// eventuallyGone reports whether c's session ends within 5s (a call on
// a failed lane may return before the session's watcher has ended it).
func eventuallyGone(c *Client) bool {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if sessionGone(c) {
			return true
		}
	}
	return false
}

// statusBody is a response body with an error status.
func statusBody(err error) []byte { return engine.AppendStatus(nil, err, 1<<20) }

// started runs f in a goroutine; its error comes on the channel.
func started(f func() error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	return done
}

func waitErr(t *testing.T, ch <-chan error, d time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
		return nil
	}
}

func shortCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestHostileServerSanity: the hook itself: a Fetch the test answers by
// hand, inline and by a real transfer, and a Call answered with a crafted
// CallResponse, all succeed with exactly the bytes sent.
func TestHostileServerSanity(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	want := publishBytes(t, hs.s, "big", 1<<20, 7)
	ch := started(func() error {
		got, err := c.Fetch(shortCtx(t, 10*time.Second), "big")
		if err != nil {
			return err
		}
		defer got.Release()
		if !bytes.Equal(got.Bytes(), want) {
			return errors.New("other bytes")
		}
		return nil
	})
	r := hs.next(5 * time.Second)
	if r.h.Type != wire.FrameFetchReq || string(r.body) != "big" {
		t.Fatalf("request %+v %q", r.h, r.body)
	}
	hs.answer(r, wire.FrameFetchResp, 0, okBody(hs.offer(r.lane, r.h.Ref, "big")))
	if err := waitErr(t, ch, 10*time.Second, "Fetch"); err != nil {
		t.Fatal(err)
	}

	ch = started(func() error {
		reply, err := c.Call(shortCtx(t, 10*time.Second), "m", &Message{Metadata: []byte("x")})
		if err != nil {
			return err
		}
		defer reply.Release()
		if string(reply.Metadata) != "meta" || len(reply.Tensors) != 1 || !bytes.Equal(reply.Tensors[0].Bytes(), []byte{1, 2, 3}) {
			return errors.New("another reply")
		}
		return nil
	})
	r = hs.next(5 * time.Second)
	if r.h.Type != wire.FrameCallReq {
		t.Fatalf("request %+v", r.h)
	}
	idx := uint32(0)
	hs.answer(r, wire.FrameCallResp, 0, okBody(&pb.CallResponse{Metadata: []byte("meta"), InlineData: [][]byte{{1, 2, 3}},
		Tensors: []*pb.TensorMeta{{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{3}, ByteLength: 3, InlineIndex: &idx}}}))
	if err := waitErr(t, ch, 10*time.Second, "Call"); err != nil {
		t.Fatal(err)
	}
	if sessionGone(c) {
		t.Fatal("the session ended")
	}
}

// fetchInline is the body of an OK FETCH_RESP carrying b inline.
func fetchInline(key string, b []byte) []byte {
	return okBody(&pb.FetchResponse{Meta: &pb.TensorMeta{Key: key, Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{int64(len(b))}, ByteLength: uint64(len(b))}, InlineData: b})
}

// fetchBytes fetches key and returns its bytes.
func fetchBytes(ctx context.Context, c *Client, key string) ([]byte, error) {
	got, err := c.Fetch(ctx, key)
	if err != nil {
		return nil, err
	}
	defer got.Release()
	return bytes.Clone(got.Bytes()), nil
}

// TestHostileServerStrayAndDuplicateAnswers: answers to refs nobody waits
// for (of every response type), and a second answer to a ref already
// answered, are dropped: each call gets its own answer, the session goes
// on.
func TestHostileServerStrayAndDuplicateAnswers(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	ctx := shortCtx(t, 10*time.Second)
	type res struct {
		b   []byte
		err error
	}
	a, b := make(chan res, 1), make(chan res, 1)
	go func() { x, err := fetchBytes(ctx, c, "a"); a <- res{x, err} }()
	ra := hs.next(5 * time.Second)
	go func() { x, err := fetchBytes(ctx, c, "b"); b <- res{x, err} }()
	rb := hs.next(5 * time.Second)
	if string(ra.body) != "a" || string(rb.body) != "b" {
		t.Fatalf("requests %q, %q", ra.body, rb.body)
	}
	for _, typ := range []uint8{wire.FrameFetchResp, wire.FrameSendResp, wire.FrameCallResp} {
		hs.answerRef(ra.lane, typ, 0, ra.h.Ref^rb.h.Ref|1, statusBody(status.Error(codes.Internal, "stray")))
	}
	hs.answer(ra, wire.FrameFetchResp, 0, fetchInline("a", []byte("AAAA")))
	hs.answer(ra, wire.FrameFetchResp, 0, fetchInline("a", []byte("XXXX")))
	hs.answer(ra, wire.FrameFetchResp, 0, statusBody(status.Error(codes.NotFound, "late")))
	hs.answer(rb, wire.FrameFetchResp, 0, fetchInline("b", []byte("BB")))
	ga, gb := <-a, <-b
	if ga.err != nil || string(ga.b) != "AAAA" {
		t.Fatalf("fetch a: %q, %v", ga.b, ga.err)
	}
	if gb.err != nil || string(gb.b) != "BB" {
		t.Fatalf("fetch b: %q, %v", gb.b, gb.err)
	}
	// A duplicate that arrives after the call returned is dropped too.
	hs.answer(rb, wire.FrameFetchResp, 0, fetchInline("b", []byte("ZZ")))
	ch := started(func() error {
		x, err := fetchBytes(ctx, c, "c")
		if err == nil && string(x) != "C" {
			err = errors.New("fetch c: another answer")
		}
		return err
	})
	rc := hs.next(5 * time.Second)
	hs.answer(rc, wire.FrameFetchResp, 0, fetchInline("c", []byte("C")))
	if err := waitErr(t, ch, 10*time.Second, "fetch c"); err != nil {
		t.Fatal(err)
	}
	if sessionGone(c) {
		t.Fatal("stray answers ended the session")
	}
}

// TestHostileServerAnswerOfAnotherType: a response of another type to a
// pending ref breaks the protocol: the session ends and every call under
// way on it returns Unavailable at once (not at its deadline); the next
// call opens a new session.
func TestHostileServerAnswerOfAnotherType(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	publishBytes(t, hs.s, "k", 100, 1)
	ctx := shortCtx(t, 20*time.Second)
	start := time.Now()
	fetch := started(func() error { _, err := fetchBytes(ctx, c, "k"); return err })
	r1 := hs.next(5 * time.Second)
	call := started(func() error {
		reply, err := c.Call(ctx, "m", &Message{})
		if err == nil {
			reply.Release()
		}
		return err
	})
	hs.next(5 * time.Second)
	hs.answer(r1, wire.FrameCallResp, 0, okBody(&pb.CallResponse{}))
	for what, ch := range map[string]<-chan error{"fetch": fetch, "call": call} {
		if err := waitErr(t, ch, 10*time.Second, what); status.Code(err) != codes.Unavailable {
			t.Errorf("%s: %v, want Unavailable", what, err)
		}
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("the calls took %v to hear of the broken session", el)
	}
	if !eventuallyGone(c) {
		t.Fatal("the session survived an answer of the wrong type")
	}
	// The next session is a real server's.
	got, err := fetchBytes(ctx, c, "k")
	if err != nil || len(got) != 100 {
		t.Fatalf("fetch on a new session: %d bytes, %v", len(got), err)
	}
}

// TestHostileServerFetchLies: a FETCH_RESP whose answer lies (about its
// location, length, shape, transfer, lanes or body) fails the Fetch with
// an error, within its deadline, with nothing of the client's pool kept
// and the server's transfer released.
func TestHostileServerFetchLies(t *testing.T) {
	const n = 1 << 20
	cases := map[string]struct {
		mutate func(r *pb.FetchResponse) []byte // nil: okBody(r)
		codes  []codes.Code
	}{
		"location length": {func(r *pb.FetchResponse) []byte { r.Meta.Location.Length = 1 << 40; return nil }, []codes.Code{codes.InvalidArgument}},
		"huge": {func(r *pb.FetchResponse) []byte {
			r.Meta.Shape, r.Meta.ByteLength, r.Meta.Location.Length = []int64{1 << 45}, 1<<45, 1<<45
			return nil
		}, []codes.Code{codes.ResourceExhausted}},
		"longer than the grant": {func(r *pb.FetchResponse) []byte {
			r.Meta.Shape, r.Meta.ByteLength, r.Meta.Location.Length = []int64{4 * n}, 4*n, 4*n
			return nil
		}, []codes.Code{codes.PermissionDenied}},
		"no transfer": {func(r *pb.FetchResponse) []byte { r.TransferId = 0; return nil }, []codes.Code{codes.InvalidArgument}},
		"bogus lanes": {func(r *pb.FetchResponse) []byte {
			r.Meta.Location.Lanes = []*pb.LaneRemote{{RemoteKey: 1, Address: 2}, {RemoteKey: 3, Address: 4}, {}}
			return nil
		}, []codes.Code{codes.OK}}, // one lane: the lanes are not read
		"no meta":         {func(r *pb.FetchResponse) []byte { r.Meta = nil; return nil }, []codes.Code{codes.InvalidArgument}},
		"empty body":      {func(r *pb.FetchResponse) []byte { return engine.AppendStatus(nil, nil, 0) }, []codes.Code{codes.InvalidArgument}},
		"garbage body":    {func(r *pb.FetchResponse) []byte { return append(engine.AppendStatus(nil, nil, 0), 0xff, 0xff, 0xff) }, []codes.Code{codes.Internal}},
		"short status":    {func(r *pb.FetchResponse) []byte { return []byte{1} }, []codes.Code{codes.Internal}},
		"status and body": {func(r *pb.FetchResponse) []byte { return append(statusBody(status.Error(codes.NotFound, "x")), 1) }, []codes.Code{codes.Internal}},
		"status length":   {func(r *pb.FetchResponse) []byte { return []byte{0xff, 0xff, 0xff, 0xff, 1} }, []codes.Code{codes.Internal}},
		"inline and location": {func(r *pb.FetchResponse) []byte { r.InlineData = make([]byte, 16); return nil },
			[]codes.Code{codes.OK}},
		"inline short": {func(r *pb.FetchResponse) []byte {
			r.Meta.Location, r.InlineData = nil, []byte{1, 2}
			return nil
		}, []codes.Code{codes.InvalidArgument}},
		"dtype": {func(r *pb.FetchResponse) []byte {
			r.Meta.Dtype = pb.DType(zerocopy.Float64)
			r.Meta.Shape = []int64{n / 4}
			return nil
		}, []codes.Code{codes.InvalidArgument}},
		"other transport":     {func(r *pb.FetchResponse) []byte { r.Meta.Location.Transport = pb.Transport_TRANSPORT_SHM; return nil }, []codes.Code{codes.InvalidArgument}},
		"indirect, not bytes": {func(r *pb.FetchResponse) []byte { return nil }, []codes.Code{codes.Internal}},
		"empty with a location": {func(r *pb.FetchResponse) []byte {
			r.Meta.Shape, r.Meta.ByteLength, r.Meta.Location.Length = []int64{0}, 0, 0
			return nil
		}, []codes.Code{codes.OK, codes.InvalidArgument}},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			hs := newHostileServer(t, TransportTCP, nil, nil)
			c := hs.c
			want := publishBytes(t, hs.s, "k", n, 3)
			ch := started(func() error {
				got, err := fetchBytes(shortCtx(t, 10*time.Second), c, "k")
				if err == nil && !bytes.Equal(got, want) && (name != "empty with a location" || len(got) != 0) {
					return errors.New("other bytes")
				}
				return err
			})
			r := hs.next(5 * time.Second)
			if name == "indirect, not bytes" {
				meta := &pb.TensorMeta{Dtype: pb.DType_DTYPE_FLOAT32, Shape: []int64{4}, ByteLength: 16, TransferId: 5, Location: &pb.Location{Transport: pb.Transport_TRANSPORT_TCP, Length: 16}}
				hs.answer(r, wire.FrameFetchResp, wire.FlagIndirect, append(engine.AppendStatus(nil, nil, 0), marshal(t, meta)...))
			} else {
				resp := hs.offer(r.lane, r.h.Ref, "k")
				body := tc.mutate(resp)
				if body == nil {
					body = okBody(resp)
				}
				hs.answer(r, wire.FrameFetchResp, 0, body)
			}
			err := waitErr(t, ch, 10*time.Second, "Fetch")
			if !slicesContains(tc.codes, status.Code(err)) {
				t.Fatalf("Fetch: %v, want %v", err, tc.codes)
			}
			if err == nil {
				if n := c.Pool().Stats().InUse; n != 0 {
					t.Errorf("client pool: %d bytes in use", n)
				}
			}
		})
	}
}

func slicesContains(cs []codes.Code, c codes.Code) bool {
	for _, x := range cs {
		if x == c {
			return true
		}
	}
	return false
}

func u32(v uint32) *uint32 { return &v }

// bytesMeta describes an n-byte uint8 tensor.
func bytesMeta(n int) *pb.TensorMeta {
	return &pb.TensorMeta{Dtype: pb.DType(zerocopy.Uint8), Shape: []int64{int64(n)}, ByteLength: uint64(n)}
}

// TestHostileServerCallLies: CALL_RESPs that lie (inline indexes out of
// range, tensors without data, thousands of tensors, indirect answers
// naming no transfer, another dtype, bytes that are no CallResponse):
// the Call fails or succeeds with what was sent, within its deadline, and
// nothing of the client's pool is kept.
func TestHostileServerCallLies(t *testing.T) {
	const n = 1 << 20
	many := &pb.CallResponse{InlineData: [][]byte{{7}}}
	for range 1500 {
		m := bytesMeta(1)
		m.InlineIndex = u32(0)
		many.Tensors = append(many.Tensors, m)
	}
	cases := map[string]struct {
		// answer makes the response's flags and body; hs and ref let it
		// offer a real transfer.
		answer func(hs *hostileServer, r hostileReq) (uint16, []byte)
		code   codes.Code
		check  func(*Message) error
	}{
		"inline index": {func(*hostileServer, hostileReq) (uint16, []byte) {
			m := bytesMeta(1)
			m.InlineIndex = u32(1 << 31)
			return 0, okBody(&pb.CallResponse{InlineData: [][]byte{{1}}, Tensors: []*pb.TensorMeta{m}})
		}, codes.InvalidArgument, nil},
		"no data": {func(*hostileServer, hostileReq) (uint16, []byte) {
			return 0, okBody(&pb.CallResponse{Tensors: []*pb.TensorMeta{bytesMeta(1), bytesMeta(1)}})
		}, codes.InvalidArgument, nil},
		"inline and transfer mixed up": {func(hs *hostileServer, r hostileReq) (uint16, []byte) {
			f := hs.offer(r.lane, r.h.Ref, "k")
			good := bytesMeta(1)
			good.InlineIndex = u32(0)
			bad := bytesMeta(3)
			bad.InlineIndex = u32(0) // 1 byte for 3
			return 0, okBody(&pb.CallResponse{InlineData: [][]byte{{1}}, Tensors: []*pb.TensorMeta{good, f.Meta, bad}, TransferIds: []uint64{f.TransferId}})
		}, codes.InvalidArgument, nil},
		"a transfer twice": {func(hs *hostileServer, r hostileReq) (uint16, []byte) {
			f := hs.offer(r.lane, r.h.Ref, "k")
			return 0, okBody(&pb.CallResponse{Tensors: []*pb.TensorMeta{f.Meta, f.Meta}, TransferIds: []uint64{f.TransferId, f.TransferId}})
		}, codes.OK, func(m *Message) error {
			if len(m.Tensors) != 2 || m.Tensors[1].Len() != n {
				return errors.New("another reply")
			}
			return nil
		}},
		"thousands of tensors": {func(*hostileServer, hostileReq) (uint16, []byte) { return 0, okBody(many) }, codes.OK, func(m *Message) error {
			if len(m.Tensors) != 1500 || m.Tensors[1499].Bytes()[0] != 7 {
				return errors.New("another reply")
			}
			return nil
		}},
		"indirect without transfer": {func(*hostileServer, hostileReq) (uint16, []byte) {
			return wire.FlagIndirect, okBody(bytesMeta(100))
		}, codes.Internal, nil},
		"indirect of another dtype": {func(*hostileServer, hostileReq) (uint16, []byte) {
			m := &pb.TensorMeta{Dtype: pb.DType(zerocopy.Float32), Shape: []int64{1}, ByteLength: 4, TransferId: 9}
			return wire.FlagIndirect, okBody(m)
		}, codes.Internal, nil},
		"indirect without location": {func(*hostileServer, hostileReq) (uint16, []byte) {
			m := bytesMeta(100)
			m.TransferId = 9
			return wire.FlagIndirect, okBody(m)
		}, codes.InvalidArgument, nil},
		"indirect empty": {func(*hostileServer, hostileReq) (uint16, []byte) {
			m := bytesMeta(0)
			m.TransferId = 9
			return wire.FlagIndirect, okBody(m)
		}, codes.OK, func(m *Message) error {
			if len(m.Tensors) != 0 {
				return errors.New("tensors from nothing")
			}
			return nil
		}},
		"indirect garbage": {func(hs *hostileServer, r hostileReq) (uint16, []byte) {
			f := hs.offer(r.lane, r.h.Ref, "garbage")
			f.Meta.TransferId = f.TransferId
			return wire.FlagIndirect, okBody(f.Meta)
		}, codes.Internal, nil},
		"indirect with a bad key": {func(hs *hostileServer, r hostileReq) (uint16, []byte) {
			f := hs.offer(r.lane, r.h.Ref, "k")
			f.Meta.TransferId = f.TransferId
			f.Meta.Location.RemoteKey ^= 0x5a5a
			return wire.FlagIndirect, okBody(f.Meta)
		}, codes.PermissionDenied, nil},
		"indirect naming itself": {func(hs *hostileServer, r hostileReq) (uint16, []byte) {
			// An indirect answer whose CallResponse is again a TensorMeta:
			// read once, decoded as a CallResponse.
			m := bytesMeta(3)
			m.TransferId = 1
			m.InlineIndex = u32(0)
			return wire.FlagIndirect, okBody(m)
		}, codes.InvalidArgument, nil},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			hs := newHostileServer(t, TransportTCP, nil, nil)
			c := hs.c
			publishBytes(t, hs.s, "k", n, 3)
			garbage := bytes.Repeat([]byte{0xff}, n)
			gz, _ := zerocopy.New(zerocopy.Uint8, []int64{int64(len(garbage))}, garbage)
			gt := WrapTensor(gz)
			if err := hs.s.Publish(context.Background(), "garbage", gt); err != nil {
				t.Fatal(err)
			}
			gt.Release()
			ch := started(func() error {
				reply, err := c.Call(shortCtx(t, 10*time.Second), "m", &Message{Tensors: []*Tensor{wrapped(t, 100, 1)}})
				if err != nil {
					return err
				}
				defer reply.Release()
				if tc.check != nil {
					return tc.check(reply)
				}
				return nil
			})
			r := hs.next(5 * time.Second)
			flags, body := tc.answer(hs, r)
			hs.answer(r, wire.FrameCallResp, flags, body)
			err := waitErr(t, ch, 10*time.Second, "Call")
			// A transfer named twice is read twice; the client releases it
			// after one of the reads, and the other may then be refused.
			twice := name == "a transfer twice" && status.Code(err) == codes.PermissionDenied
			if status.Code(err) != tc.code && !twice {
				t.Fatalf("Call: %v, want %v", err, tc.code)
			}
			if n := c.Pool().Stats().InUse; n != 0 {
				t.Errorf("client pool: %d bytes in use", n)
			}
		})
	}
}

// readFrom reads n bytes at remote over the server's lane i, as the
// server reads a client's granted tensor: the bytes, or the Read's error.
func (hs *hostileServer) readFrom(i int, remote verbs.Remote, n int) ([]byte, error) {
	hs.t.Helper()
	l := hs.ss.lanes[i]
	buf, err := allocBuffer(context.Background(), hs.s.pool, n)
	if err != nil {
		hs.t.Fatal(err)
	}
	defer buf.Release()
	local, err := l.Domain.Reg.Local(buf)
	if err != nil {
		hs.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: remote}, nil); err != nil {
		return nil, err
	}
	return bytes.Clone(buf.Bytes()[:n]), nil
}

// waitInUse waits until the client's pool holds want bytes.
func waitInUse(t *testing.T, c *Client, want int64, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		n := c.Pool().Stats().InUse
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("client pool: %d bytes in use, want %d", n, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestHostileServerGrantOutlivesCancel: a Send whose server never
// answers returns at its deadline, but keeps its source granted (and its
// pool buffer) until the answer comes: a Read the server makes then still
// finds the tensor's bytes, not memory reused meanwhile. Once the late
// answer arrives the grant is revoked (on every lane of a striped
// tensor): a Read after it is refused and the buffer goes back.
func TestHostileServerGrantOutlivesCancel(t *testing.T) {
	for _, tc := range []struct {
		tr    string
		lanes int
	}{{TransportTCP, 1}, {TransportTCP, 2}, {TransportSHM, 1}} {
		lanes := tc.lanes
		t.Run(fmt.Sprintf("%s/lanes=%d", tc.tr, lanes), func(t *testing.T) {
			var opts []DialOption
			var sopts []ServerOption
			n := 1 << 20
			if lanes > 1 {
				opts, sopts = []DialOption{WithLanes(lanes)}, []ServerOption{WithLanes(lanes)}
				n = 16 << 20
			}
			hs := newHostileServer(t, tc.tr, sopts, opts)
			if len(hs.ss.lanes) != lanes {
				t.Fatalf("%d lanes", len(hs.ss.lanes))
			}
			c := hs.c
			c.noInPlace = true // the pool copy's life (caller memory: TestHostileServerInPlaceSourceRevoked)
			src := wrapped(t, n, 9)
			want := bytes.Clone(src.Bytes())
			start := time.Now()
			ch := started(func() error { return c.Send(shortCtx(t, 300*time.Millisecond), "k", src) })
			r := hs.next(5 * time.Second)
			if r.h.Type != wire.FrameSendReq {
				t.Fatalf("request %+v", r.h)
			}
			req := &pb.SendRequest{}
			if err := proto.Unmarshal(r.body, req); err != nil || req.Meta.GetLocation() == nil {
				t.Fatalf("SEND_REQ: %v, %v", req, err)
			}
			loc := req.Meta.Location
			if lanes > 1 && len(loc.Lanes) != lanes {
				t.Fatalf("a %d-byte tensor granted on %d lanes", n, len(loc.Lanes))
			}
			if err := waitErr(t, ch, 5*time.Second, "Send"); status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("Send: %v, want DeadlineExceeded", err)
			}
			if el := time.Since(start); el > 3*time.Second {
				t.Errorf("Send returned after %v, its deadline was 300ms", el)
			}
			// Other work that reuses the pool meanwhile.
			for i := range 4 {
				x, err := c.NewTensor(context.Background(), zerocopy.Uint8, []int64{int64(n)})
				if err != nil {
					t.Fatal(err)
				}
				pattern(x.Bytes(), byte(100+i))
				defer x.Release()
			}
			remotes := []verbs.Remote{{Addr: loc.Address, Key: loc.RemoteKey}}
			for _, lr := range loc.Lanes {
				remotes = append(remotes, verbs.Remote{Addr: lr.Address, Key: lr.RemoteKey})
			}
			for i, rm := range remotes {
				lane := r.lane
				if i > 0 {
					lane = i - 1
				}
				got, err := hs.readFrom(lane, rm, n)
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("a Read (lane %d) of the granted source after the Send gave up: %v, same bytes %v", lane, err, bytes.Equal(got, want))
				}
			}
			// The late answer ends the grants.
			before := c.Pool().Stats().InUse
			hs.answer(r, wire.FrameSendResp, 0, engine.AppendStatus(nil, nil, 0))
			deadline := time.Now().Add(5 * time.Second)
			for c.Pool().Stats().InUse == before && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if c.Pool().Stats().InUse == before {
				t.Fatal("the source stays in the pool after the late answer")
			}
			rm := remotes[len(remotes)-1]
			lane := r.lane
			if len(remotes) > 1 {
				lane = len(remotes) - 2
			}
			if got, err := hs.readFrom(lane, rm, n); err == nil {
				t.Fatalf("a Read after the answer read the source (same bytes %v)", bytes.Equal(got, want))
			} else if status.Code(err) != codes.PermissionDenied {
				t.Logf("a Read after the answer: %v", err)
			}
		})
	}
}

// TestHostileServerWithholdsCredits: a server that never returns
// credits (and never answers) makes calls wait for one under their
// context: each returns at its deadline, none hangs, and Close is bounded.
func TestHostileServerWithholdsCredits(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	hs.ss.lanes[0].Frames.Cancel() // the server's creditor: no CREDIT frames
	big := wrapped(t, 1<<20, 1)
	for i := range engine.FrameSlots + 8 {
		start := time.Now()
		ctx := shortCtx(t, 50*time.Millisecond)
		var err error
		switch i % 3 {
		case 0:
			_, err = fetchBytes(ctx, c, "k")
		case 1:
			err = c.Send(ctx, "k", big)
		default:
			var reply *Message
			reply, err = c.Call(ctx, "m", &Message{Tensors: []*Tensor{big}})
			if err == nil {
				reply.Release()
			}
		}
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("call %d: %v, want DeadlineExceeded", i, err)
		}
		if el := time.Since(start); el > 2*time.Second {
			t.Fatalf("call %d took %v, its deadline was 50ms", i, el)
		}
	}
	if f := hs.c.last.link.Frames; f.Credits != 0 {
		t.Logf("%d credits left", f.Credits)
	}
	if sessionGone(c) {
		t.Fatal("the session ended")
	}
}

// TestHostileServerBreaksTheProtocol: frames a server may not send (a
// request, a RELEASE, releases on a response, credits it was never given)
// end the session: a call under way returns Unavailable at once.
func TestHostileServerBreaksTheProtocol(t *testing.T) {
	cases := map[string]func(hs *hostileServer, r hostileReq){
		"fetch request": func(hs *hostileServer, r hostileReq) { hs.answerRef(r.lane, wire.FrameFetchReq, 0, 5, []byte("k")) },
		"send request":  func(hs *hostileServer, r hostileReq) { hs.answerRef(r.lane, wire.FrameSendReq, 0, 5, nil) },
		"call request":  func(hs *hostileServer, r hostileReq) { hs.answerRef(r.lane, wire.FrameCallReq, 0, 5, nil) },
		"release": func(hs *hostileServer, r hostileReq) {
			hs.answerRef(r.lane, wire.FrameRelease, 0, 0, refsBody(r.h.Ref))
		},
		"releases on a response": func(hs *hostileServer, r hostileReq) {
			ctx := shortCtx(hs.t, 5*time.Second)
			hs.lane(r.lane).send(ctx, wire.FrameHeader{Type: wire.FrameFetchResp, Ref: r.h.Ref}, fetchInline("k", []byte{1}), []uint64{1})
		},
		"credits never taken": func(hs *hostileServer, r hostileReq) {
			ctx := shortCtx(hs.t, 5*time.Second)
			hs.lane(r.lane).send(ctx, wire.FrameHeader{Type: wire.FrameCredit, Credits: 1000}, nil, nil)
		},
		"credits never taken on a response": func(hs *hostileServer, r hostileReq) {
			ctx := shortCtx(hs.t, 5*time.Second)
			hs.lane(r.lane).send(ctx, wire.FrameHeader{Type: wire.FrameFetchResp, Ref: r.h.Ref, Credits: engine.FrameSlots}, fetchInline("k", []byte{1}), nil)
		},
	}
	for name, attack := range cases {
		t.Run(name, func(t *testing.T) {
			hs := newHostileServer(t, TransportTCP, nil, nil)
			c := hs.c
			start := time.Now()
			ch := started(func() error { _, err := fetchBytes(shortCtx(t, 20*time.Second), c, "k"); return err })
			r := hs.next(5 * time.Second)
			attack(hs, r)
			if err := waitErr(t, ch, 10*time.Second, "Fetch"); status.Code(err) != codes.Unavailable {
				t.Fatalf("Fetch: %v, want Unavailable", err)
			}
			if el := time.Since(start); el > 5*time.Second {
				t.Errorf("the Fetch took %v to hear of the broken session", el)
			}
			if !eventuallyGone(c) {
				t.Fatal("the session survived")
			}
		})
	}
}

// TestHostileServerSilentThenClose: calls with no deadline wait on a
// server that takes their requests and never answers (nor ends the
// session); Close returns promptly and ends them all.
func TestHostileServerSilentThenClose(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	big := wrapped(t, 1<<20, 1)
	calls := []<-chan error{
		started(func() error { _, err := fetchBytes(context.Background(), c, "k"); return err }),
		started(func() error { return c.Send(context.Background(), "k", big) }),
		started(func() error {
			reply, err := c.Call(context.Background(), "m", &Message{Tensors: []*Tensor{big}})
			if err == nil {
				reply.Release()
			}
			return err
		}),
	}
	for range calls {
		hs.next(5 * time.Second)
	}
	closeWithin(t, c, 10*time.Second)
	for i, ch := range calls {
		if err := waitErr(t, ch, 5*time.Second, "a call"); err == nil {
			t.Errorf("call %d succeeded", i)
		} else if code := status.Code(err); code != codes.Unavailable && code != codes.Canceled {
			t.Errorf("call %d: %v, want Unavailable or Canceled", i, err)
		}
	}
}

// closeOrRelease closes c, failing the test when that takes longer than
// d; then it lets the server go on (unblock) and waits for Close.
func closeOrRelease(t *testing.T, c *Client, d time.Duration, unblock func()) {
	t.Helper()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- c.Close() }()
	select {
	case err := <-done:
		unblock()
		if err != nil {
			t.Errorf("client Close: %v", err)
		}
	case <-time.After(d):
		unblock()
		err := <-done
		t.Errorf("client Close took %v (more than %v), and returned (%v) only once the server went on", time.Since(start), d, err)
	}
}

// TestHostileServerCloseDuringHandshake: a server that takes the Session
// stream of a new session and never answers its handshake holds a call
// made without a deadline, as it may; but Close must end that call and
// return, as grpc.ClientConn.Close does.
func TestHostileServerCloseDuringHandshake(t *testing.T) {
	var streams atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	stall := func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if info.FullMethod == pb.TensorRPC_Session_FullMethodName && streams.Add(1) == 2 {
			close(entered)
			select {
			case <-release:
			case <-ss.Context().Done():
				return ss.Context().Err()
			}
		}
		return handler(srv, ss)
	}
	s, c := pair(t, TransportTCP, []ServerOption{WithGRPCServerOptions(grpc.StreamInterceptor(stall))}, nil)
	// The server ends the first session (its data plane closes).
	engine.CloseLanes(serverSessionOf(t, s).lanes, errors.New("the test ends the session"))
	for deadline := time.Now().Add(10 * time.Second); !sessionGone(c); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the session did not end")
		}
	}
	fetch := started(func() error { _, err := fetchBytes(context.Background(), c, "k"); return err })
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no second session was asked for")
	}
	closeOrRelease(t, c, 5*time.Second, unblock)
	if err := waitErr(t, fetch, 10*time.Second, "Fetch"); err == nil {
		t.Error("Fetch succeeded on a closed client")
	}
}

// TestHostileServerStripedLies: on a session of two lanes, a striped
// FETCH_RESP naming a bad key on one lane, or a server that ends the
// session right after its answer (in the middle of the striped Read),
// fails the Fetch within its deadline with the pool left as it was.
func TestHostileServerStripedLies(t *testing.T) {
	const n = 32 << 20
	cases := map[string]func(hs *hostileServer, r hostileReq){
		"bad key on a lane": func(hs *hostileServer, r hostileReq) {
			f := hs.offer(r.lane, r.h.Ref, "k")
			if len(f.Meta.Location.Lanes) != 2 {
				hs.t.Fatalf("%d lanes in the location", len(f.Meta.Location.Lanes))
			}
			f.Meta.Location.Lanes[1].RemoteKey ^= 0x5a5a
			hs.answer(r, wire.FrameFetchResp, 0, okBody(f))
		},
		"end mid-read": func(hs *hostileServer, r hostileReq) {
			hs.answer(r, wire.FrameFetchResp, 0, okBody(hs.offer(r.lane, r.h.Ref, "k")))
			engine.CloseLanes(hs.ss.lanes, errors.New("the test ends the session"))
		},
		"lane gone before the answer": func(hs *hostileServer, r hostileReq) {
			f := hs.offer(r.lane, r.h.Ref, "k")
			hs.ss.lanes[1-r.lane].Close(errors.New("the test closes a lane"))
			hs.answer(r, wire.FrameFetchResp, 0, okBody(f))
		},
	}
	for name, attack := range cases {
		t.Run(name, func(t *testing.T) {
			hs := newHostileServer(t, TransportTCP, []ServerOption{WithLanes(2)}, []DialOption{WithLanes(2)})
			c := hs.c
			want := publishBytes(t, hs.s, "k", n, 3)
			ch := started(func() error {
				got, err := fetchBytes(shortCtx(t, 10*time.Second), c, "k")
				if err == nil && !bytes.Equal(got, want) {
					return errors.New("other bytes")
				}
				return err
			})
			attack(hs, hs.next(5*time.Second))
			err := waitErr(t, ch, 10*time.Second, "Fetch")
			t.Logf("Fetch: %v", err)
			if code := status.Code(err); code != codes.OK && code != codes.PermissionDenied && code != codes.Unavailable {
				t.Fatalf("Fetch: %v", err)
			}
			waitInUse(t, c, 0, 5*time.Second)
		})
	}
}

// TestHostileServerOverrunsSlots: a server that sends more frames than it
// holds credits for (stray answers, which the client drops) either has
// them taken or breaks the session; a call under way returns within its
// deadline either way.
func TestHostileServerOverrunsSlots(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	ch := started(func() error { _, err := fetchBytes(shortCtx(t, 3*time.Second), c, "k"); return err })
	r := hs.next(5 * time.Second)
	l := hs.ss.lanes[r.lane]
	l.Frames.Cancel()
	body := statusBody(status.Error(codes.Internal, "stray"))
	ctx := shortCtx(t, 5*time.Second)
	sent := 0
	for i := range 3 * engine.FrameSlots {
		buf, err := l.CtlPool.Alloc(ctx, wire.FrameHeaderLen+len(body))
		if err != nil {
			t.Fatal(err)
		}
		b := buf.Bytes()[:wire.FrameHeaderLen+len(body)]
		engine.PutFrameHeader(b, wire.FrameHeader{Type: wire.FrameFetchResp, Ref: uint64(2*i + 2)}, len(body))
		copy(b[wire.FrameHeaderLen:], body)
		local, _ := l.Domain.Ctl.Local(buf)
		local.Length = len(b)
		l.Frames.Mu.Lock()
		l.Frames.Outstanding++ // taken, as if it had a credit, so the client's returns are good
		l.Frames.Mu.Unlock()
		err = l.PostWith(ctx, verbs.SendRequest{Op: verbs.OpSend, Local: local}, func() { buf.Release() }, false, nil)
		if err != nil {
			t.Logf("frame %d: %v", i, err)
			break
		}
		buf.Release()
		sent++
	}
	err := waitErr(t, ch, 6*time.Second, "Fetch")
	t.Logf("%d frames sent without credits; Fetch: %v; session gone: %v", sent, err, sessionGone(c))
	if code := status.Code(err); code != codes.DeadlineExceeded && code != codes.Unavailable {
		t.Fatalf("Fetch: %v, want DeadlineExceeded or Unavailable", err)
	}
}

// TestHostileServerCallCancelled: a Call whose server never answers
// returns at its deadline; its granted request tensors stay readable to
// the server until its answer, which comes late, with reply tensors the
// client never asked for; then the grants end and nothing stays in the
// pool.
func TestHostileServerCallCancelled(t *testing.T) {
	const n = 1 << 20
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	publishBytes(t, hs.s, "k", n, 3)
	in := []*Tensor{wrapped(t, n, 1), wrapped(t, n, 2)}
	ch := started(func() error {
		reply, err := c.Call(shortCtx(t, 300*time.Millisecond), "m", &Message{Tensors: in})
		if err == nil {
			reply.Release()
		}
		return err
	})
	r := hs.next(5 * time.Second)
	req := &pb.CallRequest{}
	if err := proto.Unmarshal(r.body, req); err != nil || len(req.Tensors) != 2 || req.Tensors[1].Location == nil {
		t.Fatalf("CALL_REQ: %v, %v", req, err)
	}
	if err := waitErr(t, ch, 5*time.Second, "Call"); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Call: %v, want DeadlineExceeded", err)
	}
	for i, m := range req.Tensors {
		got, err := hs.readFrom(r.lane, verbs.Remote{Addr: m.Location.Address, Key: m.Location.RemoteKey}, n)
		if err != nil || !bytes.Equal(got, in[i].Bytes()) {
			t.Fatalf("reading request tensor %d after the Call gave up: %v", i, err)
		}
	}
	f := hs.offer(r.lane, r.h.Ref, "k")
	hs.answer(r, wire.FrameCallResp, 0, okBody(&pb.CallResponse{Tensors: []*pb.TensorMeta{f.Meta}, TransferIds: []uint64{f.TransferId}}))
	waitInUse(t, c, 0, 5*time.Second)
	// The late answer frees the reply's landings (pool memory: InUse
	// reaches 0) and then revokes the request's grants, both where the
	// answer is handled: a Read may still find the grant for a moment
	// after InUse reached 0, never for long.
	m := req.Tensors[0]
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, err := hs.readFrom(r.lane, verbs.Remote{Addr: m.Location.Address, Key: m.Location.RemoteKey}, n); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Reads after the answer still read a request tensor 5 s later")
		}
	}
}

// TestHostileServerLeaseLies: a leased Fetch (shm maps the server's
// memory) whose answer names a bad key, bytes past the grant, or an empty
// tensor with a location fails, or succeeds empty, within its deadline,
// and the mapping is not kept.
func TestHostileServerLeaseLies(t *testing.T) {
	const n = 1 << 20
	cases := map[string]struct {
		mutate func(*pb.FetchResponse)
		code   codes.Code
	}{
		"bad key":  {func(r *pb.FetchResponse) { r.Meta.Location.RemoteKey ^= 0x5a5a }, codes.PermissionDenied},
		"past end": {func(r *pb.FetchResponse) { r.Meta.Location.Address += n / 2 }, codes.PermissionDenied},
		"too long": {func(r *pb.FetchResponse) {
			r.Meta.Shape, r.Meta.ByteLength, r.Meta.Location.Length = []int64{2 * n}, 2*n, 2*n
		}, codes.PermissionDenied},
		"empty":     {func(r *pb.FetchResponse) { r.Meta.Shape, r.Meta.ByteLength, r.Meta.Location.Length = []int64{0}, 0, 0 }, codes.OK},
		"no id":     {func(r *pb.FetchResponse) { r.TransferId = 0 }, codes.InvalidArgument},
		"as is":     {func(r *pb.FetchResponse) {}, codes.OK},
		"checksum":  {func(r *pb.FetchResponse) { r.Meta.Crc32C = u32(1) }, codes.DataLoss},
		"shape lie": {func(r *pb.FetchResponse) { r.Meta.Shape = []int64{n / 2, 2, 2} }, codes.InvalidArgument},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			hs := newHostileServer(t, TransportSHM, nil, nil)
			c := hs.c
			publishBytes(t, hs.s, "k", n, 3)
			ch := started(func() error {
				got, err := c.Fetch(shortCtx(t, 10*time.Second), "k", Lease())
				if err == nil {
					got.Release()
				}
				return err
			})
			r := hs.next(5 * time.Second)
			if r.h.Flags&wire.FlagLease == 0 {
				t.Fatalf("request flags %#x", r.h.Flags)
			}
			f := hs.offer(r.lane, r.h.Ref, "k")
			tc.mutate(f)
			hs.answer(r, wire.FrameFetchResp, 0, okBody(f))
			if err := waitErr(t, ch, 10*time.Second, "Fetch"); status.Code(err) != tc.code {
				t.Fatalf("Fetch: %v, want %v", err, tc.code)
			}
			waitInUse(t, c, 0, 5*time.Second)
		})
	}
}

// TestHostileServerLeavesCancelledCallsUnanswered: a server that never
// answers the Sends its client gives up on makes the client keep each
// one's granted source until the answer; past the bound on such calls
// (lowered here from maxAbandoned) the client ends the session, which
// frees them all, and the next call opens a new session.
func TestHostileServerLeavesCancelledCallsUnanswered(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	c.noInPlace = true // each held source is a pool copy, counted in InUse
	const bound = 8
	for _, l := range c.last.lanes {
		l.Frames.Mu.Lock()
		l.Frames.MaxAbandon = bound
		l.Frames.Mu.Unlock()
	}
	first := c.SessionID()
	before := c.Pool().Stats().InUse
	src := wrapped(t, 256<<10, 4) // over the inline limit: granted, held until the answer
	for i := range bound + 1 {
		err := c.Send(shortCtx(t, 30*time.Millisecond), "k", src)
		if i < bound && status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("Send %d: %v, want DeadlineExceeded", i, err)
		}
		if i < bound && c.Pool().Stats().InUse <= before {
			t.Fatalf("Send %d: the given-up Send's source is not held", i)
		}
	}
	if !eventuallyGone(c) {
		t.Fatalf("%d Sends left unanswered and the session goes on", bound+1)
	}
	waitFor(t, "the unanswered Sends' sources to be freed", func() bool { return c.Pool().Stats().InUse == before })
	hs.serve.Store(true) // a server that behaves now
	if err := c.Send(ctxT(t), "k", src); err != nil {
		t.Fatal(err)
	}
	if c.SessionID() == first {
		t.Fatal("the same session after it was ended")
	}
}

// TestHostileServerInPlaceSourceRevoked: a Send of caller memory granted
// in place (tcp) that gives up ends its grant before it returns, so the
// caller may reuse its memory at once: a server that reads it after that
// is refused, which ends the connection (as a remote access error does
// on a NIC) and so the session; the next Send opens a new one.
func TestHostileServerInPlaceSourceRevoked(t *testing.T) {
	hs := newHostileServer(t, TransportTCP, nil, nil)
	c := hs.c
	const n = 1 << 20
	src := wrapped(t, n, 9)
	copies := c.Stats().Copies
	ch := started(func() error { return c.Send(shortCtx(t, 200*time.Millisecond), "k", src) })
	r := hs.next(5 * time.Second)
	req := &pb.SendRequest{}
	if err := proto.Unmarshal(r.body, req); err != nil || req.Meta.GetLocation() == nil {
		t.Fatalf("SEND_REQ: %v, %v", req, err)
	}
	loc := req.Meta.Location
	if got, err := hs.readFrom(r.lane, verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}, n); err != nil || !bytes.Equal(got, src.Bytes()) {
		t.Fatalf("a Read of the caller's memory while the Send waits: %v", err)
	}
	if d := c.Stats().Copies - copies; d != 0 {
		t.Fatalf("the Send copied the caller's memory %d times", d)
	}
	if err := waitErr(t, ch, 5*time.Second, "Send"); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Send: %v, want DeadlineExceeded", err)
	}
	if got, err := hs.readFrom(r.lane, verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}, n); err == nil {
		t.Fatalf("a Read of the caller's memory after the Send returned succeeded (same bytes %v)", bytes.Equal(got, src.Bytes()))
	}
	if !eventuallyGone(c) {
		t.Fatal("the session survived the refused Read")
	}
	if err := c.Send(ctxT(t), "k2", src); err != nil {
		t.Fatalf("a Send on a new session: %v", err)
	}
}
