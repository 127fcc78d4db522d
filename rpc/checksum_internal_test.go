// White-box: these tests send hand-made tensor metadata with a wrong checksum on the client's own gRPC connection.

package rpc

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

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
