package suite

import (
	"fmt"
	"runtime"
	"time"

	flatbuffers "github.com/google/flatbuffers/go"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/tensorfb"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// The ser/des micro-suite: one tensor message (key, dtype, shape, bytes)
// encoded and decoded in process, in the shape of the FlatBuffers
// benchmark table (encode, decode+traverse, wire size, transient
// allocations).

// SerdesResult is one format at one tensor size.
type SerdesResult struct {
	Kind   string `json:"kind"` // "serdes"
	Format string `json:"format"`
	Bytes  int64  `json:"bytes"` // tensor bytes
	// WireBytes is what crosses the wire for one tensor, header included.
	WireBytes int64 `json:"wire_bytes"`
	// EncodeNs and DecodeNs are median nanoseconds per message; decode
	// includes reading every field and touching the first and last tensor
	// byte.
	EncodeNs         float64 `json:"encode_ns"`
	DecodeNs         float64 `json:"decode_ns"`
	EncodeAllocs     float64 `json:"encode_allocs"`
	EncodeAllocBytes float64 `json:"encode_alloc_bytes"`
	DecodeAllocs     float64 `json:"decode_allocs"`
	DecodeAllocBytes float64 `json:"decode_alloc_bytes"`
}

// serdesFormat encodes and decodes the tensor message one way.
type serdesFormat struct {
	name  string
	about string
	// prepare returns encode, which encodes the message and returns the
	// wire size, and decode, which decodes what encode produced.
	prepare func(key string, dtype zerocopy.DType, shape []int64, data []byte) (encode func() int, decode func() error)
}

// sink keeps decoded values alive so that the compiler cannot drop reads.
var sink uint64

func serdesFormats() []serdesFormat {
	return []serdesFormat{
		{
			name:  "protobuf",
			about: "tensorrpcpb.FetchResponse{Meta: TensorMeta, InlineData: bytes}; proto.Marshal / proto.Unmarshal into a new message",
			prepare: func(key string, dtype zerocopy.DType, shape []int64, data []byte) (func() int, func() error) {
				var wireMsg []byte
				encode := func() int {
					m := &tensorrpcpb.FetchResponse{
						Meta:       &tensorrpcpb.TensorMeta{Key: key, Dtype: tensorrpcpb.DType(dtype), Shape: shape, ByteLength: uint64(len(data))},
						InlineData: data,
					}
					b, err := proto.Marshal(m)
					if err != nil {
						panic(err)
					}
					wireMsg = b
					return len(b)
				}
				decode := func() error {
					var m tensorrpcpb.FetchResponse
					if err := proto.Unmarshal(wireMsg, &m); err != nil {
						return err
					}
					meta := m.GetMeta()
					sink += uint64(len(meta.GetKey())) + uint64(meta.GetDtype()) + meta.GetByteLength()
					for _, d := range meta.GetShape() {
						sink += uint64(d)
					}
					return touch(m.GetInlineData(), len(data))
				}
				return encode, decode
			},
		},
		{
			name:  "flatbuffers",
			about: "tensorfb.Tensor (benchmarks/internal/tensorfb/tensor.fbs) into a reused Builder; GetRootAsTensor and accessors, no verifier",
			prepare: func(key string, dtype zerocopy.DType, shape []int64, data []byte) (func() int, func() error) {
				b := flatbuffers.NewBuilder(len(data) + fbSlack)
				encode := func() int {
					b.Reset()
					encodeTensorFB(b, key, uint8(dtype), shape, data)
					return len(b.FinishedBytes())
				}
				decode := func() error {
					t := tensorfb.GetRootAsTensor(b.FinishedBytes(), 0)
					sink += uint64(len(t.Key())) + uint64(t.Dtype())
					for j := range t.ShapeLength() {
						sink += uint64(t.Shape(j))
					}
					return touch(t.DataBytes(), len(data))
				}
				return encode, decode
			},
		},
		{
			name:  "tensorrpc-header",
			about: "proto/wire header (FlatBuffers, validated on decode) beside the raw bytes, which are sent from where they are",
			prepare: func(key string, dtype zerocopy.DType, shape []int64, data []byte) (func() int, func() error) {
				var enc wire.Encoder
				h := wire.Header{Key: []byte(key), DType: dtype, ByteLength: uint64(len(data))}
				if err := h.SetShape(shape); err != nil {
					panic(err)
				}
				var hdr []byte
				encode := func() int {
					b, err := enc.Encode(&h)
					if err != nil {
						panic(err)
					}
					hdr = b
					return len(b) + len(data)
				}
				// One Header, reused: wire.Decode's parameter escapes, so a
				// Header declared per call would cost a 384-byte allocation.
				var got wire.Header
				decode := func() error {
					if err := wire.Decode(hdr, &got); err != nil {
						return err
					}
					sink += uint64(len(got.Key)) + uint64(got.DType) + got.ByteLength
					for _, d := range got.Shape() {
						sink += uint64(d)
					}
					return touch(data[:got.ByteLength], len(data))
				}
				return encode, decode
			},
		},
		{
			name:  "protobuf-meta+raw",
			about: "tensorrpcpb.TensorMeta alone (as tensorrpc's control messages carry it) beside the raw bytes",
			prepare: func(key string, dtype zerocopy.DType, shape []int64, data []byte) (func() int, func() error) {
				var wireMsg []byte
				encode := func() int {
					m := &tensorrpcpb.TensorMeta{Key: key, Dtype: tensorrpcpb.DType(dtype), Shape: shape, ByteLength: uint64(len(data))}
					b, err := proto.Marshal(m)
					if err != nil {
						panic(err)
					}
					wireMsg = b
					return len(b) + len(data)
				}
				decode := func() error {
					var m tensorrpcpb.TensorMeta
					if err := proto.Unmarshal(wireMsg, &m); err != nil {
						return err
					}
					sink += uint64(len(m.GetKey())) + uint64(m.GetDtype()) + m.GetByteLength()
					for _, d := range m.GetShape() {
						sink += uint64(d)
					}
					return touch(data[:m.GetByteLength()], len(data))
				}
				return encode, decode
			},
		},
	}
}

func touch(b []byte, want int) error {
	if len(b) != want {
		return fmt.Errorf("decoded %d tensor bytes, want %d", len(b), want)
	}
	if want > 0 {
		sink += uint64(b[0]) + uint64(b[want-1])
	}
	return nil
}

// opCost is the median time and the mean allocations of one call of fn.
type opCost struct {
	ns, allocs, allocBytes float64
}

// measureOp calls fn in reps timed loops that each last about target, and
// counts the heap allocations of the loops.
func measureOp(fn func(), target time.Duration, reps int) opCost {
	fn() // warm: first-use allocations are not transient
	t0 := time.Now()
	fn()
	one := max(time.Since(t0), 20*time.Nanosecond)
	n := max(1, int(target/one))
	var before, after runtime.MemStats
	var ns []float64
	var allocs, allocBytes float64
	for range reps {
		runtime.ReadMemStats(&before)
		t0 := time.Now()
		for range n {
			fn()
		}
		el := time.Since(t0)
		runtime.ReadMemStats(&after)
		ns = append(ns, float64(el.Nanoseconds())/float64(n))
		allocs += float64(after.Mallocs-before.Mallocs) / float64(n)
		allocBytes += float64(after.TotalAlloc-before.TotalAlloc) / float64(n)
	}
	return opCost{ns: median(ns), allocs: allocs / float64(reps), allocBytes: allocBytes / float64(reps)}
}

// runSerdes measures every format at every size on payload p.
func runSerdes(src *payloadSource, p Payload, sizes []int, target time.Duration, reps int, progress func(string)) ([]SerdesResult, error) {
	var out []SerdesResult
	for _, n := range sizes {
		data := make([]byte, n)
		src.fill(p, data)
		for _, f := range serdesFormats() {
			encode, decode := f.prepare(tensorKey, p.DType, shapeOf(n, p.DType), data)
			wireBytes := encode()
			if err := decode(); err != nil {
				return nil, fmt.Errorf("%s at %s: %w", f.name, bytesize.Format(int64(n)), err)
			}
			enc := measureOp(func() { encode() }, target, reps)
			dec := measureOp(func() {
				if err := decode(); err != nil {
					panic(err)
				}
			}, target, reps)
			r := SerdesResult{
				Kind: "serdes", Format: f.name, Bytes: int64(n), WireBytes: int64(wireBytes),
				EncodeNs: enc.ns, DecodeNs: dec.ns,
				EncodeAllocs: enc.allocs, EncodeAllocBytes: enc.allocBytes,
				DecodeAllocs: dec.allocs, DecodeAllocBytes: dec.allocBytes,
			}
			progress(fmt.Sprintf("serdes %-18s %8s: encode %s, decode %s", f.name, bytesize.Format(int64(n)), fmtNs(r.EncodeNs), fmtNs(r.DecodeNs)))
			out = append(out, r)
		}
	}
	return out, nil
}
