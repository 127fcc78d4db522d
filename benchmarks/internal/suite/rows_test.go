package suite

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"testing"
	"time"
)

// rowsConfig is a short run of the rows cases, every transfer checked:
// 16 rows of 32 KiB out of 64 per Fetch (512 KiB, over the eager
// threshold, so the rows cross the data plane; one row, 32 KiB, too).
func rowsConfig(t *testing.T) Config {
	t.Helper()
	cfg := QuickConfig()
	var err error
	if cfg.Cases, err = SelectCases("trpc-tcp-rows,trpc-shm-rows,trpc-grpc-rows", false); err != nil {
		t.Fatal(err)
	}
	cfg.Payloads = Payloads[:1]
	cfg.Concurrency = []int{1, 2}
	cfg.RowsOf, cfg.Rows, cfg.RowBytes = 64, 16, 32<<10
	cfg.Serdes, cfg.Codecs = false, false
	cfg.Reps, cfg.MinReps = 2, 2
	cfg.RepTime, cfg.Budget = time.Millisecond, 20*time.Millisecond
	cfg.Verify = VerifyAll
	cfg.Command = "tensorbench rows test"
	return cfg
}

// TestRowsCases runs every rows case with its two partners alongside,
// checking every transfer's rows, and then checks that the JSON lines
// render the same tables the run printed.
func TestRowsCases(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := rowsConfig(t)
	var text, jsonl, progress bytes.Buffer
	rep, err := Run(ctx, cfg, &text, &jsonl, &progress)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	if len(rep.Transfers) != 0 || len(rep.Rows) != 3*len(cfg.Concurrency) {
		t.Fatalf("%d transfers and %d rows lines, want 0 and %d", len(rep.Transfers), len(rep.Rows), 3*len(cfg.Concurrency))
	}
	for i, r := range rep.Rows {
		plane := strings.TrimSuffix(strings.TrimPrefix(r.Case, "trpc-"), "-rows")
		if r.Transport != plane || r.Concurrency != cfg.Concurrency[i%len(cfg.Concurrency)] ||
			r.Rows != 16 || r.OfRows != 64 || r.RowBytes != 32<<10 || r.Bytes != 16*32<<10 {
			t.Errorf("rows line %d: %+v", i, r)
		}
		if r.GBps <= 0 || r.RowsPerS <= 0 || r.P50us <= 0 || r.PerRowGBps <= 0 || r.OfPerRow <= 0 || r.ContiguousGBps <= 0 ||
			r.OfContiguous <= 0 || r.PerRowP50us <= 0 || r.ContiguousP50us <= 0 {
			t.Errorf("%s c=%d: not measured: %+v", r.Case, r.Concurrency, r)
		}
		// Every timed Fetch, and more (warm-up, calibration, the
		// partners'), had its rows checked.
		if r.Verified <= r.Ops {
			t.Errorf("%s c=%d: %d transfers checked, not more than the %d timed", r.Case, r.Concurrency, r.Verified, r.Ops)
		}
	}
	for _, want := range []string{"## Rows: 16 scattered rows of 32 KiB out of 64 per Fetch", "| trpc-tcp-rows | tcp | 2 |",
		"| trpc-shm-rows | shm | 1 |", "| trpc-grpc-rows | grpc | 1 |"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, text.String())
		}
	}
	if strings.Contains(text.String(), "## Transfers") {
		t.Errorf("a run of rows cases alone prints a transfer section:\n%s", text.String())
	}

	back, err := ReadReport(&jsonl)
	if err != nil {
		t.Fatal(err)
	}
	var rendered bytes.Buffer
	if _, err := Render(back, &rendered, ""); err != nil {
		t.Fatal(err)
	}
	if rendered.String() != text.String() {
		t.Errorf("rendered tables differ from the run's:\n--- run\n%s\n--- rendered\n%s", text.String(), rendered.String())
	}
}

// TestRowsVerifiesRows fetches rows in another order than the source's,
// and a row the source does not have: the check fails, on each data plane.
func TestRowsVerifiesRows(t *testing.T) {
	for _, plane := range []string{"tcp", "shm", "grpc"} {
		for _, tc := range []struct {
			name  string
			spoil func(idx []int64)
		}{
			{"two rows swapped", func(idx []int64) { idx[0], idx[1] = idx[1], idx[0] }},
			{"another row", func(idx []int64) {
				for r := range int64(64) {
					if !slices.Contains(idx, r) {
						idx[len(idx)-1] = r
						return
					}
				}
			}},
		} {
			env := &rowsEnv{plane: plane, of: 64, rowBytes: 32 << 10, idx: rowsIndices(64, 16, 1), data: testSource(16 * 32 << 10), maxConc: 1}
			stampRows(env.data, env.rowBytes)
			sess, err := openRows(context.Background(), env, rowsScattered)
			if err != nil {
				t.Fatalf("%s: %v", plane, err)
			}
			// The table is published; the stream now asks for other rows.
			tc.spoil(env.idx)
			_, err = measure(context.Background(), sess, nil, env.data, 1, testPlan(VerifyAll))
			if err == nil || !strings.Contains(err.Error(), "differ from the source's") {
				t.Errorf("%s, %s: err = %v", plane, tc.name, err)
			}
			if err := sess.close(); err != nil {
				t.Errorf("%s: close: %v", plane, err)
			}
		}
	}
}

func TestRowsIndices(t *testing.T) {
	a, b := rowsIndices(4096, 256, 1), rowsIndices(4096, 256, 1)
	if !slices.Equal(a, b) || slices.Equal(a, rowsIndices(4096, 256, 2)) {
		t.Fatal("the seed does not fix the rows")
	}
	seen := map[int64]bool{}
	consecutive := 0
	for i, r := range a {
		if r < 0 || r >= 4096 || seen[r] {
			t.Fatalf("row %d out of range or repeated", r)
		}
		seen[r] = true
		if i > 0 && r == a[i-1]+1 {
			consecutive++
		}
	}
	// Scattered: rows that follow each other (one Read) are rare.
	if consecutive > 8 {
		t.Errorf("%d of 256 rows follow the one before", consecutive)
	}
}

func TestQuickHasRows(t *testing.T) {
	var quick []string
	for _, c := range QuickConfig().Cases {
		if c.Rows {
			quick = append(quick, c.Name)
		}
	}
	if !slices.Equal(quick, []string{"trpc-tcp-rows", "trpc-shm-rows"}) {
		t.Errorf("-quick rows cases %v", quick)
	}
	if cfg := DefaultConfig(); cfg.Rows != 256 || cfg.RowsOf != 4096 || cfg.RowBytes != 64<<10 {
		t.Errorf("rows geometry %d of %d × %d", cfg.Rows, cfg.RowsOf, cfg.RowBytes)
	}
}
