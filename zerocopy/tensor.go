package zerocopy

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
)

// MaxRank is the largest number of dimensions a tensor may have. It matches
// NumPy's historical limit and bounds the fixed-size shape storage of
// decoded wire headers.
const MaxRank = 32

// Errors returned by tensor constructors and views. They are wrapped with
// details; test with errors.Is.
var (
	ErrInvalidDType   = errors.New("zerocopy: invalid dtype")
	ErrNegativeDim    = errors.New("zerocopy: negative dimension")
	ErrRankTooLarge   = errors.New("zerocopy: rank exceeds MaxRank")
	ErrOverflow       = errors.New("zerocopy: tensor size overflows")
	ErrLengthMismatch = errors.New("zerocopy: byte length does not match shape")
	ErrDTypeMismatch  = errors.New("zerocopy: element type does not match dtype")
	ErrMisaligned     = errors.New("zerocopy: data is not aligned for the element type")
)

// Tensor is a dense, contiguous, row-major tensor whose elements are a view
// of memory it does not own. The zero Tensor is invalid.
//
// A Tensor never copies or frees its bytes: whoever made the memory (a Go
// slice, a mempool Buffer, a mapped region) keeps it alive and valid for as
// long as the Tensor is used.
type Tensor struct {
	dtype DType
	shape []int64
	data  []byte
}

// New makes a tensor of the given dtype and shape over data, which must hold
// exactly NumElements(shape) × dtype.Size() bytes. It copies the shape, not
// the data. An empty shape is a scalar (one element).
func New(dtype DType, shape []int64, data []byte) (Tensor, error) {
	n, err := ByteSize(dtype, shape)
	if err != nil {
		return Tensor{}, err
	}
	if int64(len(data)) != n {
		return Tensor{}, fmt.Errorf("%w: %s%v needs %d bytes, got %d", ErrLengthMismatch, dtype, shape, n, len(data))
	}
	return Tensor{dtype: dtype, shape: append([]int64(nil), shape...), data: data}, nil
}

// NumElements returns the product of the dimensions (1 for a scalar). It
// fails on negative dimensions, on more than MaxRank dimensions and when the
// product does not fit in an int64.
func NumElements(shape []int64) (int64, error) {
	if len(shape) > MaxRank {
		return 0, fmt.Errorf("%w: rank %d > %d", ErrRankTooLarge, len(shape), MaxRank)
	}
	n := uint64(1)
	zero := false
	for i, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("%w: dimension %d is %d", ErrNegativeDim, i, d)
		}
		if d == 0 {
			zero = true
			continue
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > math.MaxInt64 {
			// A copy, so that shape does not escape (decoders keep it on the stack).
			return 0, fmt.Errorf("%w: element count of %v", ErrOverflow, append([]int64(nil), shape...))
		}
		n = lo
	}
	if zero {
		return 0, nil
	}
	return int64(n), nil
}

// ByteSize returns the number of bytes a contiguous tensor of the dtype and
// shape occupies, with the same checks as NumElements, and fails when the
// byte count overflows an int on this platform.
func ByteSize(dtype DType, shape []int64) (int64, error) {
	if !dtype.Valid() {
		return 0, fmt.Errorf("%w: %d", ErrInvalidDType, uint8(dtype))
	}
	n, err := NumElements(shape)
	if err != nil {
		return 0, err
	}
	hi, lo := bits.Mul64(uint64(n), uint64(dtype.Size()))
	if hi != 0 || lo > math.MaxInt64 || lo > uint64(math.MaxInt) {
		return 0, fmt.Errorf("%w: %d elements of %s", ErrOverflow, n, dtype)
	}
	return int64(lo), nil
}

// DType is the tensor's element type.
func (t Tensor) DType() DType { return t.dtype }

// Shape returns the dimensions. The caller must not modify the slice.
func (t Tensor) Shape() []int64 { return t.shape }

// Rank is the number of dimensions.
func (t Tensor) Rank() int { return len(t.shape) }

// Len is the number of elements.
func (t Tensor) Len() int { return len(t.data) / max(t.dtype.Size(), 1) }

// Bytes is the tensor's memory, row-major. Writes through it change the
// tensor.
func (t Tensor) Bytes() []byte { return t.data }

// Valid reports whether t was made by a constructor (the zero Tensor is not
// valid).
func (t Tensor) Valid() bool { return t.dtype.Valid() }

// Checksum is the CRC32C (Castagnoli) of the tensor's bytes.
func (t Tensor) Checksum() uint32 { return Checksum(t.data) }

// String describes the tensor without its data, e.g. "float32[2 3] (24 B)".
func (t Tensor) String() string {
	return fmt.Sprintf("%s%v (%d B)", t.dtype, t.shape, len(t.data))
}
