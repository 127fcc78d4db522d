package rpc

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// metaOf describes t under key, with its CRC32C when sum is set.
func metaOf(key string, t zerocopy.Tensor, sum bool) *pb.TensorMeta {
	m := &pb.TensorMeta{
		Key:        key,
		Dtype:      pb.DType(t.DType()),
		Shape:      append([]int64(nil), t.Shape()...),
		ByteLength: uint64(len(t.Bytes())),
	}
	if sum {
		crc := zerocopy.Checksum(t.Bytes())
		m.Crc32C = &crc
	}
	return m
}

// verifySum checks b against m's CRC32C, when m has one: every receiver
// verifies a checksum the sender set (WithChecksums, or a foreign client),
// on every path. A mismatch is DataLoss.
func verifySum(m *pb.TensorMeta, b []byte) error {
	if m.Crc32C == nil {
		return nil
	}
	if got := zerocopy.Checksum(b); got != *m.Crc32C {
		return status.Errorf(codes.DataLoss, "tensorrpc: tensor %q: CRC32C %#08x, the sender's is %#08x", m.Key, got, *m.Crc32C)
	}
	return nil
}

// checkMeta validates a tensor description from a peer, with the same
// rules as the wire header: a known dtype, a shape within MaxRank without
// negative dimensions, a byte length that matches, a location that is
// consistent, and a size within limit. Failures are InvalidArgument, or
// ResourceExhausted for a tensor over the limit.
func checkMeta(m *pb.TensorMeta, limit int64) error {
	if m == nil {
		return status.Error(codes.InvalidArgument, "tensorrpc: missing tensor description")
	}
	h := wire.Header{Key: []byte(m.Key), DType: zerocopy.DType(m.Dtype), ByteLength: m.ByteLength}
	if m.Dtype < 0 || m.Dtype > 255 {
		h.DType = zerocopy.Invalid
	}
	if err := h.SetShape(m.Shape); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if l := m.Location; l != nil {
		h.HasLocation = true
		h.Location = wire.Location{
			Provider: uint8(min(uint32(l.Transport), 255)), RegionID: l.RegionId, RemoteKey: l.RemoteKey,
			Address: l.Address, Offset: l.Offset, Length: l.Length,
		}
	}
	if err := h.Validate(); err != nil {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %v", m.Key, err)
	}
	if m.ByteLength > uint64(limit) {
		return status.Errorf(codes.ResourceExhausted, "tensorrpc: tensor %q of %d bytes exceeds the limit of %d bytes (rpc.WithMaxTensorBytes on the receiving side raises it)", m.Key, m.ByteLength, limit)
	}
	return nil
}

// shapeOf returns a validated meta's dtype and shape.
func shapeOf(m *pb.TensorMeta) (zerocopy.DType, []int64) {
	return zerocopy.DType(m.Dtype), m.Shape
}
