package rpc

import (
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// fetchAnswer is a Fetch's answer as a frame carries it: a FetchResponse
// whose inline tensor is copied out of the frame into memory that
// recycleInline takes back once the tensor has its bytes, rather than
// into new memory each call (engine.FrameUnmarshaler): the answer of a
// 4 KiB Fetch was more than half the bytes the call allocated, and the
// garbage collector's work grew with them.
type fetchAnswer struct{ pb.FetchResponse }

// UnmarshalFrame decodes b as proto.Unmarshal would, the inline tensor
// into inlineBuf's memory.
func (a *fetchAnswer) UnmarshalFrame(b []byte) error {
	if fastFetchAnswer(b, &a.FetchResponse) {
		return nil
	}
	start, end, data, ok := inlineField(b)
	if !ok || len(data) < minPooledInline {
		return proto.Unmarshal(b, &a.FetchResponse)
	}
	// The fields before the tensor's and those after it: protobuf
	// merges a message's fields however they are split.
	if err := proto.Unmarshal(b[:start], &a.FetchResponse); err != nil {
		return err
	}
	if end < len(b) {
		if err := (proto.UnmarshalOptions{Merge: true}).Unmarshal(b[end:], &a.FetchResponse); err != nil {
			return err
		}
	}
	a.InlineData = inlineBuf(len(data))
	copy(a.InlineData, data)
	return nil
}

// inlineField finds FetchResponse.inline_data (field 2) in its encoding
// b: the field's bytes b[start:end] and its value. ok is false when the
// field is not there exactly once as bytes, or b does not parse:
// proto.Unmarshal then decides.
func inlineField(b []byte) (start, end int, data []byte, ok bool) {
	for off := 0; off < len(b); {
		num, typ, n := protowire.ConsumeTag(b[off:])
		if n < 0 {
			return 0, 0, nil, false
		}
		m := protowire.ConsumeFieldValue(num, typ, b[off+n:])
		if m < 0 {
			return 0, 0, nil, false
		}
		if num == 2 {
			if ok || typ != protowire.BytesType {
				return 0, 0, nil, false
			}
			data, _ = protowire.ConsumeBytes(b[off+n:])
			start, end, ok = off, off+n+m, true
		}
		off += n + m
	}
	return start, end, data, ok
}

// Inline tensors of minPooledInline bytes up to 16 KiB (frames carry
// them up to the eager threshold) are decoded into reused memory, in two
// sizes; smaller and larger ones into new memory.
const minPooledInline = 1 << 10

var (
	inline4K  = sync.Pool{New: func() any { return new([4 << 10]byte) }}
	inline16K = sync.Pool{New: func() any { return new([16 << 10]byte) }}
)

// inlineBuf is n bytes for an inline tensor, to recycleInline once used.
func inlineBuf(n int) []byte {
	switch {
	case n < minPooledInline || n > 16<<10:
		return make([]byte, n)
	case n <= 4<<10:
		return inline4K.Get().(*[4 << 10]byte)[:n]
	default:
		return inline16K.Get().(*[16 << 10]byte)[:n]
	}
}

// inlineCopy is a copy of b in inlineBuf's memory: a request's or a
// reply's inline tensor, decoded out of its frame (whose slot is posted
// again at once), to recycleInline once copied into the pool. (New
// memory for the 4 KiB tensor of a Call's request and that of its reply
// was two thirds of the bytes a 4 KiB Call allocated, 12.7 KB, and the
// garbage collections they made woke its workers: 0.05 hand-offs a
// call.)
func inlineCopy(b []byte) []byte {
	c := inlineBuf(len(b))
	copy(c, b)
	return c
}

// recycleInlines is recycleInline of each; the slices are left empty.
func recycleInlines(bs [][]byte) {
	for i, b := range bs {
		recycleInline(b)
		bs[i] = nil
	}
}

// recycleInline takes back the memory of an answer's inline tensor once
// its bytes are copied where they go: nothing may use b after. Memory
// not of inlineBuf's sizes is left to the garbage collector.
func recycleInline(b []byte) {
	switch cap(b) {
	case 4 << 10:
		inline4K.Put((*[4 << 10]byte)(b[:cap(b)]))
	case 16 << 10:
		inline16K.Put((*[16 << 10]byte)(b[:cap(b)]))
	}
}

// fastFetchAnswer decodes b, the FetchResponse of a FETCH_RESP frame,
// into a (a new one) as proto.Unmarshal would, the inline tensor into
// inlineBuf's memory, when b holds only what answers carry: meta (its
// key, dtype, shape, byte_length, crc32c and transfer_id), inline_data,
// transfer_id and rows_of_source, meta and inline_data once. Protobuf's
// reflection took about two thirds of a microsecond to decode a 4 KiB
// Fetch's answer, more than the rest of its decoding. For anything else
// (a location, a field it does not know, an encoding it does not
// follow, a key that is not UTF-8) it reports false and sets nothing:
// proto.Unmarshal then decodes or refuses b.
func fastFetchAnswer(b []byte, a *pb.FetchResponse) bool {
	var (
		meta     *pb.TensorMeta
		data     []byte
		haveData bool
		transfer uint64
		rows     bool
	)
	for len(b) > 0 {
		num, typ, v, bs, rest, ok := field(b)
		if !ok {
			return false
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType && meta == nil:
			if meta = fastTensorMeta(bs); meta == nil {
				return false
			}
		case num == 2 && typ == protowire.BytesType && !haveData:
			data, haveData = bs, true
		case num == 3 && typ == protowire.VarintType:
			transfer = v
		case num == 4 && typ == protowire.VarintType:
			rows = v != 0
		default:
			return false
		}
	}
	a.Meta, a.TransferId, a.RowsOfSource = meta, transfer, rows
	if len(data) > 0 { // protobuf leaves empty bytes nil
		a.InlineData = inlineBuf(len(data))
		copy(a.InlineData, data)
	}
	return true
}

// inlineReply is a Fetch's inline answer as a frame carries it: a
// FetchResponse that encodes itself (engine.FrameMarshaler), into the
// bytes proto.Marshal writes, without protobuf's reflection (which took
// more than the 4 KiB copy to encode a 4 KiB Fetch's answer).
type inlineReply struct{ pb.FetchResponse }

// FrameSize is the length of r's encoding (proto.Size's).
func (r *inlineReply) FrameSize() int {
	if !r.fast() {
		return proto.Size(&r.FetchResponse)
	}
	n := 0
	if m := r.Meta; m != nil {
		n += bytesField(metaSize(m))
	}
	if len(r.InlineData) > 0 {
		n += bytesField(len(r.InlineData))
	}
	if r.TransferId != 0 {
		n += varintField(r.TransferId)
	}
	if r.RowsOfSource {
		n += 2
	}
	return n
}

// AppendFrame appends r's encoding (proto.Marshal's) to b.
func (r *inlineReply) AppendFrame(b []byte) []byte {
	if !r.fast() {
		return marshalAppend(b, &r.FetchResponse)
	}
	if m := r.Meta; m != nil {
		b = appendMetaField(b, 1, m)
	}
	if len(r.InlineData) > 0 {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, r.InlineData)
	}
	if r.TransferId != 0 {
		b = protowire.AppendTag(b, 3, protowire.VarintType)
		b = protowire.AppendVarint(b, r.TransferId)
	}
	if r.RowsOfSource {
		b = protowire.AppendTag(b, 4, protowire.VarintType)
		b = append(b, 1)
	}
	return b
}

// fast reports whether r holds only what AppendFrame encodes itself: no
// location and no unknown fields, in it or its meta, and a key that
// proto.Marshal takes (UTF-8).
func (r *inlineReply) fast() bool {
	return len(r.ProtoReflect().GetUnknown()) == 0 && (r.Meta == nil || fastMeta(r.Meta))
}
