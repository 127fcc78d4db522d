package chunkcodec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// Field tags of tensorrpc.v1.Chunk: field 1 (header) and field 2 (data),
// both length-delimited (wire type 2).
const (
	tagHeader = 1<<3 | wireBytes // 0x0a
	tagData   = 2<<3 | wireBytes // 0x12

	wireVarint  = 0
	wireFixed64 = 1
	wireBytes   = 2
	wireStart   = 3
	wireEnd     = 4
	wireFixed32 = 5

	maxFieldNumber = 1<<29 - 1
)

// OutChunk is a Chunk to send. Data is sent as is: the codec takes its own
// reference on each buffer and hands the buffers to gRPC, which writes
// their bytes straight from that memory.
//
// The caller keeps the references it holds in Data and frees them (Free)
// when it no longer needs them, typically right after SendMsg returns.
// gRPC frees its own references later, once its transport has written the
// bytes out, and the memory of a buffer is released (the release function
// of Wrap runs) only when both sides have freed theirs. Until then the
// bytes must not be modified.
type OutChunk struct {
	Header *tensorrpcpb.ChunkHeader
	Data   mem.BufferSlice
}

// Free drops the caller's references to Data and sets it to nil.
func (c *OutChunk) Free() {
	c.Data.Free()
	c.Data = nil
}

// InChunk is a received Chunk. Header is a freshly decoded message (nil when
// the sender sent none). Data views the bytes in gRPC's receive buffers,
// without a copy, and holds one reference on each of its buffers: the
// receiver owns those references and must call Free exactly once when it
// is done with the bytes. Until then the buffers stay out of gRPC's buffer
// pool. Data is nil when the chunk carried no data.
//
// Unmarshal overwrites Header and Data; it does not free an earlier Data,
// so Free it before receiving into the same InChunk again.
type InChunk struct {
	Header *tensorrpcpb.ChunkHeader
	Data   mem.BufferSlice
}

// Free drops the references held by Data and sets it to nil. Calling it
// again, or on an InChunk without data, does nothing.
func (c *InChunk) Free() {
	c.Data.Free()
	c.Data = nil
}

// Len returns the number of data bytes.
func (c *InChunk) Len() int { return c.Data.Len() }

// marshalChunk writes the protobuf encoding of Chunk{header, data}: a small
// copied prefix (the header message and the data field's tag and length),
// then data's own buffers, each Ref'd. Empty data and a nil header are
// omitted, as proto3 does.
func marshalChunk(header *tensorrpcpb.ChunkHeader, data mem.BufferSlice) (mem.BufferSlice, error) {
	dataLen := data.Len()
	if uint64(dataLen) > math.MaxUint32 {
		return nil, fmt.Errorf("chunkcodec: chunk data of %d bytes is larger than a gRPC message can be", dataLen)
	}
	hdrLen := 0
	if header != nil {
		hdrLen = proto.Size(header)
	}
	n := 0
	if header != nil {
		n += 1 + varintLen(uint64(hdrLen)) + hdrLen
	}
	if dataLen > 0 {
		n += 1 + varintLen(uint64(dataLen))
	}

	out := make(mem.BufferSlice, 0, 1+len(data))
	if n > 0 {
		var prefix mem.Buffer
		var p []byte
		var handle *[]byte
		pool := mem.DefaultBufferPool()
		if mem.IsBelowBufferPoolingThreshold(n) {
			p = make([]byte, 0, n)
		} else {
			handle = pool.Get(n)
			p = (*handle)[:0]
		}
		if header != nil {
			p = append(p, tagHeader)
			p = binary.AppendUvarint(p, uint64(hdrLen))
			var err error
			// UseCachedSize reuses the size computed by proto.Size above;
			// the header must not change concurrently (as for any proto).
			p, err = proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(p, header)
			if err != nil || len(p) != 1+varintLen(uint64(hdrLen))+hdrLen {
				if handle != nil {
					pool.Put(handle)
				}
				if err == nil {
					err = errors.New("header changed while it was marshalled")
				}
				return nil, fmt.Errorf("chunkcodec: marshal header: %w", err)
			}
		}
		if dataLen > 0 {
			p = append(p, tagData)
			p = binary.AppendUvarint(p, uint64(dataLen))
		}
		if handle != nil {
			*handle = p
			prefix = mem.NewBuffer(handle, pool)
		} else {
			prefix = mem.SliceBuffer(p)
		}
		out = append(out, prefix)
	}
	for _, b := range data {
		if b.Len() == 0 {
			continue
		}
		b.Ref() // gRPC's reference; it frees it when done
		out = append(out, b)
	}
	return out, nil
}

func varintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// Errors of Unmarshal. All of them wrap ErrMalformed.
var (
	ErrMalformed = errors.New("chunkcodec: malformed Chunk")

	errTruncated = fmt.Errorf("%w: truncated", ErrMalformed)
	errOverflow  = fmt.Errorf("%w: varint overflows 64 bits", ErrMalformed)
)

// reader walks a BufferSlice without copying it.
type reader struct {
	bufs mem.BufferSlice
	i    int    // index of the current buffer
	cur  []byte // unread bytes of bufs[i]
	left uint64 // unread bytes in all
}

