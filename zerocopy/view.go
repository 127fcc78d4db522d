package zerocopy

import (
	"fmt"
	"unsafe"
)

// Element is the set of Go types a tensor can be viewed as. Float16 and
// BFloat16 tensors are viewed as uint16 (their raw bits); Bool as bool or
// uint8.
type Element interface {
	~bool | ~int8 | ~int16 | ~int32 | ~int64 |
		~uint8 | ~uint16 | ~uint32 | ~uint64 |
		~float32 | ~float64 | ~complex64 | ~complex128
}

// compatible reports whether a tensor of dtype d may be viewed as T.
func compatible[T Element](d DType) bool {
	var zero T
	switch any(zero).(type) {
	case bool:
		return d == Bool
	case int8:
		return d == Int8
	case int16:
		return d == Int16
	case int32:
		return d == Int32
	case int64:
		return d == Int64
	case uint8:
		return d == Uint8 || d == Bool
	case uint16:
		return d == Uint16 || d == Float16 || d == BFloat16
	case uint32:
		return d == Uint32
	case uint64:
		return d == Uint64
	case float32:
		return d == Float32
	case float64:
		return d == Float64
	case complex64:
		return d == Complex64
	case complex128:
		return d == Complex128
	}
	// A named type (~T): accept when the element size matches.
	return int(unsafe.Sizeof(zero)) == d.Size()
}

// View returns the tensor's elements as a []T that shares the tensor's
// memory: no copy is made, and writes through the slice change the tensor.
// It fails when T does not match the dtype (float32 for Float32, uint16 for
// Float16 and BFloat16, ...) or when the memory is not aligned for T.
//
// Views of bool tensors are only meaningful when every byte is 0 or 1; bytes
// from the wire are not checked.
func View[T Element](t Tensor) ([]T, error) {
	var zero T
	if !compatible[T](t.dtype) {
		return nil, fmt.Errorf("%w: cannot view %s as %T", ErrDTypeMismatch, t.dtype, zero)
	}
	return viewBytes[T](t.data)
}

// viewBytes reinterprets b as a []T. It checks the two invariants the
// conversion relies on: the length is a multiple of the element size, and
// the first byte is aligned for T.
func viewBytes[T Element](b []byte) ([]T, error) {
	var zero T
	size := int(unsafe.Sizeof(zero))
	if len(b)%size != 0 {
		return nil, fmt.Errorf("%w: %d bytes is not a whole number of %d-byte elements", ErrLengthMismatch, len(b), size)
	}
	if len(b) == 0 {
		return []T{}, nil
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	if uintptr(p)%unsafe.Alignof(zero) != 0 {
		return nil, fmt.Errorf("%w: address %p for %T", ErrMisaligned, p, zero)
	}
	// Safe: p points to len(b) bytes kept alive by b's backing array (the
	// returned slice keeps it alive too), the length is a whole number of
	// elements and p is aligned for T. Every bit pattern is a valid T except
	// for bool, which is documented above.
	return unsafe.Slice((*T)(p), len(b)/size), nil
}

// FromSlice makes a tensor over the memory of a Go slice without copying.
// The dtype is the natural one for T (Float32 for float32, Uint16 for
// uint16, ...); use New with AsBytes for Float16 or BFloat16 data held in a
// []uint16.
func FromSlice[T Element](s []T, shape ...int64) (Tensor, error) {
	d := dtypeOf[T]()
	if !d.Valid() {
		var zero T
		return Tensor{}, fmt.Errorf("%w: no dtype for %T", ErrDTypeMismatch, zero)
	}
	if shape == nil {
		shape = []int64{int64(len(s))}
	}
	return New(d, shape, AsBytes(s))
}

// AsBytes returns the memory of s as bytes, without copying.
func AsBytes[T Element](s []T) []byte {
	if len(s) == 0 {
		return []byte{}
	}
	var zero T
	// Safe: the byte slice covers exactly the memory of s's len elements
	// and keeps the backing array alive.
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(zero)))
}

func dtypeOf[T Element]() DType {
	var zero T
	switch any(zero).(type) {
	case bool:
		return Bool
	case int8:
		return Int8
	case int16:
		return Int16
	case int32:
		return Int32
	case int64:
		return Int64
	case uint8:
		return Uint8
	case uint16:
		return Uint16
	case uint32:
		return Uint32
	case uint64:
		return Uint64
	case float32:
		return Float32
	case float64:
		return Float64
	case complex64:
		return Complex64
	case complex128:
		return Complex128
	}
	return Invalid
}
