// Package wire encodes and decodes the tensor wire header and the
// data-plane frame header (both in proto/header.fbs) and validates
// everything a peer could get wrong.
//
// Decode and DecodeFrame allocate nothing: the Header's shape lives in a
// fixed array, and keys, bodies and releases alias the input bytes.
// Arbitrary input gives an error, never a panic (see FuzzDecode and
// FuzzDecodeFrame).
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	flatbuffers "github.com/google/flatbuffers/go"

	"github.com/tensorrpc/tensorrpc/proto/wirefb"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Limits on decoded headers.
const (
	MaxKeyLen     = 4096     // bytes of key
	MaxHeaderSize = 64 << 10 // bytes of encoded header
	identifier    = "TRH1"   // header.fbs file_identifier
	locationSize  = 40       // sizeof(wirefb.Location)
)

// Provider numbers of Location.Provider, as in header.fbs and the
// Transport enum of tensorrpc.proto.
const (
	ProviderIBV  uint8 = 1
	ProviderSHM  uint8 = 2
	ProviderTCP  uint8 = 3
	ProviderGRPC uint8 = 4
)

// ErrInvalidHeader wraps every decoding and validation error.
var ErrInvalidHeader = errors.New("wire: invalid tensor header")

// Location says where a rendezvous tensor's bytes are in the producer's
// registered memory.
type Location struct {
	Provider  uint8
	RegionID  uint32
	RemoteKey uint32
	Address   uint64 // address of the first byte, as one-sided operations name it
	Offset    uint64 // offset of the first byte in the region
	Length    uint64
}

// Header is a decoded tensor header. Key aliases the bytes it was decoded
// from; copy it to keep it longer than those bytes.
type Header struct {
	Key         []byte
	DType       zerocopy.DType
	Rank        int
	Dims        [zerocopy.MaxRank]int64
	ByteLength  uint64
	Checksum    uint32
	HasChecksum bool
	Location    Location
	HasLocation bool
}

// Shape returns the dimensions, a slice of h.Dims.
func (h *Header) Shape() []int64 { return h.Dims[:h.Rank] }

// SetShape copies shape into h.Dims and sets Rank.
func (h *Header) SetShape(shape []int64) error {
	if len(shape) > zerocopy.MaxRank {
		return fmt.Errorf("%w: rank %d > %d", ErrInvalidHeader, len(shape), zerocopy.MaxRank)
	}
	h.Rank = copy(h.Dims[:], shape)
	return nil
}

// FromTensor fills h with t's dtype, shape and byte length, and with key.
// It does not compute a checksum or set a location.
func (h *Header) FromTensor(key []byte, t zerocopy.Tensor) error {
	*h = Header{Key: key, DType: t.DType(), ByteLength: uint64(len(t.Bytes()))}
	return h.SetShape(t.Shape())
}

// Validate checks h as Decode does: a known dtype, a rank within MaxRank, a
// shape whose byte size equals ByteLength, a key within MaxKeyLen, and a
// location that is consistent and does not overflow.
func (h *Header) Validate() error {
	if len(h.Key) > MaxKeyLen {
		return fmt.Errorf("%w: key of %d bytes exceeds %d", ErrInvalidHeader, len(h.Key), MaxKeyLen)
	}
	if h.Rank < 0 || h.Rank > zerocopy.MaxRank {
		return fmt.Errorf("%w: rank %d", ErrInvalidHeader, h.Rank)
	}
	n, err := zerocopy.ByteSize(h.DType, h.Shape())
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidHeader, err)
	}
	if uint64(n) != h.ByteLength {
		// The shape is copied so that h does not escape: Decode's callers
		// keep their Header on the stack.
		return fmt.Errorf("%w: %s%v is %d bytes, header says %d", ErrInvalidHeader, h.DType, append([]int64(nil), h.Shape()...), n, h.ByteLength)
	}
	if h.HasLocation {
		l := &h.Location
		if l.Provider < ProviderIBV || l.Provider > ProviderGRPC {
			return fmt.Errorf("%w: unknown provider %d", ErrInvalidHeader, l.Provider)
		}
		if l.Length != h.ByteLength {
			return fmt.Errorf("%w: location length %d, tensor length %d", ErrInvalidHeader, l.Length, h.ByteLength)
		}
		if l.Offset > math.MaxInt64-l.Length || l.Address > math.MaxUint64-l.Length {
			return fmt.Errorf("%w: location offset %d / address %#x + length %d overflows", ErrInvalidHeader, l.Offset, l.Address, l.Length)
		}
	}
	return nil
}

