package zerocopy

import (
	"errors"
	"math"
	"testing"
)

func TestNewValidates(t *testing.T) {
	cases := []struct {
		name  string
		dtype DType
		shape []int64
		len   int
		err   error
	}{
		{"scalar", Float32, nil, 4, nil},
		{"matrix", Float64, []int64{2, 3}, 48, nil},
		{"empty dim", Int32, []int64{4, 0, 7}, 0, nil},
		{"every dtype size", Complex128, []int64{3}, 48, nil},
		{"invalid dtype", Invalid, []int64{1}, 0, ErrInvalidDType},
		{"unknown dtype", DType(200), []int64{1}, 0, ErrInvalidDType},
		{"negative", Float32, []int64{2, -1}, 0, ErrNegativeDim},
		{"negative after zero", Float32, []int64{0, -1}, 0, ErrNegativeDim},
		{"count overflow", Uint8, []int64{math.MaxInt64, 2}, 0, ErrOverflow},
		{"count overflow hi", Uint8, []int64{1 << 40, 1 << 40}, 0, ErrOverflow},
		{"byte overflow", Float64, []int64{math.MaxInt64 / 4}, 0, ErrOverflow},
		{"zero does not hide overflow", Float64, []int64{math.MaxInt64, math.MaxInt64, 0}, 0, ErrOverflow},
		{"too short", Float32, []int64{4}, 15, ErrLengthMismatch},
		{"too long", Float32, []int64{4}, 17, ErrLengthMismatch},
		{"rank limit ok", Uint8, make([]int64, MaxRank), 0, nil},
		{"rank limit", Uint8, make([]int64, MaxRank+1), 0, ErrRankTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tn, err := New(c.dtype, c.shape, make([]byte, c.len))
			if c.err != nil {
				if !errors.Is(err, c.err) {
					t.Fatalf("New: err = %v, want %v", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			if tn.DType() != c.dtype || tn.Rank() != len(c.shape) || len(tn.Bytes()) != c.len || !tn.Valid() {
				t.Fatalf("got %v", tn)
			}
		})
	}
}

func TestNewCopiesShape(t *testing.T) {
	shape := []int64{2, 2}
	tn, err := New(Int8, shape, make([]byte, 4))
	if err != nil {
		t.Fatal(err)
	}
	shape[0] = 100
	if tn.Shape()[0] != 2 {
		t.Fatal("tensor shares the caller's shape slice")
	}
	if tn.Len() != 4 || tn.String() != "int8[2 2] (4 B)" {
		t.Fatalf("Len=%d String=%q", tn.Len(), tn.String())
	}
	var zero Tensor
	if zero.Valid() || zero.Len() != 0 {
		t.Fatal("zero tensor claims to be valid")
	}
}

func TestByteSizeEveryDType(t *testing.T) {
	for _, d := range DTypes() {
		n, err := ByteSize(d, []int64{3, 5})
		if err != nil || n != int64(15*d.Size()) {
			t.Errorf("ByteSize(%v) = %d, %v", d, n, err)
		}
	}
}
