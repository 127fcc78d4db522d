package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"math"
	"slices"
	"strings"
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

func TestSweepFlag(t *testing.T) {
	cfg, err := parseFlags([]string{"-a"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.sizes) != 23 || cfg.sizes[0] != 2 || cfg.sizes[22] != 1<<23 {
		t.Errorf("-a: sizes %v, want 2, 4, ... 8 MiB (2^1..2^23)", cfg.sizes)
	}
	cfg, err = parseFlags([]string{"-a", "-max-size", "1000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int{2, 4, 8, 16, 32, 64, 128, 256, 512, 1000}; !slices.Equal(cfg.sizes, want) {
		t.Errorf("-a -max-size 1000: sizes %v, want %v", cfg.sizes, want)
	}
	for _, args := range [][]string{{"-a", "-size", "64"}, {"-max-size", "1MiB"}, {"-a", "-max-size", "1"}, {"-a", "-max-size", "x"}, {"-size", "0"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) succeeded", args)
		}
	}
}

// TestColumns runs a short bandwidth and latency test through the command
// line and checks perftest's columns and the ceiling's description.
func TestColumns(t *testing.T) {
	defer leakcheck.Check(t)
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"-test", "write_bw", "-size", "4KiB,64KiB", "-iters", "40", "-rounds", "1"},
			[]string{"ceiling: a raw TCP socket", "#bytes", "#iterations", "BW peak[GB/s]", "BW average[GB/s]", "MsgRate[Mpps]", "BW/ceiling", "row:4096", "row:65536"}},
		{[]string{"-test", "send_lat", "-a", "-max-size", "8", "-iters", "40", "-rounds", "1"},
			[]string{"ceiling: a raw TCP socket", "half the round trip", "t_min[usec]", "t_max[usec]", "t_typical[usec]", "t_avg[usec]", "t_stdev[usec]",
				"99% percentile[usec]", "99.9% percentile[usec]", "t_typical/ceiling", "row:2", "row:4", "row:8"}},
	} {
		var out bytes.Buffer
		if err := run(append([]string{"-provider", "tcp"}, tc.args...), &out, io.Discard); err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		rows := map[string]bool{}
		for _, line := range strings.Split(out.String(), "\n") {
			if f := strings.Fields(line); len(f) > 0 {
				rows["row:"+f[0]] = true
			}
		}
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) && !rows[w] {
				t.Errorf("%q: output lacks %q:\n%s", tc.args, w, out.String())
			}
		}
	}
}

func TestPeak(t *testing.T) {
	// 64 completions in 64 ms, the middle 16 of them in 4 ms: the peak is
	// their rate, the average the whole run's.
	r := result{iters: 64, bytes: 64 * 1000, elapsed: 64 * time.Millisecond}
	r.marks = []mark{{0, 0}, {30 * time.Millisecond, 24}, {34 * time.Millisecond, 40}, {64 * time.Millisecond, 64}}
	if got, want := peakGBps(r, 1000, 16), 16*1000/4e-3/1e9; math.Abs(got-want) > 1e-9 {
		t.Errorf("peak %v GB/s, want %v", got, want)
	}
	if got, want := peakGBps(result{iters: 4, bytes: 4000, elapsed: time.Millisecond}, 1000, 16), 4000/1e-3/1e9; math.Abs(got-want) > 1e-9 {
		t.Errorf("peak without marks %v, want the average %v", got, want)
	}
}

func TestMemcpyThreads(t *testing.T) {
	for _, threads := range []int{1, 3} {
		r, err := memcpyBandwidth(heapMemory, 1000, 20, threads, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if r.iters != 20 || r.bytes != 20*1000 {
			t.Errorf("%d threads: %d iterations, %d bytes; want 20 and 20000", threads, r.iters, r.bytes)
		}
	}
}

func TestLatencyStats(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 1000; i++ {
		d = append(d, time.Duration(i)*time.Microsecond)
	}
	st := latencyStats(d)
	if st.min != time.Microsecond || st.max != 1000*time.Microsecond || st.typical != 501*time.Microsecond ||
		st.p99 != 991*time.Microsecond || st.p999 != 1000*time.Microsecond || st.avg != 500500*time.Nanosecond {
		t.Errorf("stats %+v", st)
	}
}

// TestHelp: -h explains the command (examples and what the columns mean),
// not only the flags, and is not an error for main's exit status.
func TestHelp(t *testing.T) {
	var stderr bytes.Buffer
	err := run([]string{"-h"}, io.Discard, &stderr)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("run(-h) = %v, want flag.ErrHelp (main exits 0 on it)", err)
	}
	for _, want := range []string{"Examples:", "verbsperf -provider shm -test write_bw -a", "t_typical (the", "-provider"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("-h output lacks %q:\n%s", want, stderr.String())
		}
	}
}
