package main

import (
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

func TestParseSizes(t *testing.T) {
	for in, want := range map[string]int{"64": 64, "64B": 64, "4K": 4096, "4KiB": 4096, "1MiB": 1 << 20, "1m": 1 << 20, "2GiB": 2 << 30, "1TiB": 1 << 40} {
		if got, err := parseSizes(in); err != nil || len(got) != 1 || got[0] != want {
			t.Errorf("parseSizes(%q) = %v, %v; want [%d]", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1", "1.5MiB", "MiB", "2TiB", "2000GiB", "64,", "64,0"} {
		if _, err := parseSizes(in); err == nil {
			t.Errorf("parseSizes(%q) succeeded", in)
		}
	}
	if got, err := parseSizes("64, 4KiB,1MiB"); err != nil || len(got) != 3 || got[2] != 1<<20 {
		t.Errorf("parseSizes(list) = %v, %v", got, err)
	}
}

// TestLoopback runs every test briefly on the tcp provider, with its
// ceiling, and checks that each stops by itself.
func TestLoopback(t *testing.T) {
	defer leakcheck.Check(t)
	for name := range tests {
		t.Run(name, func(t *testing.T) {
			p := params{Test: name, Size: 4096, Iters: 50, Depth: 4, Duration: 5 * time.Second}
			res, ceil, err := loopback(providers["tcp"], p, false, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if res.iters != 50 || ceil.iters != 50 {
				t.Fatalf("ran %d iterations and %d of the ceiling, want 50 each", res.iters, ceil.iters)
			}
		})
	}
}

// TestDurationBound checks that -duration stops a run that asks for more
// iterations than fit.
func TestDurationBound(t *testing.T) {
	defer leakcheck.Check(t)
	p := params{Test: "send_lat", Size: 64, Iters: 1 << 30, Depth: 1, Duration: 200 * time.Millisecond}
	start := time.Now()
	res, _, err := loopback(providers["tcp"], p, true, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 8*time.Second || res.iters == 0 {
		t.Fatalf("a 200ms run took %v for %d iterations", d, res.iters)
	}
}
