package chunkcodec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

func testHeader() *tensorrpcpb.ChunkHeader {
	return &tensorrpcpb.ChunkHeader{
		Method:   "Model/Forward",
		Metadata: []byte("trace=abc"),
		Tensors: []*tensorrpcpb.TensorMeta{{
			Key:        "w",
			Dtype:      tensorrpcpb.DType_DTYPE_FLOAT32,
			Shape:      []int64{2, 3},
			ByteLength: 24,
			Crc32C:     proto.Uint32(0xdeadbeef),
		}},
	}
}

func randBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16)})
	_, _ = r.Read(b)
	return b
}

// addr returns the address of b's first byte, or 0 when b is empty.
func addr(b []byte) uintptr {
	if len(b) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

func sameHeader(a, b *tensorrpcpb.ChunkHeader) bool {
	if (a == nil) != (b == nil) {
		return false
	}
	return a == nil || proto.Equal(a, b)
}

func TestRoundTrip(t *testing.T) {
	defer leakcheck.Check(t)
	codec := New(nil)
	tests := []struct {
		name   string
		header *tensorrpcpb.ChunkHeader
		sizes  []int // sizes of the data buffers
	}{
		{"empty", nil, nil},
		{"header only", testHeader(), nil},
		{"empty header", &tensorrpcpb.ChunkHeader{}, nil},
		{"header and zero bytes", testHeader(), []int{0}},
		{"one byte", nil, []int{1}},
		{"one byte with header", testHeader(), []int{1}},
		{"127 bytes", nil, []int{127}},
		{"128 bytes", nil, []int{128}},
		{"odd 1023", nil, []int{1023}},
		{"odd 1025", testHeader(), []int{1025}},
		{"odd 65537", nil, []int{65537}},
		{"1 MiB plus 3", testHeader(), []int{1<<20 + 3}},
		{"multi buffer", nil, []int{5000, 1, 0, 16384, 3333}},
		{"multi buffer with header", testHeader(), []int{1024, 2048, 7, 1 << 16}},
		{"big header", &tensorrpcpb.ChunkHeader{Metadata: randBytes(5000, 9)}, []int{100}},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pool := newCountingPool()
			var want []byte
			var data mem.BufferSlice
			for j, n := range tc.sizes {
				b := randBytes(n, uint64(i*100+j))
				want = append(want, b...)
				data = append(data, pool.buffer(b))
			}
			oc := &OutChunk{Header: tc.header, Data: data}
			out, err := codec.Marshal(oc)
			if err != nil {
				t.Fatal(err)
			}
			wire := out.Materialize()

			// A client with only the .proto encodes the same bytes...
			pb := &tensorrpcpb.Chunk{Header: tc.header, Data: want}
			pbWire, err := proto.Marshal(pb)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(wire, pbWire) {
				t.Fatalf("wire differs from proto.Marshal:\n got %x\nwant %x", head(wire), head(pbWire))
			}
			// ...and decodes ours.
			var got tensorrpcpb.Chunk
			if err := proto.Unmarshal(wire, &got); err != nil {
				t.Fatal(err)
			}
			if !sameHeader(got.Header, tc.header) || !bytes.Equal(got.Data, want) {
				t.Fatalf("proto.Unmarshal of our bytes: header %v, %d data bytes", got.Header, len(got.Data))
			}

			// Decode with our codec: straight from the marshalled slice (as
			// a loopback would), and from copies split at awkward places.
			inputs := map[string]mem.BufferSlice{"marshalled": out}
			for _, size := range []int{1, 3, 1000, 16384} {
				if len(pbWire)/size > 20000 {
					continue // enough buffers; keep the test fast
				}
				inputs[fmt.Sprint("split ", size)] = pool.split(pbWire, size)
			}
			for name, in := range inputs {
				var ic InChunk
				if err := codec.Unmarshal(in, &ic); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				in.Free() // as gRPC does when Unmarshal returns
				if !sameHeader(ic.Header, tc.header) {
					t.Errorf("%s: header %v, want %v", name, ic.Header, tc.header)
				}
				if len(want) == 0 && ic.Data != nil {
					t.Errorf("%s: Data = %v, want nil", name, ic.Data)
				}
				if g := ic.Data.Materialize(); !bytes.Equal(g, want) {
					t.Errorf("%s: %d data bytes differ from the %d sent", name, len(g), len(want))
				}
				ic.Free()
				ic.Free() // idempotent
			}
			oc.Free()
			pool.check(t)
		})
	}
}

