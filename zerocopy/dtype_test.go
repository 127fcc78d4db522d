package zerocopy

import (
	"testing"
)

func TestDTypeSizesAndNames(t *testing.T) {
	want := map[DType]struct {
		name string
		size int
	}{
		Bool: {"bool", 1}, Int8: {"int8", 1}, Int16: {"int16", 2}, Int32: {"int32", 4}, Int64: {"int64", 8},
		Uint8: {"uint8", 1}, Uint16: {"uint16", 2}, Uint32: {"uint32", 4}, Uint64: {"uint64", 8},
		Float16: {"float16", 2}, BFloat16: {"bfloat16", 2}, Float32: {"float32", 4}, Float64: {"float64", 8},
		Complex64: {"complex64", 8}, Complex128: {"complex128", 16},
	}
	if got := len(DTypes()); got != len(want) {
		t.Fatalf("DTypes() has %d entries, want %d", got, len(want))
	}
	for _, d := range DTypes() {
		w, ok := want[d]
		if !ok {
			t.Fatalf("unexpected dtype %d", d)
		}
		if d.String() != w.name || d.Size() != w.size {
			t.Errorf("dtype %d: got %s/%d, want %s/%d", d, d, d.Size(), w.name, w.size)
		}
		p, err := ParseDType(d.String())
		if err != nil || p != d {
			t.Errorf("ParseDType(%q) = %v, %v; want %v", d.String(), p, err, d)
		}
		txt, err := d.MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		var back DType
		if err := back.UnmarshalText(txt); err != nil || back != d {
			t.Errorf("text round trip of %v gave %v, %v", d, back, err)
		}
		code, bits, lanes := d.DLPack()
		dl, err := DTypeFromDLPack(code, bits, lanes)
		if err != nil || dl != d {
			t.Errorf("DLPack round trip of %v gave %v, %v", d, dl, err)
		}
		if !d.Valid() {
			t.Errorf("%v not valid", d)
		}
	}
}

func TestParseDTypeSpellings(t *testing.T) {
	cases := map[string]DType{
		"torch.float32": Float32, "torch.float": Float32, "float": Float32, "torch.half": Float16,
		"torch.bfloat16": BFloat16, "torch.long": Int64, "torch.int": Int32, "torch.short": Int16,
		"torch.double": Float64, "torch.cfloat": Complex64, "torch.cdouble": Complex128, "torch.bool": Bool,
		"np.float32": Float32, "numpy.uint8": Uint8, "bool_": Bool, "<f4": Float32, "=i8": Int64,
		"|u1": Uint8, "|b1": Invalid, "<c16": Complex128, "f2": Float16, " Float64 ": Float64,
	}
	for in, want := range cases {
		got, err := ParseDType(in)
		if want == Invalid {
			if err == nil {
				t.Errorf("ParseDType(%q) = %v, want an error", in, got)
			}
			continue
		}
		if err != nil || got != want {
			t.Errorf("ParseDType(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "float33", ">f4", "torch.", "quint8"} {
		if d, err := ParseDType(bad); err == nil {
			t.Errorf("ParseDType(%q) = %v, want an error", bad, d)
		}
	}
}

func TestInvalidDType(t *testing.T) {
	for _, d := range []DType{Invalid, numDTypes, 255} {
		if d.Valid() || d.Size() != 0 {
			t.Errorf("%d: Valid=%v Size=%d", d, d.Valid(), d.Size())
		}
		if _, err := d.MarshalText(); err == nil {
			t.Errorf("MarshalText(%d) succeeded", d)
		}
		if c, b, l := d.DLPack(); c != 0 || b != 0 || l != 0 {
			t.Errorf("DLPack(%d) = %d,%d,%d", d, c, b, l)
		}
	}
	if _, err := DTypeFromDLPack(dlFloat, 32, 4); err == nil {
		t.Error("vector DLPack type accepted")
	}
	if _, err := DTypeFromDLPack(dlFloat, 24, 1); err == nil {
		t.Error("24-bit float accepted")
	}
}
