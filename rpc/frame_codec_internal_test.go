package rpc

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
)

// checkEncode fails unless f, which wraps m, encodes m as proto.Marshal
// does, in FrameSize's length (both through the engine's MessageSize and
// AppendMessage, as frames are written).
func checkEncode(t *testing.T, f engine.FrameMarshaler, m proto.Message) {
	t.Helper()
	want, err := proto.Marshal(m)
	got, _ := engine.AppendMessage([]byte("x"), f)
	got = got[1:]
	if err != nil {
		if len(got) != 0 {
			t.Fatalf("%v: encoded %x, which proto.Marshal refuses: %v", m, got, err)
		}
		return
	}
	if string(got) != string(want) {
		t.Fatalf("%v: encoded %x, proto.Marshal %x", m, got, want)
	}
	if n := engine.MessageSize(f); n != len(want) {
		t.Fatalf("%v: MessageSize %d, encoding %d bytes", m, n, len(want))
	}
}

// checkDecode decodes b with fast and proto.Unmarshal and fails unless
// fast declined or decoded what protobuf does; it reports whether fast
// decoded b.
func checkDecode[M proto.Message](t *testing.T, b []byte, fresh func() M, fast func([]byte, M) bool) bool {
	t.Helper()
	want, got := fresh(), fresh()
	err := proto.Unmarshal(b, want)
	if !fast(b, got) {
		if !proto.Equal(got, fresh()) {
			t.Fatalf("%x: declined, but set %v", b, got)
		}
		return false
	}
	if err != nil {
		t.Fatalf("%x: decoded %v, which protobuf refuses: %v", b, got, err)
	}
	if !proto.Equal(want, got) {
		t.Fatalf("%x: decoded %v, protobuf %v", b, got, want)
	}
	return true
}

func callMessages() ([]*pb.CallRequest, []*pb.CallResponse) {
	idx0, idx1, crc := uint32(0), uint32(1), uint32(77)
	meta := func(key string, n uint64, idx *uint32) *pb.TensorMeta {
		return &pb.TensorMeta{Key: key, Dtype: pb.DType_DTYPE_INT8, Shape: []int64{int64(n)}, ByteLength: n, InlineIndex: idx}
	}
	unknownReq := &pb.CallRequest{Method: "m"}
	unknownReq.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), 1))
	reqs := []*pb.CallRequest{
		{},
		{Method: "echo", Tensors: []*pb.TensorMeta{meta("", 4096, &idx0)}, InlineData: [][]byte{make([]byte, 4096)}},
		{SessionId: "s", Method: "ключ", Metadata: []byte("md"), Tensors: []*pb.TensorMeta{meta("", 3, &idx0), {Crc32C: &crc, Dtype: -2}, meta("", 0, &idx1)}, InlineData: [][]byte{{1, 2, 3}, {}}},
		{Method: "far", Tensors: []*pb.TensorMeta{{ByteLength: 1 << 20, Location: &pb.Location{Length: 1 << 20}}}},
		{Method: "\xff"},
		unknownReq,
	}
	resps := []*pb.CallResponse{
		{},
		{Tensors: []*pb.TensorMeta{meta("", 4096, &idx0)}, InlineData: [][]byte{make([]byte, 4096)}},
		{Metadata: []byte{0}, Tensors: []*pb.TensorMeta{meta("", 1, &idx0), {TransferId: 4}}, InlineData: [][]byte{{9}}, TransferIds: []uint64{4, 1 << 60}},
		{Tensors: []*pb.TensorMeta{{Key: "\xff"}}},
		{Tensors: []*pb.TensorMeta{{Location: &pb.Location{}}}, TransferIds: []uint64{1}},
	}
	return reqs, resps
}

// TestCallFramesEncodeAsProto: a Call's request and reply encode
// themselves into the bytes proto.Marshal writes, and decode as
// proto.Unmarshal does, on the fast path for what calls carry.
func TestCallFramesEncodeAsProto(t *testing.T) {
	reqs, resps := callMessages()
	for i, r := range reqs {
		checkEncode(t, callRequestBody{r}, r)
		b, err := proto.Marshal(r)
		if err != nil {
			continue
		}
		fast := checkDecode(t, b, func() *pb.CallRequest { return &pb.CallRequest{} }, fastCallRequest)
		if want := i < 3; fast != want {
			t.Errorf("request %d (%v): decoded on the fast path %v, want %v", i, r, fast, want)
		}
	}
	for i, r := range resps {
		checkEncode(t, callReplyBody{r}, r)
		b, err := proto.Marshal(r)
		if err != nil {
			continue
		}
		fast := checkDecode(t, b, func() *pb.CallResponse { return &pb.CallResponse{} }, fastCallResponse)
		if want := i < 3; fast != want {
			t.Errorf("reply %d (%v): decoded on the fast path %v, want %v", i, r, fast, want)
		}
		var a callAnswer
		if err := a.UnmarshalFrame(b); err != nil || !proto.Equal(&a.CallResponse, r) {
			t.Errorf("reply %d: UnmarshalFrame %v (%v), want %v", i, &a.CallResponse, err, r)
		}
	}
	// Unpacked transfer ids, a string twice (the last wins).
	var b []byte
	b = appendVarintField(b, 4, 7)
	b = appendVarintField(b, 4, 8)
	b = appendBytesField(b, 1, []byte("a"))
	b = appendBytesField(b, 1, []byte(""))
	if !checkDecode(t, b, func() *pb.CallResponse { return &pb.CallResponse{} }, fastCallResponse) {
		t.Errorf("%x: not decoded on the fast path", b)
	}
}

