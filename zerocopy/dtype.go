package zerocopy

import (
	"fmt"
	"strings"
)

// DType is the element type of a tensor. Its numeric values are part of the
// wire format (proto/header.fbs and proto/tensorrpc.proto use the same
// numbers) and never change.
type DType uint8

// The element types. Invalid is the zero value and is never a valid tensor
// dtype.
const (
	Invalid DType = iota
	Bool
	Int8
	Int16
	Int32
	Int64
	Uint8
	Uint16
	Uint32
	Uint64
	Float16
	BFloat16
	Float32
	Float64
	Complex64
	Complex128

	numDTypes // one past the last valid dtype
)

type dtypeInfo struct {
	name    string // canonical, as NumPy and PyTorch print it
	size    int    // bytes per element
	dlCode  uint8  // DLPack DLDataTypeCode
	aliases []string
}

// DLPack type codes (dlpack.h, DLDataTypeCode).
const (
	dlInt     = 0
	dlUInt    = 1
	dlFloat   = 2
	dlBfloat  = 4
	dlComplex = 5
	dlBool    = 6
)

var dtypes = [numDTypes]dtypeInfo{
	Invalid:    {name: "invalid"},
	Bool:       {"bool", 1, dlBool, []string{"bool_", "?"}},
	Int8:       {"int8", 1, dlInt, []string{"i1"}},
	Int16:      {"int16", 2, dlInt, []string{"short", "i2"}},
	Int32:      {"int32", 4, dlInt, []string{"int", "i4"}},
	Int64:      {"int64", 8, dlInt, []string{"long", "i8"}},
	Uint8:      {"uint8", 1, dlUInt, []string{"u1"}},
	Uint16:     {"uint16", 2, dlUInt, []string{"u2"}},
	Uint32:     {"uint32", 4, dlUInt, []string{"u4"}},
	Uint64:     {"uint64", 8, dlUInt, []string{"u8"}},
	Float16:    {"float16", 2, dlFloat, []string{"half", "f2"}},
	BFloat16:   {"bfloat16", 2, dlBfloat, nil},
	Float32:    {"float32", 4, dlFloat, []string{"float", "f4"}},
	Float64:    {"float64", 8, dlFloat, []string{"double", "f8"}},
	Complex64:  {"complex64", 8, dlComplex, []string{"cfloat", "c8"}},
	Complex128: {"complex128", 16, dlComplex, []string{"cdouble", "c16"}},
}

var dtypeByName = func() map[string]DType {
	m := make(map[string]DType)
	for d := Bool; d < numDTypes; d++ {
		m[dtypes[d].name] = d
		for _, a := range dtypes[d].aliases {
			m[a] = d
		}
	}
	return m
}()

// DTypes returns every valid dtype in wire-number order.
func DTypes() []DType {
	out := make([]DType, 0, numDTypes-1)
	for d := Bool; d < numDTypes; d++ {
		out = append(out, d)
	}
	return out
}

// Valid reports whether d is a known element type.
func (d DType) Valid() bool { return d > Invalid && d < numDTypes }

// Size is the size of one element in bytes, or 0 for an invalid dtype.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypes[d].size
}

// String returns the canonical name, spelled as NumPy and PyTorch spell it
// ("float32", "bfloat16", "complex64").
func (d DType) String() string {
	if !d.Valid() {
		return fmt.Sprintf("DType(%d)", uint8(d))
	}
	return dtypes[d].name
}

// ParseDType parses a dtype name. It accepts the canonical names, PyTorch
// spellings with or without the "torch." prefix ("torch.float", "half",
// "long", "cfloat"), NumPy spellings with or without "np."/"numpy."
// ("float32", "bool_") and NumPy's short type codes in little-endian or
// native form ("<f4", "=i8", "|u1"). Big-endian codes are refused: tensor
// bytes are little-endian.
func ParseDType(name string) (DType, error) {
	s := strings.ToLower(strings.TrimSpace(name))
	for _, p := range []string{"torch.", "numpy.", "np."} {
		s = strings.TrimPrefix(s, p)
	}
	if len(s) > 1 && (s[0] == '<' || s[0] == '=' || s[0] == '|') {
		s = s[1:]
	} else if len(s) > 1 && s[0] == '>' {
		return Invalid, fmt.Errorf("zerocopy: dtype %q is big-endian; tensors are little-endian", name)
	}
	if d, ok := dtypeByName[s]; ok {
		return d, nil
	}
	return Invalid, fmt.Errorf("zerocopy: unknown dtype %q", name)
}

// MarshalText implements encoding.TextMarshaler.
func (d DType) MarshalText() ([]byte, error) {
	if !d.Valid() {
		return nil, fmt.Errorf("zerocopy: cannot marshal invalid dtype %d", uint8(d))
	}
	return []byte(d.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *DType) UnmarshalText(b []byte) error {
	v, err := ParseDType(string(b))
	if err != nil {
		return err
	}
	*d = v
	return nil
}

// DLPack returns the DLPack DLDataType of d: type code, bits and lanes.
func (d DType) DLPack() (code uint8, bits uint8, lanes uint16) {
	if !d.Valid() {
		return 0, 0, 0
	}
	return dtypes[d].dlCode, uint8(dtypes[d].size * 8), 1
}

// DTypeFromDLPack maps a DLPack DLDataType to a dtype. Vector types
// (lanes ≠ 1) and types without a tensorrpc dtype give an error.
func DTypeFromDLPack(code, bits uint8, lanes uint16) (DType, error) {
	if lanes != 1 {
		return Invalid, fmt.Errorf("zerocopy: DLPack vector types (lanes=%d) are not supported", lanes)
	}
	for d := Bool; d < numDTypes; d++ {
		if dtypes[d].dlCode == code && dtypes[d].size*8 == int(bits) {
			return d, nil
		}
	}
	return Invalid, fmt.Errorf("zerocopy: no dtype for DLPack code %d with %d bits", code, bits)
}