// Encoder encodes headers, reusing its buffer. It is not safe for
// concurrent use.
type Encoder struct {
	b *flatbuffers.Builder
}

// Encode validates h and encodes it. The returned bytes belong to the
// Encoder and are valid until its next Encode.
func (e *Encoder) Encode(h *Header) ([]byte, error) {
	if err := h.Validate(); err != nil {
		return nil, err
	}
	if e.b == nil {
		e.b = flatbuffers.NewBuilder(256)
	}
	b := e.b
	b.Reset()
	key := b.CreateByteString(h.Key)
	wirefb.TensorHeaderStartShapeVector(b, h.Rank)
	for i := h.Rank - 1; i >= 0; i-- {
		b.PrependInt64(h.Dims[i])
	}
	shape := b.EndVector(h.Rank)
	wirefb.TensorHeaderStart(b)
	wirefb.TensorHeaderAddKey(b, key)
	wirefb.TensorHeaderAddShape(b, shape)
	wirefb.TensorHeaderAddByteLength(b, h.ByteLength)
	if h.HasLocation {
		l := &h.Location
		wirefb.TensorHeaderAddLocation(b, wirefb.CreateLocation(b, l.Provider, l.RegionID, l.RemoteKey, l.Address, l.Offset, l.Length))
	}
	if h.HasChecksum {
		wirefb.TensorHeaderAddChecksum(b, h.Checksum)
		wirefb.TensorHeaderAddHasChecksum(b, true)
	}
	wirefb.TensorHeaderAddDtype(b, byte(h.DType))
	b.FinishWithFileIdentifier(wirefb.TensorHeaderEnd(b), []byte(identifier))
	out := b.FinishedBytes()
	if len(out) > MaxHeaderSize {
		return nil, fmt.Errorf("%w: encoded header is %d bytes, limit %d", ErrInvalidHeader, len(out), MaxHeaderSize)
	}
	return out, nil
}

// Decode decodes and validates a header from buf into h. It allocates
// nothing; h.Key aliases buf.
func Decode(buf []byte, h *Header) error {
	pos, err := verify(buf)
	if err != nil {
		return err
	}
	var t wirefb.TensorHeader
	t.Init(buf, flatbuffers.UOffsetT(pos))
	*h = Header{
		Key:         t.Key(),
		DType:       zerocopy.DType(t.Dtype()),
		ByteLength:  t.ByteLength(),
		Checksum:    t.Checksum(),
		HasChecksum: t.HasChecksum(),
	}
	if !h.HasChecksum {
		h.Checksum = 0 // a checksum without its flag means nothing
	}
	n := t.ShapeLength()
	if n > zerocopy.MaxRank {
		return fmt.Errorf("%w: rank %d > %d", ErrInvalidHeader, n, zerocopy.MaxRank)
	}
	for i := range n {
		h.Dims[i] = t.Shape(i)
	}
	h.Rank = n
	var l wirefb.Location
	if t.Location(&l) != nil {
		h.HasLocation = true
		h.Location = Location{l.Provider(), l.RegionId(), l.RemoteKey(), l.Address(), l.Offset(), l.Length()}
	}
	return h.Validate()
}

