package rpc

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestFallbackWhenDataPlaneCannotConnect advertises tcp addresses nobody
// listens on: the tcp data plane fails to connect and the session falls
// back to gRPC, saying why.
func TestFallbackWhenDataPlaneCannotConnect(t *testing.T) {
	unreachable := WithProvider(tcp.New(tcp.WithAdvertiseAddress("127.0.0.1:1"), tcp.WithDialTimeout(2*time.Second)))
	opts := []Option{unreachable, WithConnectTimeout(3 * time.Second)}
	s, c := pair(t, TransportGRPC, asServer(append(opts, WithTransports(TransportTCP, TransportGRPC))), asDial(append(opts, WithTransports(TransportTCP, TransportGRPC))))
	found := false
	for _, r := range c.Rejections() {
		if r.Transport == TransportTCP && strings.Contains(r.Reason, "connect") {
			found = true
		}
	}
	if !found {
		t.Fatalf("rejections do not explain tcp: %v", c.Rejections())
	}
	ctx := ctxT(t)
	in := wrapped(t, 3<<20, 9)
	if err := s.Publish(context.Background(), "x", in); err != nil {
		t.Fatal(err)
	}
	got, err := c.Fetch(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	defer got.Release()
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatal("data differs")
	}
}

// TestNoFallback: without TransportGRPC a session whose data plane cannot
// connect fails instead of falling back.
func TestNoFallback(t *testing.T) {
	s, err := NewServer(WithTransports(TransportTCP), testPool())
	if err != nil {
		t.Fatal(err)
	}
	lis := listen(t)
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	defer func() { s.Stop(); <-served }()
	ctx := ctxT(t)
	// A client that offers only shm cannot meet a tcp-only server.
	_, err = Dial(ctx, lis.Addr().String(), WithTransports(TransportSHM), testPool(), insecureCreds())
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("Dial: %v, want FailedPrecondition", err)
	}
}

// TestCancelMidTransfer cancels Fetch and Send of a large tensor while the
// one-sided operation is under way; every buffer comes back on both sides.
func TestCancelMidTransfer(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			big, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{256 << 20})
			if err != nil {
				t.Fatal(err)
			}
			fill(big.Bytes(), 1)
			s.Publish(context.Background(), "big", big)
			big.Release()
			published := s.Pool().Stats().InUse
			for _, delay := range []time.Duration{0, time.Millisecond, 10 * time.Millisecond} {
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(delay, cancel)
				got, err := c.Fetch(ctx, "big")
				if err == nil {
					got.Release() // it finished first; fine
				} else if code := status.Code(err); code != codes.Canceled {
					t.Fatalf("cancelled Fetch: %v", err)
				}
				cancel()
			}
			src, err := c.NewTensor(ctxT(t), zerocopy.Uint8, []int64{256 << 20})
			if err != nil {
				t.Fatal(err)
			}
			for _, delay := range []time.Duration{0, time.Millisecond, 10 * time.Millisecond} {
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(delay, cancel)
				if err := c.Send(ctx, "sent", src); err != nil && status.Code(err) != codes.Canceled {
					t.Fatalf("cancelled Send: %v", err)
				}
				cancel()
			}
			src.Release()
			s.Unpublish("sent")
			waitFor(t, "the client's buffers", func() bool { return c.Pool().Stats().InUse <= linkPoolBytes })
			waitFor(t, "the server's buffers", func() bool { s.Unpublish("sent"); return s.Pool().Stats().InUse <= published+linkPoolBytes })
		})
	}
}

// TestBackpressure: a server whose pool is full makes Send wait until
// memory is released, or until the context ends.
func TestBackpressure(t *testing.T) {
	small := WithPoolOptions(mempool.WithArenaSize(8<<20), mempool.WithLimit(64<<20))
	s, c := pair(t, TransportTCP, []ServerOption{small}, nil)
	ctx := ctxT(t)
	a := wrapped(t, 40<<20, 1)
	if err := c.Send(ctx, "a", a); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := c.Send(short, "b", a); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Send into a full pool: %v, want DeadlineExceeded", err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Send(ctx, "b", a) }()
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("Send into a full pool returned %v before memory was freed", err)
	default:
	}
	got, err := s.Take(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	got.Release()
	if err := <-done; err != nil {
		t.Fatalf("Send after memory was freed: %v", err)
	}
	s.Unpublish("b")
}

// TestLimits: a tensor over the peer's size limit is ResourceExhausted.
func TestLimits(t *testing.T) {
	_, c := pair(t, TransportTCP, []ServerOption{WithMaxTensorBytes(1 << 20)}, nil)
	err := c.Send(ctxT(t), "x", wrapped(t, 2<<20, 1))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("oversized Send: %v", err)
	}
}

