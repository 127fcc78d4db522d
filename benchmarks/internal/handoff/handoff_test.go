package handoff

import (
	"bytes"
	"context"
	"errors"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	xtrace "golang.org/x/exp/trace"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// The tests assert what the scheduler must do, never how fast: every
// interleaving of the goroutines gives counts inside the ranges.

// TestChannelPingPong: each round of an unbuffered ping-pong is two
// rendezvous, and at each one the party that came first is blocked and
// the other unblocks it, so a round is two hand-offs by goroutine
// whichever side runs first.
func TestChannelPingPong(t *testing.T) {
	defer leakcheck.Check(t)
	const n = 1000
	ping, pong := make(chan int), make(chan int)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for v := range ping {
			pong <- v
		}
	}()
	defer func() { close(ping); <-done }()
	c, err := Measure(context.Background(), n, Options{Warmup: 10}, func() error {
		ping <- 1
		<-pong
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", c)
	if c.Calls != n {
		t.Errorf("Calls = %d, want %d", c.Calls, n)
	}
	if c.ByGoroutine < 1.5 || c.ByGoroutine > 2.5 {
		t.Errorf("%.2f hand-offs by goroutine per round, want about 2", c.ByGoroutine)
	}
	if c.Handoffs < c.ByGoroutine || c.Handoffs > 2.5 {
		t.Errorf("%.2f hand-offs per round (%.2f by goroutine), want about 2", c.Handoffs, c.ByGoroutine)
	}
	if c.EmptyPStarts > c.PStarts {
		t.Errorf("%.2f empty P starts of %.2f", c.EmptyPStarts, c.PStarts)
	}
	if c.P50 <= 0 {
		t.Errorf("p50 = %v, want > 0", c.P50)
	}
	// Both hand-offs are between this test's two functions: the caller
	// wakes the echo goroutine, which wakes the caller.
	var sum float64
	for _, s := range c.Sites {
		sum += s.PerCall
		if !strings.Contains(s.From, "TestChannelPingPong") && s.PerCall > 0.1 {
			t.Errorf("site %+v: a hand-off from outside the test", s)
		}
	}
	if len(c.Sites) == 0 || sum < c.Handoffs-0.01 || sum > c.Handoffs+0.01 {
		t.Errorf("sites %+v add up to %.2f per call, hand-offs %.2f", c.Sites, sum, c.Handoffs)
	}
}

// TestCreations: a call that starts a goroutine and waits for it creates
// one and is unblocked by it once.
func TestCreations(t *testing.T) {
	defer leakcheck.Check(t)
	const n = 500
	c, err := Measure(context.Background(), n, Options{Warmup: 10}, func() error {
		done := make(chan struct{})
		go close(done)
		<-done
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", c)
	if c.Created < 1 || c.Created > 1.05 {
		t.Errorf("%.3f goroutines created per call, want 1", c.Created)
	}
	// The creator may find done closed before it waits: at most one
	// unblock per call.
	if c.ByGoroutine > 1.1 {
		t.Errorf("%.2f hand-offs by goroutine per call, want at most 1", c.ByGoroutine)
	}
}

// TestNoInteraction: a loop that touches no other goroutine hands nothing
// off. The runtime may wake something now and then (a GC worker, sysmon's
// netpoll), so the test allows a few in the whole run, not one per call.
func TestNoInteraction(t *testing.T) {
	defer leakcheck.Check(t)
	const n = 2000
	var sink uint64
	c, err := Measure(context.Background(), n, Options{Warmup: 10}, func() error {
		for i := range uint64(100) {
			sink = sink*31 + i
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v (sink %d)", c, sink)
	if total := c.Handoffs * n; total > 20 {
		t.Errorf("%.0f hand-offs in %d calls that touch no other goroutine, want about none", total, n)
	}
	if total := c.Syscalls * n; total > 20 {
		t.Errorf("%.0f syscalls in %d calls that make none", total, n)
	}
}

// TestSyscalls: a write to /dev/null is one system call the runtime
// traces.
func TestSyscalls(t *testing.T) {
	defer leakcheck.Check(t)
	f, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := []byte("x")
	const n = 500
	c, err := Measure(context.Background(), n, Options{Warmup: 10}, func() error {
		_, err := f.Write(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", c)
	if c.Syscalls < 1 || c.Syscalls > 1.5 {
		t.Errorf("%.2f syscalls per write, want 1", c.Syscalls)
	}
}

// TestCountNeedsWindow: a trace without Measure's marks is an error, not
// zero counts.
func TestCountNeedsWindow(t *testing.T) {
	if _, err := Count(bytes.NewReader(nil)); err == nil {
		t.Error("Count of an empty trace: no error")
	}
}

func TestMeasureRejectsNoCalls(t *testing.T) {
	if _, err := Measure(context.Background(), 0, Options{}, func() error { return nil }); err == nil {
		t.Error("Measure of 0 calls: no error")
	}
}

// TestTraceReader: only the goroutine blocked reading the trace is left
// out, not the caller of trace.Start, which blocks under Start while
// tracing starts (when it was, a run now and then counted none of the
// caller's syscalls).
func TestTraceReader(t *testing.T) {
	stack := func(funcs ...string) xtrace.Stack {
		var frames []xtrace.StackFrame
		for i, f := range funcs {
			// MakeStack keys frames by PC: each needs its own.
			frames = append(frames, xtrace.StackFrame{PC: uint64(0x1000 + i), Func: f})
		}
		return xtrace.MakeStack(frames)
	}
	if !isTraceReader(stack("runtime.gopark", "runtime.ReadTrace", "runtime/trace.(*traceMultiplexer).startLocked.func1")) {
		t.Error("the trace reader's stack is not recognised")
	}
	if isTraceReader(stack("runtime.gopark", "runtime.StartTrace", "runtime/trace.(*traceMultiplexer).startLocked", "runtime/trace.Start", "main.main")) {
		t.Error("the caller of trace.Start is taken for the trace reader")
	}
}

// checkTimeline checks what every timeline must be: steps most calls
// took, each a known kind of event, at medians that never go back.
func checkTimeline(t *testing.T, c Counts) {
	t.Helper()
	tl := c.Timeline
	if tl == nil || tl.Calls < 1 || tl.Calls > c.Calls || len(tl.Steps) == 0 {
		t.Fatalf("timeline %+v of %d calls", tl, c.Calls)
	}
	var prev time.Duration
	for i, s := range tl.Steps {
		kind, _, _ := strings.Cut(s.What, " ")
		if !slices.Contains([]string{"park", "wake", "run", "syscall", "yield", "spin", "create"}, kind) {
			t.Errorf("step %d: %q is no kind of step", i+1, s.What)
		}
		// Each call's steps are in order, so are their medians.
		if s.At < prev {
			t.Errorf("step %d (%q) at %v, before the step before it (%v)", i+1, s.What, s.At, prev)
		}
		prev = s.At
	}
}

// TestTimelinePingPong: in a channel ping-pong round the caller wakes
// the echo goroutine, which runs and wakes the caller.
func TestTimelinePingPong(t *testing.T) {
	defer leakcheck.Check(t)
	ping, pong := make(chan int), make(chan int)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for v := range ping {
			pong <- v
		}
	}()
	defer func() { close(ping); <-done }()
	c, err := Measure(context.Background(), 500, Options{Warmup: 10}, func() error {
		ping <- 1
		<-pong
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	checkTimeline(t, c)
	t.Logf("%d calls: %+v", c.Timeline.Calls, c.Timeline.Steps)
	woke := 0
	for _, s := range c.Timeline.Steps {
		if strings.HasPrefix(s.What, "wake ") && strings.Contains(s.What, " by ") && strings.Contains(s.What, "TestTimelinePingPong") {
			woke++
		}
	}
	if woke == 0 {
		t.Errorf("no step wakes one of the test's goroutines: %+v", c.Timeline.Steps)
	}
}

// TestTimelineSpin: a goroutine that yields again and again, as one
// polling does, is one step, "spin", however many times it yields.
func TestTimelineSpin(t *testing.T) {
	defer leakcheck.Check(t)
	c, err := Measure(context.Background(), 300, Options{Warmup: 10}, func() error {
		for range 20 {
			runtime.Gosched()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	checkTimeline(t, c)
	t.Logf("%d calls: %+v", c.Timeline.Calls, c.Timeline.Steps)
	if st := c.Timeline.Steps; len(st) != 1 || !strings.HasPrefix(st[0].What, "spin ") || !strings.Contains(st[0].What, "TestTimelineSpin") {
		t.Errorf("steps %+v, want the caller's spin alone", st)
	}
}

// TestMeasureStreams: with Streams, the timed and traced calls are made
// by that many goroutines at once (the timed run's first calls each wait
// until all of them have begun, which only concurrent streams get past),
// every call is made once, and the streams' creation is inside the
// counted window.
func TestMeasureStreams(t *testing.T) {
	defer leakcheck.Check(t)
	const n, streams = 400, 4
	var calls, arrived atomic.Int64
	gate := make(chan struct{})
	c, err := Measure(context.Background(), n, Options{Warmup: -1, Streams: streams}, func() error {
		if calls.Add(1) <= streams {
			if arrived.Add(1) == streams {
				close(gate)
			}
			select {
			case <-gate:
			case <-time.After(10 * time.Second):
				return errors.New("the streams' first calls did not run at once")
			}
		}
		runtime.Gosched()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", c)
	if got := calls.Load(); got != 2*n {
		t.Errorf("call ran %d times, want %d (timed and traced)", got, 2*n)
	}
	if c.Calls != n || c.Streams != streams {
		t.Errorf("Calls, Streams = %d, %d, want %d, %d", c.Calls, c.Streams, n, streams)
	}
	if c.Timeline != nil {
		t.Errorf("a timeline of %d steps with %d streams, want none", len(c.Timeline.Steps), streams)
	}
	if c.WallPerCall <= 0 {
		t.Errorf("wall time per call %v, want > 0", c.WallPerCall)
	}
	if created := c.Created * n; created < streams-0.5 {
		t.Errorf("%.1f goroutines created in the window, want at least the %d streams", created, streams)
	}
}

func TestMeasureRejectsMoreStreamsThanCalls(t *testing.T) {
	if _, err := Measure(context.Background(), 2, Options{Streams: 3}, func() error { return nil }); err == nil {
		t.Error("Measure of 2 calls on 3 streams: no error")
	}
}
