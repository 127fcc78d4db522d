package suite

import (
	"math"
	"testing"
	"time"
)

func TestBreakEven(t *testing.T) {
	// r = 2, Cc = Cd = 1 GB/s: (1 - 1/2) / (1e-9 + 1e-9) = 0.25 GB/s.
	serial, pipelined := breakEven(2, 1e9, 1e9)
	if math.Abs(serial-0.25e9) > 1 || pipelined != 1e9 {
		t.Errorf("breakEven(2, 1e9, 1e9) = %v, %v; want 2.5e8, 1e9", serial, pipelined)
	}
	// At the break-even bandwidth both ways take the same time.
	n, r, cc, cd := 1e9, 3.0, 0.5e9, 2e9
	b, _ := breakEven(r, cc, cd)
	raw, compressed := n/b, n/cc+n/(r*b)+n/cd
	if math.Abs(raw-compressed) > 1e-9*raw {
		t.Errorf("at B = %v: raw %v s, compressed %v s", b, raw, compressed)
	}
	if s, p := breakEven(1, 1e9, 1e9); s != 0 || p != 0 {
		t.Errorf("incompressible data breaks even at %v, %v; want never (0)", s, p)
	}
}

func TestMedianPercentile(t *testing.T) {
	if m := median([]float64{5, 1, 3}); m != 3 {
		t.Errorf("median = %v", m)
	}
	if m := median([]float64{4, 1, 3, 2}); m != 2.5 {
		t.Errorf("median = %v", m)
	}
	ds := make([]time.Duration, 100)
	for i := range ds {
		ds[i] = time.Duration(100 - i)
	}
	if p := percentile(ds, 0.5); p != 50 {
		t.Errorf("p50 = %v", p)
	}
	if p := percentile(ds, 0.99); p != 99 {
		t.Errorf("p99 = %v", p)
	}
}

func TestPayloadsTile(t *testing.T) {
	src := newPayloadSource(Payloads, 1<<20)
	dst := make([]byte, 3<<20)
	for _, p := range Payloads {
		src.fill(p, dst)
		for off := 0; off < len(dst); off += 1 << 20 {
			if string(dst[off:off+1<<20]) != string(src.blocks[p.Name]) {
				t.Fatalf("%s: block at %d differs", p.Name, off)
			}
		}
	}
	sparse := src.blocks["sparse-f32"]
	zeros := 0
	for i := 0; i < len(sparse); i += 4 {
		if sparse[i]|sparse[i+1]|sparse[i+2]|sparse[i+3] == 0 {
			zeros++
		}
	}
	if frac := float64(zeros) / float64(len(sparse)/4); frac < 0.88 || frac > 0.92 {
		t.Errorf("sparse payload is %.3f zeros, want about 0.9", frac)
	}
}