func head(b []byte) []byte { return b[:min(len(b), 64)] }

func TestMarshalZeroCopy(t *testing.T) {
	defer leakcheck.Check(t)
	var rc releaseCounter
	b := randBytes(1<<20, 1)
	oc := &OutChunk{Header: testHeader(), Data: mem.BufferSlice{Wrap(b, rc.release)}}
	out, err := New(nil).Marshal(oc)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, buf := range out {
		if addr(buf.ReadOnlyData()) == addr(b) {
			found = true
		}
	}
	if !found {
		t.Fatalf("no buffer of the marshalled message shares the caller's data at %#x", addr(b))
	}
	if got, want := out.Len(), 1+1+proto.Size(oc.Header)+1+3+len(b); got != want {
		t.Fatalf("marshalled %d bytes, want %d", got, want)
	}
	oc.Free() // the caller is done...
	if rc.count() != 0 {
		t.Fatal("released while gRPC still held the data")
	}
	out.Free() // ...then gRPC
	if n := rc.count(); n != 1 {
		t.Fatalf("released %d times, want 1", n)
	}
}

func TestUnmarshalZeroCopy(t *testing.T) {
	defer leakcheck.Check(t)
	pool := newCountingPool()
	data := randBytes(1<<16, 2)
	wire, _ := proto.Marshal(&tensorrpcpb.Chunk{Header: testHeader(), Data: data})
	in := mem.BufferSlice{pool.buffer(wire)}
	var ic InChunk
	if err := New(nil).Unmarshal(in, &ic); err != nil {
		t.Fatal(err)
	}
	prefix := len(wire) - len(data)
	if got, want := addr(ic.Data[0].ReadOnlyData()), addr(in[0].ReadOnlyData()[prefix:]); got != want {
		t.Fatalf("Data starts at %#x, want %#x inside the input buffer", got, want)
	}
	in.Free() // gRPC's reference
	if pool.outstanding() != 1 {
		t.Fatal("input buffer returned to the pool while InChunk.Data still refers to it")
	}
	if !bytes.Equal(ic.Data.Materialize(), data) {
		t.Fatal("data differs")
	}
	ic.Free()
	pool.check(t)
}

// TestProtobufSemantics feeds hand-made encodings that a protobuf encoder
// may legally produce and compares the result with proto.Unmarshal.
func TestProtobufSemantics(t *testing.T) {
	defer leakcheck.Check(t)
	h1, _ := proto.Marshal(&tensorrpcpb.ChunkHeader{Method: "a", Tensors: []*tensorrpcpb.TensorMeta{{Key: "x"}}})
	h2, _ := proto.Marshal(&tensorrpcpb.ChunkHeader{Metadata: []byte("m"), Tensors: []*tensorrpcpb.TensorMeta{{Key: "y"}}})
	d1, d2 := randBytes(3000, 3), randBytes(2000, 4)
	var (
		b    = protowire.AppendTag
		tags = func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	)
	field := func(num protowire.Number, v []byte) []byte {
		return protowire.AppendBytes(b(nil, num, protowire.BytesType), v)
	}
	tests := []struct {
		name string
		wire []byte
	}{
		{"last data wins", tags(field(2, d1), field(2, d2))},
		{"empty data last wins", tags(field(2, d1), field(2, nil))},
		{"headers merge", tags(field(1, h1), field(2, d1), field(1, h2))},
		{"zero-length header", field(1, nil)},
		{"unknown fields skipped", tags(
			protowire.AppendVarint(b(nil, 3, protowire.VarintType), 1<<63),
			field(2, d1),
			protowire.AppendFixed32(b(nil, 4, protowire.Fixed32Type), 7),
			protowire.AppendFixed64(b(nil, 5, protowire.Fixed64Type), 8),
			field(6, d2),
			field(protowire.MaxValidNumber, []byte("z")),
			field(1, h1))},
		{"non-minimal varint length", tags([]byte{0x12, 0x83, 0x80, 0x80, 0x00}, []byte("abc"))},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var want tensorrpcpb.Chunk
			if err := proto.Unmarshal(tc.wire, &want); err != nil {
				t.Fatalf("proto.Unmarshal: %v", err)
			}
			for _, size := range []int{1, 7, len(tc.wire)} {
				pool := newCountingPool()
				in := pool.split(tc.wire, size)
				var ic InChunk
				if err := New(nil).Unmarshal(in, &ic); err != nil {
					t.Fatalf("split %d: %v", size, err)
				}
				in.Free()
				if !sameHeader(ic.Header, want.Header) {
					t.Errorf("split %d: header %v, want %v", size, ic.Header, want.Header)
				}
				if !bytes.Equal(ic.Data.Materialize(), want.Data) {
					t.Errorf("split %d: data differs", size)
				}
				ic.Free()
				pool.check(t)
			}
		})
	}
}

