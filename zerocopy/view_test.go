package zerocopy

import (
	"errors"
	"math"
	"testing"
)

func TestViewSharesMemory(t *testing.T) {
	w := []float32{1, 2, 3, 4, 5, 6}
	tn, err := FromSlice(w, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	v, err := View[float32](tn)
	if err != nil {
		t.Fatal(err)
	}
	v[4] = 42
	if w[4] != 42 {
		t.Fatal("view does not share memory with the slice")
	}
	if &v[0] != &w[0] {
		t.Fatal("view copied")
	}
	if tn.Checksum() != Checksum(AsBytes(w)) {
		t.Fatal("checksum differs")
	}
}

func TestViewEveryDType(t *testing.T) {
	check := func(name string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	buf := make([]uint64, 8) // 64 aligned bytes
	raw := AsBytes(buf)
	for _, d := range DTypes() {
		tn, err := New(d, []int64{int64(len(raw) / d.Size())}, raw)
		if err != nil {
			t.Fatal(err)
		}
		switch d {
		case Bool:
			_, err = View[bool](tn)
		case Int8:
			_, err = View[int8](tn)
		case Int16:
			_, err = View[int16](tn)
		case Int32:
			_, err = View[int32](tn)
		case Int64:
			_, err = View[int64](tn)
		case Uint8:
			_, err = View[uint8](tn)
		case Uint16, Float16, BFloat16:
			_, err = View[uint16](tn)
		case Uint32:
			_, err = View[uint32](tn)
		case Uint64:
			_, err = View[uint64](tn)
		case Float32:
			_, err = View[float32](tn)
		case Float64:
			_, err = View[float64](tn)
		case Complex64:
			_, err = View[complex64](tn)
		case Complex128:
			_, err = View[complex128](tn)
		}
		check(d.String(), err)
	}
}

func TestViewRejects(t *testing.T) {
	raw := AsBytes(make([]uint64, 4))
	f32, _ := New(Float32, []int64{8}, raw)
	if _, err := View[int32](f32); !errors.Is(err, ErrDTypeMismatch) {
		t.Errorf("int32 view of float32: %v", err)
	}
	if _, err := View[float64](f32); !errors.Is(err, ErrDTypeMismatch) {
		t.Errorf("float64 view of float32: %v", err)
	}
	mis, _ := New(Float32, []int64{7}, raw[1:29])
	if _, err := View[float32](mis); !errors.Is(err, ErrMisaligned) {
		t.Errorf("misaligned view: %v", err)
	}
	if _, err := viewBytes[float32](raw[:6]); !errors.Is(err, ErrLengthMismatch) {
		t.Errorf("partial element: %v", err)
	}
	empty, _ := New(Float64, []int64{0}, nil)
	if v, err := View[float64](empty); err != nil || len(v) != 0 {
		t.Errorf("empty view: %v %v", v, err)
	}
	var zero Tensor
	if _, err := View[float32](zero); err == nil {
		t.Error("view of the zero tensor succeeded")
	}
}

type celsius float32

func TestViewNamedType(t *testing.T) {
	tn, _ := FromSlice([]float32{1.5, math.MaxFloat32})
	v, err := View[celsius](tn)
	if err != nil || v[0] != 1.5 {
		t.Fatalf("named view: %v %v", v, err)
	}
	if _, err := FromSlice([]celsius{1}); err == nil {
		t.Fatal("FromSlice of a named type guessed a dtype")
	}
}

func TestFromSliceDTypes(t *testing.T) {
	must := func(tn Tensor, err error) Tensor {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return tn
	}
	cases := []struct {
		tn   Tensor
		want DType
	}{
		{must(FromSlice([]bool{true})), Bool},
		{must(FromSlice([]int8{1})), Int8},
		{must(FromSlice([]int16{1})), Int16},
		{must(FromSlice([]int32{1})), Int32},
		{must(FromSlice([]int64{1})), Int64},
		{must(FromSlice([]uint8{1})), Uint8},
		{must(FromSlice([]uint16{1})), Uint16},
		{must(FromSlice([]uint32{1})), Uint32},
		{must(FromSlice([]uint64{1})), Uint64},
		{must(FromSlice([]float32{1})), Float32},
		{must(FromSlice([]float64{1})), Float64},
		{must(FromSlice([]complex64{1})), Complex64},
		{must(FromSlice([]complex128{1})), Complex128},
	}
	for _, c := range cases {
		if c.tn.DType() != c.want || len(c.tn.Bytes()) != c.want.Size() {
			t.Errorf("FromSlice gave %v, want %v", c.tn, c.want)
		}
	}
	if _, err := FromSlice([]float32{1, 2, 3}, 2, 2); !errors.Is(err, ErrLengthMismatch) {
		t.Errorf("shape mismatch: %v", err)
	}
}
