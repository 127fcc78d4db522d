package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestQuickJSON runs the quick mode on tiny sizes with -format json and
// checks that every line is a JSON object with the fields its kind
// promises, that every kind of case was measured, and that the plots were
// written. It checks shapes, never speeds: a slow machine passes.
func TestQuickJSON(t *testing.T) {
	defer leakcheck.Check(t)
	plots := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, progress bytes.Buffer
	args := []string{
		"-quick", "-format", "json", "-plots", plots,
		"-sizes", "4KiB,128KiB", "-concurrency", "1,2",
		"-reps", "2", "-min-reps", "1", "-rep-time", "2ms", "-budget", "20ms",
		"-codec-size", "64KiB", "-serdes-sizes", "4KiB", "-rate-callers", "1,2",
		"-rows", "8", "-rows-of", "32", "-row-bytes", "32KiB",
	}
	if err := run(ctx, args, &out, &progress); err != nil {
		t.Fatalf("run: %v\nprogress:\n%s", err, progress.String())
	}

	kinds := map[string]int{}
	caseKinds := map[string]bool{}
	calls := 0 // transfers of call cases
	lines := bytes.Clone(out.Bytes())
	sc := bufio.NewScanner(&out)
	sc.Buffer(nil, 1<<20)
	for line := 1; sc.Scan(); line++ {
		var obj map[string]any
		if err := json.Unmarshal(sc.Bytes(), &obj); err != nil {
			t.Fatalf("line %d is not a JSON object: %v\n%s", line, err, sc.Text())
		}
		kind, _ := obj["kind"].(string)
		kinds[kind]++
		switch kind {
		case "machine":
			requireFields(t, line, obj, "cores", "memory_gib", "kernel", "go_version", "load_before")
		case "transfer":
			requireFields(t, line, obj, "case", "case_kind", "transport", "payload", "bytes", "concurrency",
				"reps", "ops", "seconds", "gb_per_s", "gb_per_s_min", "gb_per_s_max", "p50_us", "p99_us", "verified")
			// -quick checks the bytes of every transfer (-verify all).
			if v, ops := obj["verified"].(float64), obj["ops"].(float64); v < ops {
				t.Errorf("line %d: %v transfers checked, fewer than the %v timed", line, v, ops)
			}
			for _, f := range []string{"bytes", "concurrency", "seconds", "gb_per_s", "p50_us", "ops"} {
				if v, _ := obj[f].(float64); v <= 0 {
					t.Errorf("line %d: %s = %v, want > 0", line, f, obj[f])
				}
			}
			if lo, med, hi := obj["gb_per_s_min"].(float64), obj["gb_per_s"].(float64), obj["gb_per_s_max"].(float64); lo > med || med > hi {
				t.Errorf("line %d: min %v, median %v, max %v out of order", line, lo, med, hi)
			}
			caseKinds[obj["case_kind"].(string)] = true
			if both, _ := obj["both_ways"].(bool); both {
				calls++
				requireFields(t, line, obj, "ceiling", "of_ceiling", "baseline", "of_baseline", "baseline_gb_per_s", "baseline_p50_us")
			}
		case "serdes":
			requireFields(t, line, obj, "format", "bytes", "wire_bytes", "encode_ns", "decode_ns", "encode_allocs", "decode_allocs")
		case "codec":
			requireFields(t, line, obj, "codec", "payload", "bytes", "compressed_bytes", "ratio",
				"compress_mb_per_s", "decompress_mb_per_s", "break_even_gbps", "pipelined_break_even_gbps")
		case "rate":
			requireFields(t, line, obj, "case", "transport", "payload", "bytes", "callers", "reps", "ops", "calls_per_s",
				"calls_per_s_min", "calls_per_s_max", "p50_us", "p99_us", "baseline", "baseline_transport", "baseline_calls_per_s",
				"baseline_p50_us", "ratio", "verified")
			for _, f := range []string{"calls_per_s", "baseline_calls_per_s", "ratio", "p50_us"} {
				if v, _ := obj[f].(float64); v <= 0 {
					t.Errorf("line %d: %s = %v, want > 0", line, f, obj[f])
				}
			}
		case "rows":
			requireFields(t, line, obj, "case", "transport", "payload", "rows", "of_rows", "row_bytes", "bytes", "concurrency",
				"reps", "ops", "seconds", "gb_per_s", "gb_per_s_min", "gb_per_s_max", "rows_per_s", "p50_us", "p99_us",
				"per_row_gb_per_s", "per_row_p50_us", "of_per_row", "contiguous_gb_per_s", "contiguous_p50_us", "of_contiguous", "verified")
			for _, f := range []string{"gb_per_s", "rows_per_s", "of_per_row", "of_contiguous", "p50_us"} {
				if v, _ := obj[f].(float64); v <= 0 {
					t.Errorf("line %d: %s = %v, want > 0", line, f, obj[f])
				}
			}
			if v, ops := obj["verified"].(float64), obj["ops"].(float64); v < ops {
				t.Errorf("line %d: %v transfers checked, fewer than the %v timed", line, v, ops)
			}
		case "skip":
			requireFields(t, line, obj, "case", "reason")
		case "note":
			requireFields(t, line, obj, "note")
		case "summary":
			requireFields(t, line, obj, "seconds", "measurements", "load_after")
		default:
			t.Errorf("line %d: unknown kind %q", line, kind)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"machine", "transfer", "rate", "rows", "serdes", "codec", "summary"} {
		if kinds[k] == 0 {
			t.Errorf("no %q line", k)
		}
	}
	if calls == 0 {
		t.Error("-quick measured no call case")
	}
	for _, k := range []string{"ceiling", "grpc", "grpc-compressed", "tensorrpc"} {
		if !caseKinds[k] {
			t.Errorf("no transfer of case kind %q", k)
		}
	}
	checkPlots(t, plots)

	// -render draws the same tables and plots from the JSON lines alone.
	jsonl := filepath.Join(t.TempDir(), "run.jsonl")
	if err := os.WriteFile(jsonl, lines, 0o644); err != nil {
		t.Fatal(err)
	}
	rendered := t.TempDir()
	var text, rprogress bytes.Buffer
	if err := run(ctx, []string{"-render", jsonl, "-plots", rendered}, &text, &rprogress); err != nil {
		t.Fatalf("-render: %v\n%s", err, rprogress.String())
	}
	for _, want := range []string{"Command: `tensorbench -quick", "### Throughput, GB/s, 2 streams", "| trpc-shm |",
		"### Calls, GB/s both ways, 2 streams", "| trpc-tcp-call | grpc-proto-call |", "## Small-message rate: 4 KiB calls per second",
		"| call-rate | tcp | 2 |", "## Rows: 8 scattered rows of 32 KiB out of 32 per Fetch", "| trpc-shm-rows | shm | 2 |",
		"## Ser/des", "## Compression"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("-render output lacks %q:\n%s", want, text.String())
		}
	}
	checkPlots(t, rendered)
	if err := run(ctx, []string{"-render", jsonl, "-quick"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "-quick") {
		t.Errorf("-render with -quick: err = %v, want a refusal naming -quick", err)
	}
	if t.Failed() {
		t.Logf("progress:\n%s", progress.String())
	}
}

// TestText checks that the default format prints the tables.
func TestText(t *testing.T) {
	defer leakcheck.Check(t)
	var out, progress bytes.Buffer
	args := []string{"-quick", "-sizes", "4KiB", "-concurrency", "1", "-cases", "memcpy,tcp-socket,grpc-proto",
		"-reps", "1", "-rep-time", "1ms", "-sections", "transfers,serdes,codecs", "-codec-size", "16KiB", "-serdes-sizes", "4KiB"}
	if err := run(context.Background(), args, &out, &progress); err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	for _, want := range []string{"| cores |", "### Throughput, GB/s, 1 stream", "| grpc-proto |", "## Ser/des", "## Compression", "break-even"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestRowsFlags checks that a Fetch cannot ask for more distinct rows than
// the table has.
func TestRowsFlags(t *testing.T) {
	for _, args := range [][]string{{"-rows", "9", "-rows-of", "8"}, {"-rows", "0"}, {"-row-bytes", "0"}} {
		if err := run(context.Background(), args, io.Discard, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int{"4096": 4096, "4KiB": 4 << 10, "64MiB": 64 << 20, "1GiB": 1 << 30, "2k": 2048, "3 MB": 3 << 20, "2TiB": 2 << 40} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "KiB", "4PiB", "-1", "0", "0KiB", "1.5MiB", "4KiB,8KiB"} {
		if _, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) succeeded", bad)
		}
	}
	if got, err := parseSizes("4KiB, 1MiB,64"); err != nil || len(got) != 3 || got[0] != 4<<10 || got[1] != 1<<20 || got[2] != 64 {
		t.Errorf("parseSizes = %v, %v", got, err)
	}
	for _, bad := range []string{"4KiB,", "4KiB,0", ","} {
		if _, err := parseSizes(bad); err == nil {
			t.Errorf("parseSizes(%q) succeeded", bad)
		}
	}
}

// checkPlots checks that dir holds the throughput plots as PNG and SVG.
func checkPlots(t *testing.T, dir string) {
	t.Helper()
	for _, name := range []string{"throughput-c1", "throughput-c2"} {
		png, err := os.ReadFile(filepath.Join(dir, name+".png"))
		if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG\r\n\x1a\n")) {
			t.Errorf("%s.png is not a PNG image (err %v)", name, err)
		}
		svg, err := os.ReadFile(filepath.Join(dir, name+".svg"))
		if err != nil || !bytes.Contains(svg, []byte("<svg")) || !bytes.Contains(svg, []byte("</svg>")) {
			t.Errorf("%s.svg is not an SVG document (err %v)", name, err)
		}
	}
}

func requireFields(t *testing.T, line int, obj map[string]any, fields ...string) {
	t.Helper()
	for _, f := range fields {
		if _, ok := obj[f]; !ok {
			t.Errorf("line %d (%s) lacks %q", line, obj["kind"], f)
		}
	}
}
