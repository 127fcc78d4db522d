package rpc

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// answerSeeds are FetchResponse encodings: the answers a server sends,
// and the encodings a peer may send instead (fields twice, unpacked
// shapes, a location, a key that is not UTF-8, unknown fields, junk).
func answerSeeds() (fast, other [][]byte) {
	crc := uint32(7)
	m := func(r *pb.FetchResponse) []byte {
		b, err := proto.Marshal(r)
		if err != nil {
			panic(err)
		}
		return b
	}
	fast = [][]byte{
		m(&pb.FetchResponse{Meta: &pb.TensorMeta{Key: "w", Dtype: pb.DType_DTYPE_INT8, Shape: []int64{4096}, ByteLength: 4096}, InlineData: make([]byte, 4096)}),
		m(&pb.FetchResponse{Meta: &pb.TensorMeta{Key: "ключ", Dtype: pb.DType(-3), Shape: []int64{2, 0, 3}, ByteLength: 0, Crc32C: &crc, TransferId: 9}, TransferId: 9, RowsOfSource: true}),
		m(&pb.FetchResponse{Meta: &pb.TensorMeta{}, InlineData: []byte{}}),
		m(&pb.FetchResponse{InlineData: []byte("small")}),
		{},
	}
	// Unpacked shape, a scalar field twice (the last wins).
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	var meta []byte
	meta = protowire.AppendTag(meta, 3, protowire.VarintType)
	meta = protowire.AppendVarint(meta, 5)
	meta = protowire.AppendTag(meta, 3, protowire.VarintType)
	meta = protowire.AppendVarint(meta, 6)
	meta = protowire.AppendTag(meta, 4, protowire.VarintType)
	meta = protowire.AppendVarint(meta, 1)
	meta = protowire.AppendTag(meta, 4, protowire.VarintType)
	meta = protowire.AppendVarint(meta, 30)
	b = protowire.AppendBytes(b, meta)
	fast = append(fast, b)

	other = [][]byte{
		m(&pb.FetchResponse{Meta: &pb.TensorMeta{Key: "w", Location: &pb.Location{}}, TransferId: 3}),
		protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "\xff")), // a key not UTF-8
		append(m(&pb.FetchResponse{InlineData: []byte("a")}), m(&pb.FetchResponse{InlineData: []byte("b")})...),                                                   // inline_data twice
		append(m(&pb.FetchResponse{Meta: &pb.TensorMeta{Key: "a"}}), m(&pb.FetchResponse{Meta: &pb.TensorMeta{Dtype: 2}})...),                                     // meta twice: merged
		protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), 1),                                                                              // unknown
		protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1),                                                                              // wrong wire type
		{0x0a, 0x05, 0x01},
		{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
	}
	return fast, other
}

// checkAnswer decodes b with fastFetchAnswer and proto.Unmarshal and
// fails unless the fast path either declined or decoded what protobuf
// does. It reports whether the fast path decoded b.
func checkAnswer(t *testing.T, b []byte) bool {
	t.Helper()
	var want, got pb.FetchResponse
	err := proto.Unmarshal(b, &want)
	if !fastFetchAnswer(b, &got) {
		return false
	}
	defer recycleInline(got.InlineData)
	if err != nil {
		t.Fatalf("%x: decoded, which protobuf refuses: %v", b, err)
	}
	if !proto.Equal(&want, &got) {
		t.Fatalf("%x: decoded %v, protobuf %v", b, &got, &want)
	}
	if (want.InlineData == nil) != (got.InlineData == nil) {
		t.Fatalf("%x: inline data nil %v, protobuf's %v", b, got.InlineData == nil, want.InlineData == nil)
	}
	return true
}

// TestFastFetchAnswer: the answers a server sends take the fast path and
// decode as protobuf decodes them; what a server does not send is left
// to protobuf, which decodes it (or refuses it) as before.
func TestFastFetchAnswer(t *testing.T) {
	fast, other := answerSeeds()
	for i, b := range fast {
		if !checkAnswer(t, b) {
			t.Errorf("answer %d (%x): not decoded on the fast path", i, b)
		}
	}
	for i, b := range other {
		if checkAnswer(t, b) {
			t.Errorf("encoding %d (%x): decoded on the fast path, want it left to protobuf", i, b)
		}
		// UnmarshalFrame still decodes it as protobuf does.
		var a fetchAnswer
		var want pb.FetchResponse
		errA, errW := a.UnmarshalFrame(b), proto.Unmarshal(b, &want)
		if (errA == nil) != (errW == nil) || errA == nil && !proto.Equal(&a.FetchResponse, &want) {
			t.Errorf("encoding %d (%x): UnmarshalFrame %v (%v), protobuf %v (%v)", i, b, &a.FetchResponse, errA, &want, errW)
		}
	}
}

