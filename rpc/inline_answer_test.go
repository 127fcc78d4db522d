package rpc

import (
	"bytes"
	"context"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestFetchAnswerDecodesAsProtobuf: a Fetch answer's body decodes into
// fetchAnswer as proto.Unmarshal decodes it into a FetchResponse,
// whatever the order of its fields, the inline tensor's size (into
// reused memory or not), a field repeated, or bytes that do not parse.
func TestFetchAnswerDecodesAsProtobuf(t *testing.T) {
	meta := &pb.TensorMeta{Key: "k", Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{3}, ByteLength: 3}
	enc := func(r *pb.FetchResponse) []byte {
		b, err := proto.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	data := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i*7 + 1)
		}
		return b
	}
	field := func(num protowire.Number, v []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), v)
	}
	metaBytes, _ := proto.Marshal(meta)
	cases := map[string][]byte{
		"no tensor":         enc(&pb.FetchResponse{Meta: meta, TransferId: 7}),
		"small tensor":      enc(&pb.FetchResponse{Meta: meta, InlineData: data(100)}),
		"4 KiB":             enc(&pb.FetchResponse{Meta: meta, InlineData: data(4 << 10), TransferId: 9, RowsOfSource: true}),
		"5 KiB":             enc(&pb.FetchResponse{Meta: meta, InlineData: data(5 << 10)}),
		"16 KiB":            enc(&pb.FetchResponse{Meta: meta, InlineData: data(16 << 10)}),
		"past 16 KiB":       enc(&pb.FetchResponse{Meta: meta, InlineData: data(16<<10 + 1)}),
		"tensor first":      append(append(field(2, data(2<<10)), field(1, metaBytes)...), protowire.AppendVarint(protowire.AppendTag(nil, 3, protowire.VarintType), 5)...),
		"meta split around": append(append(field(1, metaBytes[:len(metaBytes)/2+1]), field(2, data(2<<10))...), field(1, metaBytes)...),
		"tensor twice":      append(field(2, data(2<<10)), field(2, data(3<<10))...),
		"truncated":         enc(&pb.FetchResponse{Meta: meta, InlineData: data(2 << 10)})[:1500],
		"empty":             nil,
	}
	for name, b := range cases {
		want := &pb.FetchResponse{}
		wantErr := proto.Unmarshal(b, want)
		got := &fetchAnswer{}
		err := got.UnmarshalFrame(b)
		if (err != nil) != (wantErr != nil) {
			t.Errorf("%s: error %v, protobuf's %v", name, err, wantErr)
			continue
		}
		if err == nil && !proto.Equal(&got.FetchResponse, want) {
			t.Errorf("%s: decoded %v, protobuf decodes %v", name, &got.FetchResponse, want)
		}
		recycleInline(got.InlineData)
	}
}

// TestInlineRecycledAfterCopy: the memory a Fetch answer's inline
// tensor was decoded into goes back for reuse once the tensor has its
// own copy: tensors fetched earlier keep their bytes while later Fetches
// reuse it.
func TestInlineRecycledAfterCopy(t *testing.T) {
	srv, c := pair(t, TransportTCP, nil, nil)
	ctx := context.Background()
	const n = 4 << 10
	var want [][]byte
	var got []*Tensor
	for i := range 8 {
		b := bytes.Repeat([]byte{byte(i + 1)}, n)
		zt, err := zerocopy.New(zerocopy.Uint8, []int64{n}, b)
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Publish(ctx, "k", WrapTensor(zt)); err != nil {
			t.Fatal(err)
		}
		f, err := c.Fetch(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		got, want = append(got, f), append(want, b)
	}
	for i, f := range got {
		if !bytes.Equal(f.Bytes(), want[i]) {
			t.Errorf("Fetch %d: its tensor's bytes changed after later Fetches", i)
		}
		f.Release()
	}
}