func TestUnmarshalMalformed(t *testing.T) {
	defer leakcheck.Check(t)
	validData := protowire.AppendBytes([]byte{0x12}, randBytes(2000, 5))
	tests := []struct {
		name string
		wire []byte
	}{
		{"truncated tag", []byte{0x80}},
		{"truncated length", []byte{0x12, 0x80}},
		{"length past end", []byte{0x12, 0x05, 1, 2, 3}},
		{"huge length", []byte{0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}},
		{"varint of 11 bytes", []byte{0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}},
		{"varint overflows", []byte{0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}},
		{"truncated varint value", []byte{0x18, 0xff}},
		{"truncated fixed32", []byte{0x25, 1, 2, 3}},
		{"truncated fixed64", []byte{0x29, 1, 2, 3, 4, 5, 6, 7}},
		{"field number 0", []byte{0x02, 0x00}},
		{"field number too big", protowire.AppendTag(nil, protowire.MaxValidNumber+1, protowire.BytesType)},
		{"header as varint", []byte{0x08, 0x01}},
		{"data as fixed32", []byte{0x15, 1, 2, 3, 4}},
		{"start group", []byte{0x1b, 0x1c}},
		{"end group", []byte{0x1c}},
		{"wire type 6", []byte{0x1e}},
		{"wire type 7", []byte{0x1f}},
		{"bad header", []byte{0x0a, 0x02, 0x0a, 0x05}},
		{"header with invalid UTF-8", []byte{0x0a, 0x03, 0x0a, 0x01, 0xff}},
		{"data then garbage", append(append([]byte(nil), validData...), 0x12, 0x09)},
		{"data then group", append(append([]byte(nil), validData...), 0x0b)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, size := range []int{1, 5, len(tc.wire)} {
				pool := newCountingPool()
				in := pool.split(tc.wire, size)
				ic := InChunk{Header: testHeader()}
				err := New(nil).Unmarshal(in, &ic)
				in.Free()
				if !errors.Is(err, ErrMalformed) {
					t.Errorf("split %d: err = %v, want ErrMalformed", size, err)
				}
				if ic.Header != nil || ic.Data != nil {
					t.Errorf("split %d: InChunk not cleared on error: %+v", size, ic)
				}
				pool.check(t)
			}
		})
	}
}