// TestHostileServer gives the client descriptors that lie: bad keys,
// addresses out of the region, lengths and shapes that do not match. The
// client refuses them without touching memory it does not own.
func TestHostileServer(t *testing.T) {
	cases := map[string]struct {
		mutate func(*pb.FetchResponse)
		want   codes.Code
	}{
		"bad key":         {func(r *pb.FetchResponse) { r.Meta.Location.RemoteKey ^= 0x5a5a5a5a }, codes.PermissionDenied},
		"out of bounds":   {func(r *pb.FetchResponse) { r.Meta.Location.Address += 1 << 40 }, codes.PermissionDenied},
		"length mismatch": {func(r *pb.FetchResponse) { r.Meta.ByteLength-- }, codes.InvalidArgument},
		"negative dim":    {func(r *pb.FetchResponse) { r.Meta.Shape = []int64{-1, -4 << 20} }, codes.InvalidArgument},
		"unknown dtype":   {func(r *pb.FetchResponse) { r.Meta.Dtype = 99 }, codes.InvalidArgument},
		"huge": {func(r *pb.FetchResponse) {
			r.Meta.Shape = []int64{1 << 50}
			r.Meta.ByteLength = 1 << 50
			r.Meta.Location.Length = 1 << 50
		}, codes.ResourceExhausted},
		"other transport":  {func(r *pb.FetchResponse) { r.Meta.Location.Transport = pb.Transport_TRANSPORT_IBV }, codes.InvalidArgument},
		"location length":  {func(r *pb.FetchResponse) { r.Meta.Location.Length++ }, codes.InvalidArgument},
		"inline too short": {func(r *pb.FetchResponse) { r.Meta.Location = nil; r.InlineData = []byte{1} }, codes.InvalidArgument},
	}
	for _, tr := range []string{TransportTCP, TransportSHM} {
		for name, tc := range cases {
			t.Run(tr+"/"+name, func(t *testing.T) {
				hs := newHostileServer(t, tr, nil, nil)
				s, c := hs.s, hs.c
				in := wrapped(t, 4<<20, 5)
				s.Publish(context.Background(), "x", in)
				ch := started(func() error {
					got, err := c.Fetch(shortCtx(t, 10*time.Second), "x")
					if err == nil {
						got.Release()
					}
					return err
				})
				r := hs.next(5 * time.Second)
				resp := hs.offer(r.lane, r.h.Ref, "x")
				tc.mutate(resp)
				hs.answer(r, wire.FrameFetchResp, 0, okBody(resp))
				err := waitErr(t, ch, 10*time.Second, "Fetch")
				if status.Code(err) != tc.want {
					t.Fatalf("Fetch: %v, want %v", err, tc.want)
				}
				// The server's memory is untouched.
				got, err := s.Fetch(ctxT(t), "x")
				if err != nil {
					t.Fatal(err)
				}
				defer got.Release()
				if !bytes.Equal(got.Bytes(), in.Bytes()) {
					t.Fatal("server tensor changed")
				}
			})
		}
	}
}

// TestHostileClient sends the server malformed descriptors, and a write
// through a grant the server made for reading.
func TestHostileClient(t *testing.T) {
	s, c := pair(t, TransportTCP, nil, nil)
	ctx := ctxT(t)
	api := pb.NewTensorRPCClient(c.cc)
	guard := wrapped(t, 1<<20, 3)
	s.Publish(context.Background(), "guard", guard)
	bad := []*pb.TensorMeta{
		nil,
		{Key: "a", Dtype: 99, Shape: []int64{1}, ByteLength: 1},
		{Key: "a", Dtype: pb.DType_DTYPE_FLOAT32, Shape: []int64{-2}, ByteLength: 8},
		{Key: "a", Dtype: pb.DType_DTYPE_FLOAT32, Shape: []int64{4}, ByteLength: 15},
		{Key: "a", Dtype: pb.DType_DTYPE_UINT8, Shape: make([]int64, 40), ByteLength: 0},
		{Key: "a", Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{1 << 62, 4}, ByteLength: 0},
		{Key: "a", Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{4}, ByteLength: 4, Location: &pb.Location{Transport: pb.Transport_TRANSPORT_TCP, Length: 4}},
	}
	for i, m := range bad {
		_, err := api.Send(ctx, &pb.SendRequest{SessionId: c.SessionID(), Meta: m, InlineData: []byte{1, 2, 3, 4}})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("bad meta %d: %v, want InvalidArgument", i, err)
		}
	}
	if _, err := api.Send(ctx, &pb.SendRequest{SessionId: "forged", Meta: &pb.TensorMeta{Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{1}, ByteLength: 1}, InlineData: []byte{1}}); status.Code(err) != codes.Unavailable {
		t.Errorf("forged session: %v, want Unavailable (unknown session)", err)
	}
	if _, err := api.Call(ctx, &pb.CallRequest{SessionId: c.SessionID(), Method: "m", Tensors: []*pb.TensorMeta{{Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{1}, ByteLength: 1, TransferId: 12345}}}); status.Code(err) == codes.OK {
		t.Error("call with a tensor without inline data succeeded")
	}
	if _, err := api.Send(ctx, &pb.SendRequest{SessionId: c.SessionID(), Meta: &pb.TensorMeta{Key: "w", Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{1 << 20}, ByteLength: 1 << 20}}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Send method without inline data: %v, want FailedPrecondition", err)
	}
	// A write through the grant of a fetched tensor (read only), or with a
	// forged key, is refused by the server's data plane; the guard tensor
	// stays intact and the session dies.
	sess, err := c.session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.askFrame(ctx, sess, sess.link, "guard", fetchOptions{})
	if err != nil || resp.Meta.Location == nil {
		t.Fatalf("askFrame: %v", err)
	}
	src, _ := c.NewTensor(ctx, zerocopy.Uint8, []int64{1 << 20})
	defer src.Release()
	local, _ := sess.link.Dev.Reg.Local(src.buf)
	loc := resp.Meta.Location
	err = sess.link.Post(ctx, write(local, loc.Address, loc.RemoteKey), nil)
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("write through a read grant: %v, want PermissionDenied", err)
	}
	got, err := s.Fetch(ctx, "guard")
	if err != nil {
		t.Fatal(err)
	}
	defer got.Release()
	if !bytes.Equal(got.Bytes(), guard.Bytes()) {
		t.Fatal("guard tensor changed")
	}
}