func newReader(bufs mem.BufferSlice) *reader {
	r := &reader{bufs: bufs, i: -1, left: uint64(bufs.Len())}
	r.next()
	return r
}

// next moves to the next non-empty buffer, if any.
func (r *reader) next() {
	r.cur = nil
	for len(r.cur) == 0 && r.i+1 < len(r.bufs) {
		r.i++
		r.cur = r.bufs[r.i].ReadOnlyData()
	}
}

func (r *reader) readByte() (byte, error) {
	if len(r.cur) == 0 {
		return 0, errTruncated
	}
	c := r.cur[0]
	r.cur = r.cur[1:]
	r.left--
	if len(r.cur) == 0 {
		r.next()
	}
	return c, nil
}

func (r *reader) varint() (uint64, error) {
	// Fast path: the whole varint is in the current buffer.
	if v, n := binary.Uvarint(r.cur); n > 0 {
		r.cur = r.cur[n:]
		r.left -= uint64(n)
		if len(r.cur) == 0 {
			r.next()
		}
		return v, nil
	}
	var v uint64
	for shift := uint(0); ; shift += 7 {
		c, err := r.readByte()
		if err != nil {
			return 0, err
		}
		if shift == 63 && c > 1 {
			return 0, errOverflow
		}
		v |= uint64(c&0x7f) << shift
		if c < 0x80 {
			return v, nil
		}
		if shift == 63 {
			return 0, errOverflow
		}
	}
}

// skip discards n bytes; n <= r.left.
func (r *reader) skip(n uint64) {
	r.left -= n
	for n > 0 {
		k := min(n, uint64(len(r.cur)))
		r.cur = r.cur[k:]
		n -= k
		if len(r.cur) == 0 {
			r.next()
		}
	}
}

// view returns the next n bytes (n <= r.left) as Ref'd sub-slices of the
// input buffers, without copying.
func (r *reader) view(n uint64) mem.BufferSlice {
	var out mem.BufferSlice
	r.left -= n
	for n > 0 {
		b := r.bufs[r.i]
		start := b.Len() - len(r.cur)
		k := min(n, uint64(len(r.cur)))
		out = append(out, b.Slice(start, start+int(k)))
		r.cur = r.cur[k:]
		n -= k
		if len(r.cur) == 0 {
			r.next()
		}
	}
	return out
}

// bytes returns the next n bytes (n <= r.left): a sub-slice of the current
// buffer when they lie in it, else a copy. The result must not be kept.
func (r *reader) bytes(n uint64) []byte {
	if n <= uint64(len(r.cur)) {
		p := r.cur[:n]
		r.skip(n)
		return p
	}
	p := make([]byte, 0, n)
	r.left -= n
	for uint64(len(p)) < n {
		k := min(n-uint64(len(p)), uint64(len(r.cur)))
		p = append(p, r.cur[:k]...)
		r.cur = r.cur[k:]
		if len(r.cur) == 0 {
			r.next()
		}
	}
	return p
}

// unmarshalChunk parses the protobuf encoding of Chunk by hand. Protobuf
// semantics: repeated occurrences of the header merge; of data, the last
// wins; unknown fields are skipped. Stricter than protobuf: fields 1 and 2
// with another wire type than 2, and groups, are errors.
func unmarshalChunk(data mem.BufferSlice, m *InChunk) (err error) {
	var hdr *tensorrpcpb.ChunkHeader
	var out mem.BufferSlice
	defer func() {
		if err != nil {
			out.Free()
			*m = InChunk{}
		}
	}()
	r := newReader(data)
	for r.left > 0 {
		tag, err := r.varint()
		if err != nil {
			return err
		}
		num, wt := tag>>3, tag&7
		if num == 0 || num > maxFieldNumber {
			return fmt.Errorf("%w: invalid field number %d", ErrMalformed, num)
		}
		if (num == 1 || num == 2) && wt != wireBytes {
			return fmt.Errorf("%w: field %d has wire type %d, want 2", ErrMalformed, num, wt)
		}
		switch wt {
		case wireVarint:
			if _, err := r.varint(); err != nil {
				return err
			}
		case wireFixed64, wireFixed32:
			n := uint64(8)
			if wt == wireFixed32 {
				n = 4
			}
			if n > r.left {
				return errTruncated
			}
			r.skip(n)
		case wireBytes:
			n, err := r.varint()
			if err != nil {
				return err
			}
			if n > r.left {
				return fmt.Errorf("%w: field %d claims %d bytes, %d left", ErrMalformed, num, n, r.left)
			}
			switch num {
			case 1:
				if hdr == nil {
					hdr = new(tensorrpcpb.ChunkHeader)
				}
				if err := (proto.UnmarshalOptions{Merge: true}).Unmarshal(r.bytes(n), hdr); err != nil {
					return fmt.Errorf("%w: header: %v", ErrMalformed, err)
				}
			case 2:
				out.Free() // a later occurrence replaces an earlier one
				out = r.view(n)
			default:
				r.skip(n)
			}
		case wireStart, wireEnd:
			return fmt.Errorf("%w: groups are not supported (field %d)", ErrMalformed, num)
		default:
			return fmt.Errorf("%w: invalid wire type %d (field %d)", ErrMalformed, wt, num)
		}
	}
	m.Header = hdr
	m.Data = out
	return nil
}