func TestWrap(t *testing.T) {
	defer leakcheck.Check(t)
	t.Run("refcounted", func(t *testing.T) {
		var rc releaseCounter
		b := make([]byte, 4096)
		buf := Wrap(b, rc.release)
		if addr(buf.ReadOnlyData()) != addr(b) || buf.Len() != len(b) {
			t.Fatal("Wrap copied")
		}
		buf.Ref()
		buf.Free()
		if rc.count() != 0 {
			t.Fatal("released early")
		}
		buf.Free()
		if rc.count() != 1 {
			t.Fatalf("released %d times, want 1", rc.count())
		}
	})
	t.Run("small is copied and released at once", func(t *testing.T) {
		var rc releaseCounter
		b := []byte("tiny")
		buf := Wrap(b, rc.release)
		if rc.count() != 1 {
			t.Fatalf("released %d times, want 1", rc.count())
		}
		b[0] = 'T'
		if string(buf.ReadOnlyData()) != "tiny" {
			t.Fatal("small buffer was not copied")
		}
		buf.Free()
		if rc.count() != 1 {
			t.Fatal("released twice")
		}
	})
	t.Run("nil release is zero copy", func(t *testing.T) {
		b := []byte("tiny")
		if buf := Wrap(b, nil); addr(buf.ReadOnlyData()) != addr(b) {
			t.Fatal("copied")
		}
	})
	t.Run("slices", func(t *testing.T) {
		var rc releaseCounter
		big := make([]byte, 10000)
		views := [][]byte{big[:5000], []byte("small"), nil, big[5000:]}
		bs := WrapSlices(views, rc.release)
		if len(bs) != 3 {
			t.Fatalf("%d buffers, want 3", len(bs))
		}
		out, err := New(nil).Marshal(&OutChunk{Data: bs})
		if err != nil {
			t.Fatal(err)
		}
		bs.Free()
		if rc.count() != 0 {
			t.Fatal("released while gRPC still held the data")
		}
		out.Free()
		if rc.count() != 1 {
			t.Fatalf("released %d times, want 1", rc.count())
		}
	})
}

func TestDelegation(t *testing.T) {
	defer leakcheck.Check(t)
	codec := New(nil)
	if codec.Name() != Name || Name != "tensorrpc-chunk" {
		t.Fatalf("Name() = %q", codec.Name())
	}
	if New(codec).fallback != stockProto {
		t.Fatal("New(Codec) did not unwrap")
	}
	msgs := []proto.Message{
		&tensorrpcpb.HandshakeRequest{ProtocolVersion: 1, ClientName: "c"},
		&tensorrpcpb.FetchResponse{InlineData: randBytes(5000, 6), TransferId: 7},
		&tensorrpcpb.Chunk{Header: testHeader(), Data: randBytes(3000, 7)},
	}
	for _, m := range msgs {
		got, err := codec.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		want, err := stockProto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Materialize(), want.Materialize()) {
			t.Errorf("%T: bytes differ from the stock codec's", m)
		}
		back := m.ProtoReflect().New().Interface()
		if err := codec.Unmarshal(got, back); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(back, m) {
			t.Errorf("%T: round trip through the fallback differs", m)
		}
		got.Free()
		want.Free()
	}
	if _, err := codec.Marshal(struct{}{}); err == nil {
		t.Error("Marshal of a non-proto value succeeded")
	}
	if err := codec.Unmarshal(nil, &OutChunk{}); err == nil {
		t.Error("Unmarshal into *OutChunk succeeded")
	}
	if _, err := codec.Marshal((*OutChunk)(nil)); err == nil {
		t.Error("Marshal of a nil *OutChunk succeeded")
	}
	var zero Codec
	if _, err := zero.Marshal(&tensorrpcpb.Chunk{}); err == nil {
		t.Error("zero Codec delegated to nothing")
	}
	var _ encoding.CodecV2 = zero
}

// fakeServerStream records what a handler sends and replays chunks to
// receive; its context carries no metadata (a client of the proto codec).
type fakeServerStream struct {
	grpc.ServerStream
	sent []any
	recv []*tensorrpcpb.Chunk
}

func (f *fakeServerStream) Context() context.Context { return context.Background() }
func (f *fakeServerStream) SendMsg(m any) error      { f.sent = append(f.sent, m); return nil }
func (f *fakeServerStream) RecvMsg(m any) error {
	if len(f.recv) == 0 {
		return io.EOF
	}
	c, ok := m.(*tensorrpcpb.Chunk)
	if !ok {
		return fmt.Errorf("RecvMsg into %T", m)
	}
	proto.Merge(c, f.recv[0])
	f.recv = f.recv[1:]
	return nil
}

