package rpc

import (
	"bytes"
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestChecksumsEndToEnd: with WithChecksums on both sides every path sends
// a CRC32C and verifies it; the bytes arrive intact.
func TestChecksumsEndToEnd(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM, TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []ServerOption{WithChecksums(true)}, []DialOption{WithChecksums(true)})
			ctx := ctxT(t)
			s.Handle("echo", func(_ context.Context, req *Message) (*Message, error) {
				out := make([]*Tensor, len(req.Tensors))
				for i, x := range req.Tensors {
					out[i] = WrapTensor(x.Tensor)
				}
				return &Message{Tensors: out}, nil
			})
			for _, n := range []int{0, 100, 1 << 20} {
				in := wrapped(t, n, byte(n))
				if err := c.Send(ctx, "k", in); err != nil {
					t.Fatal(err)
				}
				got, err := c.Fetch(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got.Bytes(), in.Bytes()) {
					t.Fatal("data differs")
				}
				got.Release()
				reply, err := c.Call(ctx, "echo", &Message{Tensors: []*Tensor{in}})
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
					t.Fatal("call data differs")
				}
				reply.Release()
			}
		})
	}
}

// TestWrongChecksumIsRefused: a checksum that does not match the bytes is
// refused with DataLoss on every receiving path, and nothing is published.
func TestWrongChecksumIsRefused(t *testing.T) {
	s, c := pair(t, TransportTCP, nil, nil)
	ctx := ctxT(t)
	api := pb.NewTensorRPCClient(c.cc)
	s.Handle("m", func(context.Context, *Message) (*Message, error) { return &Message{}, nil })
	in := wrapped(t, 64, 1)
	bad := metaOf("bad", in.Tensor, true)
	*bad.Crc32C ^= 1
	if _, err := api.Send(ctx, &pb.SendRequest{SessionId: c.SessionID(), Meta: bad, InlineData: in.Bytes()}); status.Code(err) != codes.DataLoss {
		t.Fatalf("inline Send with a wrong checksum: %v, want DataLoss", err)
	}
	idx := uint32(0)
	bad.InlineIndex = &idx
	bad.Key = ""
	if _, err := api.Call(ctx, &pb.CallRequest{SessionId: c.SessionID(), Method: "m", Tensors: []*pb.TensorMeta{bad}, InlineData: [][]byte{in.Bytes()}}); status.Code(err) != codes.DataLoss {
		t.Fatalf("Call with a wrong checksum: %v, want DataLoss", err)
	}
	// Over the data plane: the server does not publish what fails.
	big := wrapped(t, 1<<20, 2)
	meta := metaOf("bigbad", big.Tensor, true)
	*meta.Crc32C ^= 1
	src, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	copy(src.Bytes(), big.Bytes())
	sess, err := c.session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.sendFrame(ctx, sess, outgoing{meta: meta, t: src}); status.Code(err) != codes.DataLoss {
		t.Fatalf("a sent tensor with a wrong checksum: %v, want DataLoss", err)
	}
	src.Release()
	if _, err := s.Fetch(ctx, "bigbad"); status.Code(err) != codes.NotFound {
		t.Fatalf("a sent tensor with a wrong checksum: %v, want NotFound (not published)", err)
	}
}

// TestWrongChecksumIsRefusedOnStreams: the fallback stream refuses a
// checksum that does not match with DataLoss.
func TestWrongChecksumIsRefusedOnStreams(t *testing.T) {
	_, gc := pair(t, TransportGRPC, nil, nil)
	ctx := ctxT(t)
	in := wrapped(t, 64, 1)
	stream, err := pb.NewTensorRPCClient(gc.cc).SendStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m := metaOf("streambad", in.Tensor, true)
	*m.Crc32C ^= 1
	stream.Send(&pb.Chunk{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{m}}})
	stream.Send(&pb.Chunk{Data: in.Bytes()})
	if _, err := stream.CloseAndRecv(); status.Code(err) != codes.DataLoss {
		t.Fatalf("SendStream with a wrong checksum: %v, want DataLoss", err)
	}
}

// TestReadYourWrites: a Fetch after a Send returned sees that Send's
// tensor, also when an older tensor is published under the key, on every
// plane and for inline and data-plane sizes alike.
func TestReadYourWrites(t *testing.T) {
	pairs := 10000
	if rpctest.Race {
		pairs = 1000
	}
	for _, tr := range []string{TransportTCP, TransportSHM, TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			_, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			small, err := c.NewTensor(ctx, zerocopy.Uint64, []int64{1})
			if err != nil {
				t.Fatal(err)
			}
			defer small.Release()
			large, err := c.NewTensor(ctx, zerocopy.Uint64, []int64{(DefaultEagerThreshold + 8) / 8})
			if err != nil {
				t.Fatal(err)
			}
			defer large.Release()
			for i := range pairs {
				x := small
				if i%2 == 1 {
					x = large
				}
				v, _ := zerocopy.View[uint64](x.Tensor)
				v[0] = uint64(i)
				if err := c.Send(ctx, "ryw", x); err != nil {
					t.Fatal(err)
				}
				got, err := c.Fetch(ctx, "ryw")
				if err != nil {
					t.Fatal(err)
				}
				g, _ := zerocopy.View[uint64](got.Tensor)
				if len(g) != len(v) || g[0] != uint64(i) {
					t.Fatalf("pair %d: fetched %d values starting %d, want %d values starting %d", i, len(g), g[0], len(v), i)
				}
				got.Release()
			}
		})
	}
}