// FuzzFastFetchAnswer: whatever a peer sends, the fast path decodes it
// as protobuf does, or leaves it to protobuf.
func FuzzFastFetchAnswer(f *testing.F) {
	fast, other := answerSeeds()
	for _, b := range append(fast, other...) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkAnswer(t, b) })
}

// checkReply fails unless inlineReply encodes r as proto.Marshal does,
// in FrameSize's length.
func checkReply(t *testing.T, r *pb.FetchResponse) {
	t.Helper()
	want, err := proto.Marshal(r)
	reply := &inlineReply{}
	proto.Merge(&reply.FetchResponse, r)
	got := reply.AppendFrame([]byte("x"))[1:]
	if err != nil {
		if len(got) != 0 {
			t.Fatalf("%v: encoded %x, which proto.Marshal refuses: %v", r, got, err)
		}
		return
	}
	if string(got) != string(want) {
		t.Fatalf("%v: encoded %x, proto.Marshal %x", r, got, want)
	}
	if n := reply.FrameSize(); n != len(want) {
		t.Fatalf("%v: FrameSize %d, encoding %d bytes", r, n, len(want))
	}
}

// TestInlineReplyEncodesAsProto: an inline answer encodes itself into
// the bytes proto.Marshal writes, and so does what it leaves to
// protobuf (a location, unknown fields).
func TestInlineReplyEncodesAsProto(t *testing.T) {
	zero, crc, idx := uint32(0), uint32(1<<31), uint32(3)
	unknown := &pb.FetchResponse{InlineData: []byte("u")}
	unknown.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), 5))
	metaUnknown := &pb.FetchResponse{Meta: &pb.TensorMeta{Key: "k"}}
	metaUnknown.Meta.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 12, protowire.VarintType), 5))
	for _, r := range []*pb.FetchResponse{
		{},
		{Meta: &pb.TensorMeta{}},
		{Meta: &pb.TensorMeta{Key: "w", Dtype: pb.DType_DTYPE_INT8, Shape: []int64{4096}, ByteLength: 4096}, InlineData: make([]byte, 4096)},
		{Meta: &pb.TensorMeta{Key: "ключ", Dtype: pb.DType(-7), Shape: []int64{0, -1, 1 << 62}, ByteLength: 1 << 40, Crc32C: &zero, InlineIndex: &idx, TransferId: 1 << 63}, TransferId: 5, RowsOfSource: true},
		{Meta: &pb.TensorMeta{Crc32C: &crc}, InlineData: make([]byte, 200)},
		{Meta: &pb.TensorMeta{Key: "w", Location: &pb.Location{Length: 9}}, TransferId: 3},
		{Meta: &pb.TensorMeta{Key: "\xff"}},
		unknown,
		metaUnknown,
	} {
		checkReply(t, r)
	}
}

// FuzzInlineReply: whatever an answer holds, inlineReply encodes it as
// proto.Marshal does.
func FuzzInlineReply(f *testing.F) {
	f.Add("w", int32(2), []byte{0, 16}, uint64(4096), uint32(0), false, []byte("abc"), uint64(0), false)
	f.Add("", int32(-1), []byte{}, uint64(0), uint32(9), true, []byte{}, uint64(1<<63), true)
	f.Fuzz(func(t *testing.T, key string, dtype int32, dims []byte, n uint64, crc uint32, hasCRC bool, data []byte, transfer uint64, rows bool) {
		m := &pb.TensorMeta{Key: key, Dtype: pb.DType(dtype), ByteLength: n, TransferId: transfer}
		for i := 0; i+2 <= len(dims); i += 2 {
			m.Shape = append(m.Shape, int64(int16(uint16(dims[i])<<8|uint16(dims[i+1])))<<(dims[i]%48))
		}
		if hasCRC {
			m.Crc32C = &crc
		}
		checkReply(t, &pb.FetchResponse{Meta: m, InlineData: data, TransferId: transfer, RowsOfSource: rows})
		checkReply(t, &pb.FetchResponse{InlineData: data})
	})
}
