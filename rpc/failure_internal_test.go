// White-box: a hostile server and client speak frames and one-sided operations on the session's links.

package rpc

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

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
	local, _ := sess.link.Domain.Reg.Local(src.buf)
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