// FuzzCallRequestDecode, FuzzCallResponseDecode: whatever a peer sends,
// the fast paths decode it as protobuf does, or leave it to protobuf.
func FuzzCallRequestDecode(f *testing.F) {
	reqs, _ := callMessages()
	for _, r := range reqs {
		if b, err := proto.Marshal(r); err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkDecode(t, b, func() *pb.CallRequest { return &pb.CallRequest{} }, fastCallRequest)
	})
}

func FuzzCallResponseDecode(f *testing.F) {
	_, resps := callMessages()
	for _, r := range resps {
		if b, err := proto.Marshal(r); err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkDecode(t, b, func() *pb.CallResponse { return &pb.CallResponse{} }, fastCallResponse)
	})
}

// FuzzCallFramesEncode: whatever a call holds, its frames encode it as
// proto.Marshal does.
func FuzzCallFramesEncode(f *testing.F) {
	f.Add("echo", []byte("md"), "k", int32(2), uint64(4096), []byte("abc"), uint64(3), true)
	f.Fuzz(func(t *testing.T, method string, md []byte, key string, dtype int32, n uint64, data []byte, id uint64, hasIdx bool) {
		m := &pb.TensorMeta{Key: key, Dtype: pb.DType(dtype), Shape: []int64{int64(n), -int64(id)}, ByteLength: n, TransferId: id}
		if hasIdx {
			idx := uint32(id)
			m.InlineIndex = &idx
		}
		req := &pb.CallRequest{SessionId: key, Method: method, Metadata: md, Tensors: []*pb.TensorMeta{m, {}}, InlineData: [][]byte{data, nil}}
		checkEncode(t, callRequestBody{req}, req)
		resp := &pb.CallResponse{Metadata: md, Tensors: []*pb.TensorMeta{m}, InlineData: [][]byte{data}, TransferIds: []uint64{id, n}}
		checkEncode(t, callReplyBody{resp}, resp)
	})
}

func sendMessages() []*pb.SendRequest {
	crc := uint32(5)
	unknown := &pb.SendRequest{InlineData: []byte("u")}
	unknown.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 12, protowire.VarintType), 1))
	return []*pb.SendRequest{
		{},
		{Meta: &pb.TensorMeta{Key: "k", Dtype: pb.DType_DTYPE_INT8, Shape: []int64{4096}, ByteLength: 4096}, InlineData: make([]byte, 4096)},
		{SessionId: "s", Meta: &pb.TensorMeta{Key: "rows", Crc32C: &crc}, InlineData: []byte{1}, Rows: []int64{3, 0, 1 << 40}},
		{Meta: &pb.TensorMeta{Key: "r"}, Reserve: true},
		{Meta: &pb.TensorMeta{Key: "c"}, Commit: 1 << 62},
		{Meta: &pb.TensorMeta{Key: "far", Location: &pb.Location{Length: 1}}},
		{Meta: &pb.TensorMeta{Key: "\xff"}},
		unknown,
	}
}

// TestSendFramesEncodeAsProto: a Send's request encodes itself into the
// bytes proto.Marshal writes and decodes as proto.Unmarshal does, on the
// fast path for what Sends carry.
func TestSendFramesEncodeAsProto(t *testing.T) {
	for i, r := range sendMessages() {
		checkEncode(t, sendRequestBody{r}, r)
		b, err := proto.Marshal(r)
		if err != nil {
			continue
		}
		fast := checkDecode(t, b, func() *pb.SendRequest { return &pb.SendRequest{} }, fastSendRequest)
		if want := i < 5; fast != want {
			t.Errorf("request %d (%v): decoded on the fast path %v, want %v", i, r, fast, want)
		}
	}
	// Unpacked rows, inline data twice (the last wins), meta twice (merged:
	// left to protobuf).
	var b []byte
	b = appendVarintField(b, 6, 7)
	b = appendVarintField(b, 6, 8)
	b = appendBytesField(b, 3, []byte("first"))
	b = appendBytesField(b, 3, []byte("2"))
	if !checkDecode(t, b, func() *pb.SendRequest { return &pb.SendRequest{} }, fastSendRequest) {
		t.Errorf("%x: not decoded on the fast path", b)
	}
	twice := appendBytesField(appendBytesField(nil, 2, appendBytesField(nil, 1, []byte("a"))), 2, appendVarintField(nil, 2, 3))
	if checkDecode(t, twice, func() *pb.SendRequest { return &pb.SendRequest{} }, fastSendRequest) {
		t.Errorf("%x: meta twice decoded on the fast path", twice)
	}
}

// FuzzSendRequestDecode: whatever a peer sends, the fast path decodes it
// as protobuf does, or leaves it to protobuf.
func FuzzSendRequestDecode(f *testing.F) {
	for _, r := range sendMessages() {
		if b, err := proto.Marshal(r); err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkDecode(t, b, func() *pb.SendRequest { return &pb.SendRequest{} }, fastSendRequest)
	})
}

// FuzzSendFramesEncode: whatever a Send holds, its frame encodes it as
// proto.Marshal does.
func FuzzSendFramesEncode(f *testing.F) {
	f.Add("s", "k", int32(2), uint64(4096), []byte("abc"), int64(-3), true, uint64(9))
	f.Fuzz(func(t *testing.T, session, key string, dtype int32, n uint64, data []byte, row int64, reserve bool, commit uint64) {
		r := &pb.SendRequest{SessionId: session, Meta: &pb.TensorMeta{Key: key, Dtype: pb.DType(dtype), Shape: []int64{int64(n)}, ByteLength: n}, InlineData: data, Rows: []int64{row, int64(n)}, Reserve: reserve, Commit: commit}
		checkEncode(t, sendRequestBody{r}, r)
		r.Meta, r.Rows = nil, nil
		checkEncode(t, sendRequestBody{r}, r)
	})
}