func TestServerStreamProto(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := randBytes(3000, 1), randBytes(2000, 2)
	f := &fakeServerStream{recv: []*tensorrpcpb.Chunk{{Header: testHeader()}, {Data: a}, {}}}
	ss := ServerStream(f)
	if ss == grpc.ServerStream(f) {
		t.Fatal("ServerStream did not wrap a stream without the codec's content-type")
	}
	var rc releaseCounter
	out := &OutChunk{Header: testHeader(), Data: mem.BufferSlice{Wrap(a, rc.release), Wrap(b, rc.release)}}
	if err := ss.SendMsg(out); err != nil {
		t.Fatal(err)
	}
	out.Free()
	if rc.count() != 2 {
		t.Fatalf("%d of 2 buffers released after SendMsg and Free", rc.count())
	}
	one := &OutChunk{Data: mem.BufferSlice{mem.SliceBuffer(a)}}
	if err := ss.SendMsg(one); err != nil {
		t.Fatal(err)
	}
	if err := ss.SendMsg(&InChunk{}); err != nil {
		t.Fatal(err)
	}
	if err := ss.SendMsg(&tensorrpcpb.SendResponse{}); err != nil {
		t.Fatal(err)
	}
	if err := ss.SendMsg((*OutChunk)(nil)); err == nil {
		t.Error("SendMsg of a nil *OutChunk succeeded")
	}
	if len(f.sent) != 4 {
		t.Fatalf("sent %d messages", len(f.sent))
	}
	c0, _ := f.sent[0].(*tensorrpcpb.Chunk)
	if c0 == nil || !proto.Equal(c0.Header, testHeader()) || !bytes.Equal(c0.Data, append(append([]byte(nil), a...), b...)) {
		t.Errorf("first chunk sent as %v", f.sent[0])
	}
	if c1, _ := f.sent[1].(*tensorrpcpb.Chunk); c1 == nil || c1.Header != nil || !bytes.Equal(c1.Data, a) {
		t.Errorf("second chunk sent as %v", f.sent[1])
	}
	if c2, _ := f.sent[2].(*tensorrpcpb.Chunk); c2 == nil || c2.Header != nil || c2.Data != nil {
		t.Errorf("empty chunk sent as %v", f.sent[2])
	}
	if _, ok := f.sent[3].(*tensorrpcpb.SendResponse); !ok {
		t.Errorf("SendResponse sent as %T", f.sent[3])
	}

	var in InChunk
	if err := ss.RecvMsg(&in); err != nil || !proto.Equal(in.Header, testHeader()) || in.Data != nil {
		t.Fatalf("header chunk: %v %v %d", err, in.Header, in.Len())
	}
	if err := ss.RecvMsg(&in); err != nil || in.Header != nil || in.Len() != len(a) || !bytes.Equal(in.Data.Materialize(), a) {
		t.Fatalf("data chunk: %v %v %d", err, in.Header, in.Len())
	}
	in.Free()
	if err := ss.RecvMsg(&in); err != nil || in.Header != nil || in.Data != nil {
		t.Fatalf("empty chunk: %v %v %d", err, in.Header, in.Len())
	}
	if err := ss.RecvMsg(&OutChunk{}); err == nil {
		t.Error("RecvMsg into *OutChunk succeeded")
	}
	if err := ss.RecvMsg(&in); err != io.EOF {
		t.Fatalf("at the end: %v", err)
	}

	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("content-type", "application/grpc+"+Name))
	own := &ctxServerStream{fakeServerStream: f, ctx: ctx}
	if ServerStream(own) != grpc.ServerStream(own) {
		t.Error("ServerStream wrapped a stream of this codec")
	}
}

type ctxServerStream struct {
	*fakeServerStream
	ctx context.Context
}

func (s *ctxServerStream) Context() context.Context { return s.ctx }
