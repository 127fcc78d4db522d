package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestRun: both planes measured, one JSON line each, every stream made
// Fetches (the slowest's count over the fastest's is above 0), and the
// windows were counted.
func TestRun(t *testing.T) {
	defer leakcheck.Check(t)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-planes", "shm,tcp", "-streams", "3", "-size", "4096", "-duration", "200ms", "-window", "20ms", "-json"}, &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines, want 2:\n%s", len(lines), out.String())
	}
	for i, plane := range []string{"shm", "tcp"} {
		var r result
		if err := json.Unmarshal([]byte(lines[i]), &r); err != nil {
			t.Fatal(err)
		}
		if r.Plane != plane || r.Streams != 3 || r.Bytes != 4096 || r.GBps <= 0 || r.SlowestFastest <= 0 || r.SlowestFastest > 1 || r.WindowMs != 20 || r.MaxFetchMs <= 0 || r.P50us <= 0 || r.P99us < r.P50us {
			t.Errorf("%s: %+v", plane, r)
		}
	}
}

// TestRunRefuses: flags that cannot measure anything are refused.
func TestRunRefuses(t *testing.T) {
	for _, args := range [][]string{{"-streams", "0"}, {"-duration", "10ms", "-window", "50ms"}, {"-planes", "nope", "-duration", "50ms", "-window", "10ms"}} {
		if err := run(context.Background(), args, &bytes.Buffer{}); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

// TestTrace: -trace writes a runtime trace of the first plane's run, and
// the run still reports its windows.
func TestTrace(t *testing.T) {
	defer leakcheck.Check(t)
	path := filepath.Join(t.TempDir(), "streams.trace")
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-planes", "shm", "-streams", "2", "-size", "4096", "-duration", "800ms", "-window", "50ms", "-json", "-trace", path}, &out); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Size() == 0 {
		t.Fatalf("no trace written: %v", err)
	}
	var r result
	if err := json.Unmarshal(out.Bytes(), &r); err != nil || r.WindowP50 <= 0 {
		t.Errorf("result %+v (%v)", r, err)
	}
}

// TestBusy: -busy runs its computing goroutines beside the streams, says
// so in the result, and stops them (leakcheck).
func TestBusy(t *testing.T) {
	defer leakcheck.Check(t)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-planes", "shm", "-streams", "1", "-size", "4096", "-duration", "100ms", "-window", "20ms", "-busy", "2", "-json"}, &out); err != nil {
		t.Fatal(err)
	}
	var r result
	if err := json.Unmarshal(out.Bytes(), &r); err != nil || r.Busy != 2 || r.P50us <= 0 {
		t.Errorf("result %+v (%v)", r, err)
	}
}