// verify checks the FlatBuffers structure of buf for the TensorHeader
// table: the root offset, the vtable and every field lie inside buf, so
// that the generated accessors cannot index out of range. It returns the
// table's position.
func verify(buf []byte) (int, error) {
	size := len(buf)
	if size < 8+4 {
		return 0, fmt.Errorf("%w: %d bytes is too short", ErrInvalidHeader, size)
	}
	if size > MaxHeaderSize {
		return 0, fmt.Errorf("%w: %d bytes exceeds %d", ErrInvalidHeader, size, MaxHeaderSize)
	}
	if string(buf[4:8]) != identifier {
		return 0, fmt.Errorf("%w: identifier %q, want %q", ErrInvalidHeader, buf[4:8], identifier)
	}
	table := int(binary.LittleEndian.Uint32(buf))
	if table%4 != 0 || table < 8 || table > size-4 {
		return 0, fmt.Errorf("%w: root table offset %d out of range", ErrInvalidHeader, table)
	}
	vtable := int64(table) - int64(int32(binary.LittleEndian.Uint32(buf[table:])))
	if vtable%2 != 0 || vtable < 0 || vtable > int64(size-4) {
		return 0, fmt.Errorf("%w: vtable offset %d out of range", ErrInvalidHeader, vtable)
	}
	vt := int(vtable)
	vtSize := int(binary.LittleEndian.Uint16(buf[vt:]))
	tableSize := int(binary.LittleEndian.Uint16(buf[vt+2:]))
	if vtSize < 4 || vtSize%2 != 0 || vt+vtSize > size {
		return 0, fmt.Errorf("%w: vtable size %d out of range", ErrInvalidHeader, vtSize)
	}
	if tableSize < 4 || table+tableSize > size {
		return 0, fmt.Errorf("%w: table size %d out of range", ErrInvalidHeader, tableSize)
	}
	// field returns the position of field i and whether it is present,
	// after checking that width bytes of it lie inside the table.
	field := func(i, width int) (int, bool, error) {
		slot := 4 + 2*i
		if slot+2 > vtSize {
			return 0, false, nil
		}
		off := int(binary.LittleEndian.Uint16(buf[vt+slot:]))
		if off == 0 {
			return 0, false, nil
		}
		if off < 4 || off+width > tableSize {
			return 0, false, fmt.Errorf("%w: field %d at %d+%d outside a %d-byte table", ErrInvalidHeader, i, off, width, tableSize)
		}
		return table + off, true, nil
	}
	// vector checks the vector (or string) that field i points to.
	// Strings (terminator true) must end in a zero byte, as FlatBuffers
	// writes them.
	vector := func(i, elemSize, maxLen int, terminator bool) error {
		at, ok, err := field(i, 4)
		if !ok || err != nil {
			return err
		}
		start := int64(at) + int64(binary.LittleEndian.Uint32(buf[at:]))
		if start > int64(size-4) {
			return fmt.Errorf("%w: field %d vector at %d out of range", ErrInvalidHeader, i, start)
		}
		n := int64(binary.LittleEndian.Uint32(buf[start:]))
		if n > int64(maxLen) {
			return fmt.Errorf("%w: field %d has %d elements, limit %d", ErrInvalidHeader, i, n, maxLen)
		}
		end := start + 4 + n*int64(elemSize)
		if terminator {
			if end >= int64(size) || buf[end] != 0 {
				return fmt.Errorf("%w: field %d string is not terminated", ErrInvalidHeader, i)
			}
		}
		if end > int64(size) {
			return fmt.Errorf("%w: field %d vector of %d elements runs past the end", ErrInvalidHeader, i, n)
		}
		return nil
	}
	const (
		fieldKey = iota
		fieldDType
		fieldShape
		fieldByteLength
		fieldChecksum
		fieldHasChecksum
		fieldLocation
	)
	if err := vector(fieldKey, 1, MaxKeyLen, true); err != nil {
		return 0, err
	}
	if err := vector(fieldShape, 8, zerocopy.MaxRank, false); err != nil {
		return 0, err
	}
	for _, f := range [...]struct{ i, width int }{
		{fieldDType, 1}, {fieldByteLength, 8}, {fieldChecksum, 4}, {fieldHasChecksum, 1}, {fieldLocation, locationSize},
	} {
		if _, _, err := field(f.i, f.width); err != nil {
			return 0, err
		}
	}
	return table, nil
}
