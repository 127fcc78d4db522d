package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestJSON runs every case with a few calls and checks the shape of each
// line, never the counts' sizes beyond what every run must show: a slow
// or loaded machine passes.
func TestJSON(t *testing.T) {
	defer leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, progress bytes.Buffer
	if err := run(ctx, []string{"-n", "20", "-warmup", "5", "-json"}, &out, &progress); err != nil {
		t.Fatalf("run: %v\nprogress:\n%s", err, progress.String())
	}
	seen := map[string]bool{}
	sc := bufio.NewScanner(&out)
	for line := 1; sc.Scan(); line++ {
		var obj map[string]any
		if err := json.Unmarshal(sc.Bytes(), &obj); err != nil {
			t.Fatalf("line %d is not a JSON object: %v\n%s", line, err, sc.Text())
		}
		for _, f := range []string{"case", "what", "gomaxprocs", "cpus", "one_process", "calls", "handoffs",
			"by_goroutine", "by_netpoller", "by_syscall_return", "created", "p_starts", "empty_p_starts", "syscalls", "p50_ns",
			"streams", "wall_per_call_ns"} {
			if _, ok := obj[f]; !ok {
				t.Errorf("line %d: no %q: %s", line, f, sc.Text())
			}
		}
		name, _ := obj["case"].(string)
		seen[name] = true
		if calls, _ := obj["calls"].(float64); calls != 20 {
			t.Errorf("%s: calls = %v, want 20", name, obj["calls"])
		}
		// Steps, or none where most calls saw no scheduler event (a
		// poller on many cores may find every answer so).
		if tl, _ := obj["timeline"].(map[string]any); tl == nil || tl["calls"].(float64) < 1 {
			t.Errorf("%s: timeline %v, want the steps of at least one call", name, obj["timeline"])
		} else if _, ok := tl["steps"].([]any); !ok {
			t.Errorf("%s: timeline steps %v, want a list", name, tl["steps"])
		}
		if p50, _ := obj["p50_ns"].(float64); p50 <= 0 {
			t.Errorf("%s: p50_ns = %v, want > 0", name, obj["p50_ns"])
		}
		parts := 0.0
		for _, f := range []string{"by_goroutine", "by_netpoller", "by_syscall_return", "created"} {
			parts += obj[f].(float64)
		}
		if h := obj["handoffs"].(float64); h < parts-1e-9 || h > parts+1e-9 {
			t.Errorf("%s: handoffs %v is not the sum of its parts, %v", name, h, parts)
		}
		// Every case crosses to another goroutine and back. A lucky
		// call may find its peer awake, but not every call of a case.
		if h := obj["handoffs"].(float64); h <= 0 {
			t.Errorf("%s: no hand-offs in 20 calls", name)
		}
	}
	for _, c := range allCases {
		if !seen[c.name] {
			t.Errorf("case %s printed no line", c.name)
		}
	}
}

// TestTable checks that the Markdown table has a row per case selected and
// says that both sides ran in one process.
func TestTable(t *testing.T) {
	defer leakcheck.Check(t)
	var out, progress bytes.Buffer
	if err := run(context.Background(), []string{"-n", "5", "-warmup", "1", "-cases", "pingpong-unix,pingpong-tcp"}, &out, &progress); err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	text := out.String()
	for _, want := range []string{"one process", "| pingpong-unix |", "| pingpong-tcp |"} {
		if !strings.Contains(text, want) {
			t.Errorf("the table has no %q:\n%s", want, text)
		}
	}
}

// TestTimelineTable: -timeline prints each case's steps, the module's
// prefix left out of the functions named.
func TestTimelineTable(t *testing.T) {
	defer leakcheck.Check(t)
	var out, progress bytes.Buffer
	if err := run(context.Background(), []string{"-n", "20", "-warmup", "5", "-cases", "fetch-tcp", "-timeline"}, &out, &progress); err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	text := out.String()
	for _, want := range []string{"fetch-tcp: the scheduler's events in a call", "| step | µs | gap µs | what |", "verbs/tcp."} {
		if !strings.Contains(text, want) {
			t.Errorf("the timeline has no %q:\n%s", want, text)
		}
	}
	if strings.Contains(text[strings.Index(text, "| step |"):], modulePrefix) {
		t.Errorf("the timeline names the module:\n%s", text)
	}
}

func TestUnknownCase(t *testing.T) {
	var out, progress bytes.Buffer
	if err := run(context.Background(), []string{"-cases", "nope"}, &out, &progress); err == nil {
		t.Error("-cases nope: no error")
	}
}

// TestStreams: -streams runs the Fetch cases (all of them by default)
// from that many goroutines, says so in each JSON line and adds the
// wall-clock time per call of all streams to the table.
func TestStreams(t *testing.T) {
	defer leakcheck.Check(t)
	var out, progress bytes.Buffer
	if err := run(context.Background(), []string{"-n", "20", "-warmup", "2", "-streams", "2", "-json"}, &out, &progress); err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	seen := map[string]bool{}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		var obj map[string]any
		if err := json.Unmarshal(sc.Bytes(), &obj); err != nil {
			t.Fatalf("not a JSON object: %v\n%s", err, sc.Text())
		}
		name, _ := obj["case"].(string)
		seen[name] = true
		if s, _ := obj["streams"].(float64); s != 2 {
			t.Errorf("%s: streams = %v, want 2", name, obj["streams"])
		}
		if w, _ := obj["wall_per_call_ns"].(float64); w <= 0 {
			t.Errorf("%s: wall_per_call_ns = %v, want > 0", name, obj["wall_per_call_ns"])
		}
		if calls, _ := obj["calls"].(float64); calls != 20 {
			t.Errorf("%s: calls = %v, want 20", name, obj["calls"])
		}
	}
	for _, c := range allCases {
		if seen[c.name] != streamable[c.name] {
			t.Errorf("case %s: printed %v, takes streams %v", c.name, seen[c.name], streamable[c.name])
		}
	}
	out.Reset()
	if err := run(context.Background(), []string{"-n", "10", "-warmup", "2", "-streams", "2", "-cases", "fetch-tcp"}, &out, &progress); err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	for _, want := range []string{"2 streams at once on one session", "µs a call, all streams |", "| fetch-tcp |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the table has no %q:\n%s", want, out.String())
		}
	}
}

// TestStreamsRefused: -streams refuses cases that cannot make calls at
// once, and counts outside 1 to -n.
func TestStreamsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"-streams", "2", "-cases", "pingpong-tcp"},
		{"-streams", "2", "-cases", "fetch-shm,call-tcp"},
		{"-streams", "0"},
		{"-n", "4", "-streams", "5"},
	} {
		var out, progress bytes.Buffer
		if err := run(context.Background(), args, &out, &progress); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}
