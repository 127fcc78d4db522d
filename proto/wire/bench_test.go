package wire

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// The same metadata as sample(), as the control plane's protobuf message.
func sampleMeta() *tensorrpcpb.TensorMeta {
	h := sample()
	crc := h.Checksum
	return &tensorrpcpb.TensorMeta{
		Key:        string(h.Key),
		Dtype:      tensorrpcpb.DType(h.DType),
		Shape:      append([]int64(nil), h.Shape()...),
		ByteLength: h.ByteLength,
		Crc32C:     &crc,
		Location: &tensorrpcpb.Location{
			Transport: tensorrpcpb.Transport(h.Location.Provider), RegionId: h.Location.RegionID,
			RemoteKey: h.Location.RemoteKey, Address: h.Location.Address, Offset: h.Location.Offset, Length: h.Location.Length,
		},
	}
}

func BenchmarkHeaderEncode(b *testing.B) {
	b.Run("flatbuffers", func(b *testing.B) {
		var enc Encoder
		h := sample()
		b.ReportAllocs()
		for b.Loop() {
			if _, err := enc.Encode(h); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("protobuf", func(b *testing.B) {
		m := sampleMeta()
		var buf []byte
		opts := proto.MarshalOptions{}
		b.ReportAllocs()
		for b.Loop() {
			var err error
			if buf, err = opts.MarshalAppend(buf[:0], m); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkHeaderDecode(b *testing.B) {
	b.Run("flatbuffers", func(b *testing.B) {
		var enc Encoder
		buf, _ := enc.Encode(sample())
		var h Header
		b.ReportAllocs()
		b.SetBytes(int64(len(buf)))
		for b.Loop() {
			if err := Decode(buf, &h); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("protobuf", func(b *testing.B) {
		buf, _ := proto.Marshal(sampleMeta())
		var m tensorrpcpb.TensorMeta
		b.ReportAllocs()
		b.SetBytes(int64(len(buf)))
		for b.Loop() {
			m.Reset()
			if err := proto.Unmarshal(buf, &m); err != nil {
				b.Fatal(err)
			}
		}
	})
}
