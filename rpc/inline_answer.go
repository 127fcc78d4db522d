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
