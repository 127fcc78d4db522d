// Package handoff counts, per call, how often the Go scheduler hands work
// from one goroutine to another while a function runs: it traces N calls
// with runtime/trace into memory and reads the trace back with
// golang.org/x/exp/trace.
//
// It also lays out the calls' timelines: what the scheduler saw in each
// call (a goroutine parked, woken, run, in and out of a system call,
// where), in order, with the time since the call began, for the sequence
// most calls took (Counts.Timeline). The gaps between the steps are
// where the time goes: a system call's, a wake-up's, or code's between
// two scheduler events. Tracing slows each step down by a little, so
// that the times are longer than an untraced call's.
//
// A hand-off is a goroutine made runnable by something other than itself:
// unblocked by another goroutine (a channel send, a mutex or a sync.Cond
// release), by the runtime with no goroutine running (the netpoller, a
// timer), by its own return from a system call that lost its P, or
// created. A P start is an idle P set running on a thread; an empty P
// start is one whose P stops again without running a goroutine. Both
// sides of a call count when they run in the same process: the numbers
// are totals per call, not one side's.
package handoff

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/trace"
	"slices"
	"strings"
	"sync"
	"time"

	xtrace "golang.org/x/exp/trace"
)

// Counts are the per-call averages of one traced run, and the wall-clock
// median of one untraced run of the same calls.
type Counts struct {
	Calls int `json:"calls"`

	// Handoffs is ByGoroutine + ByNetpoller + BySyscallReturn + Created.
	Handoffs float64 `json:"handoffs"`
	// ByGoroutine counts goroutines unblocked (waiting to runnable) by a
	// running goroutine.
	ByGoroutine float64 `json:"by_goroutine"`
	// ByNetpoller counts goroutines unblocked while no goroutine ran: by
	// the netpoller in the scheduler or sysmon, or by a timer.
	ByNetpoller float64 `json:"by_netpoller"`
	// BySyscallReturn counts goroutines that came back from a system call
	// without a P and had to be scheduled again.
	BySyscallReturn float64 `json:"by_syscall_return"`
	// Created counts goroutines created.
	Created float64 `json:"created"`

	// PStarts counts idle Ps set running; EmptyPStarts those of them that
	// stopped again without running a goroutine (a thread woken to look
	// for work that found none).
	PStarts      float64 `json:"p_starts"`
	EmptyPStarts float64 `json:"empty_p_starts"`
	// Syscalls counts goroutines entering a system call (those the
	// runtime traces: not the raw ones such as futex from the scheduler).
	Syscalls float64 `json:"syscalls"`

	// P50 is the median wall-clock time of one call, from an untraced run
	// of Calls calls: tracing slows calls down.
	P50 time.Duration `json:"p50_ns"`
	// Streams is how many goroutines made the calls at once
	// (Options.Streams), and WallPerCall the untraced run's wall-clock
	// time over its calls: with one stream about the mean call, with
	// more the inverse of their throughput.
	Streams     int           `json:"streams"`
	WallPerCall time.Duration `json:"wall_per_call_ns"`

	// Timeline is the sequence of scheduler events most calls went
	// through, with the median time each step came after the call began.
	Timeline *Timeline `json:"timeline,omitempty"`

	// Sites are where the hand-offs happen, most frequent first: who made
	// a goroutine runnable and where that goroutine was waiting.
	Sites []Site `json:"sites,omitempty"`
	// PStartSites says what happened last before the P starts, on
	// another P: From is a goroutine's state transition (Waiting→Runnable
	// is a goroutine made runnable, Running→Runnable a yield,
	// Running→Syscall a system call), To where it happened. It guesses
	// the cause: the runtime wakes an idle P from the code that made work
	// for it, which is usually the latest thing traced.
	PStartSites []Site `json:"p_start_sites,omitempty"`
}

// Timeline is the sequence of scheduler events that Calls of the traced
// calls went through, in order (calls going other ways are left out); no
// steps when most calls saw none (a caller that found its answer without
// parking, yielding or a system call).
type Timeline struct {
	Calls int    `json:"calls"`
	Steps []Step `json:"steps"`
}

// Step is one event of a Timeline: What happened (a goroutine's state
// transition, "park", "wake", "run", "syscall", "syscall return", "yield"
// or "create"; "spin" for a goroutine that yielded and ran again, any
// number of times; and where: the goroutine's function, see Site), and
// At, the median time since its call began.
type Step struct {
	What string        `json:"what"`
	At   time.Duration `json:"at_ns"`
}

// Site is one place hand-offs happen: From (the function of the
// goroutine that made another runnable, or "netpoller" or "created by"
// for the runtime and for goroutine creation) and To (the function the
// goroutine waited in, or was created to run), each the innermost frame
// outside the runtime and the standard library's synchronisation, and
// PerCall, how often per call.
type Site struct {
	From    string  `json:"from"`
	To      string  `json:"to"`
	PerCall float64 `json:"per_call"`
}

// Options tune Measure.
type Options struct {
	// Warmup calls run untraced before anything is measured (default 200;
	// negative for none).
	Warmup int
	// Streams is how many goroutines make each run's calls at once
	// (default 1: the calling goroutine, one call after another); call
	// must then be safe for concurrent use. The calls of a run are split
	// between the streams as evenly as they go. With more than one, the
	// counted window also holds the streams' creation and the wait for
	// them (Streams goroutines created and about one hand-off more a
	// run, not a call), P50 is over every call of the timed run, and
	// there is no Timeline (the calls' events interleave).
	Streams int
}

// logCategory marks the traced window in the trace.
const logCategory = "handoff"

// Measure warms call up, times n calls untraced for the median, then
// traces n more calls and counts what happened between the first and the
// last of them, in every goroutine of the process; the timed and traced
// calls are made by opts.Streams goroutines at once. call's error stops
// the measurement.
func Measure(ctx context.Context, n int, opts Options, call func() error) (Counts, error) {
	if n <= 0 {
		return Counts{}, fmt.Errorf("handoff: %d calls, want at least one", n)
	}
	if trace.IsEnabled() {
		return Counts{}, errors.New("handoff: runtime/trace is already tracing")
	}
	streams := max(opts.Streams, 1)
	if streams > n {
		return Counts{}, fmt.Errorf("handoff: %d streams for %d calls, want at most one stream a call", streams, n)
	}
	warmup := opts.Warmup
	if warmup == 0 {
		warmup = 200
	}
	for range warmup {
		if err := call(); err != nil {
			return Counts{}, fmt.Errorf("warm-up: %w", err)
		}
	}
	times := make([]time.Duration, n)
	began := time.Now()
	if err := runStreams(n, streams, func(i int) error {
		start := time.Now()
		if err := call(); err != nil {
			return fmt.Errorf("timed call %d: %w", i, err)
		}
		times[i] = time.Since(start)
		return nil
	}); err != nil {
		return Counts{}, err
	}
	wall := time.Since(began)
	slices.Sort(times)

	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		return Counts{}, err
	}
	trace.Log(ctx, logCategory, "begin")
	callErr := runStreams(n, streams, func(i int) error {
		if streams == 1 {
			trace.Log(ctx, logCategory, callMark)
		}
		if err := call(); err != nil {
			return fmt.Errorf("traced call %d: %w", i, err)
		}
		return nil
	})
	trace.Log(ctx, logCategory, "end")
	trace.Stop()
	if callErr != nil {
		return Counts{}, callErr
	}
	t, err := Count(&buf)
	if err != nil {
		return Counts{}, err
	}
	c := t.PerCall(n)
	c.P50 = times[n/2]
	c.Streams, c.WallPerCall = streams, wall/time.Duration(n)
	c.Sites = sites(t.Sites, n)
	c.PStartSites = sites(t.PStartSites, n)
	c.Timeline = timeline(t.Calls)
	return c, nil
}

// runStreams runs do(i) for each i in [0, n): one after another in this
// goroutine with one stream, else split between streams goroutines in
// runs of consecutive i, each stopping at its first error. It returns
// once all have stopped, with the errors they stopped at.
func runStreams(n, streams int, do func(i int) error) error {
	if streams == 1 {
		for i := range n {
			if err := do(i); err != nil {
				return err
			}
		}
		return nil
	}
	var wg sync.WaitGroup
	errs := make([]error, streams)
	lo := 0
	for s := range streams {
		k := n / streams
		if s < n%streams {
			k++
		}
		wg.Add(1)
		go func(s, lo, hi int) {
			defer wg.Done()
			for i := lo; i < hi; i++ {
				if err := do(i); err != nil {
					errs[s] = err
					return
				}
			}
		}(s, lo, lo+k)
		lo += k
	}
	wg.Wait()
	return errors.Join(errs...)
}

// callMark is the log message Measure writes as each traced call begins.
const callMark = "call"

// timeline is the sequence of steps most calls took, with the median
// time of each step (nil without calls).
func timeline(calls [][]event) *Timeline {
	bySeq := map[string][][]event{}
	best := ""
	for _, c := range calls {
		var k strings.Builder
		for _, e := range c {
			k.WriteString(e.what)
			k.WriteByte('\n')
		}
		key := k.String()
		bySeq[key] = append(bySeq[key], c)
		if n, m := len(bySeq[key]), len(bySeq[best]); n > m || n == m && key < best {
			best = key
		}
	}
	same := bySeq[best]
	if len(same) == 0 {
		return nil
	}
	tl := &Timeline{Calls: len(same), Steps: []Step{}} // none: most calls saw no event
	at := make([]time.Duration, len(same))
	for i, e := range same[0] {
		for j, c := range same {
			at[j] = c[i].at
		}
		slices.Sort(at)
		tl.Steps = append(tl.Steps, Step{What: e.what, At: at[len(at)/2]})
	}
	return tl
}

// event is one scheduler event of a traced call: what (see Step) and
// when, since the call began.
type event struct {
	what string
	at   time.Duration
}

// sites lists counts per call, the most first.
func sites(m map[[2]string]int, n int) []Site {
	var l []Site
	for k, v := range m {
		l = append(l, Site{From: k[0], To: k[1], PerCall: float64(v) / float64(n)})
	}
	slices.SortFunc(l, func(a, b Site) int {
		if a.PerCall != b.PerCall {
			if a.PerCall > b.PerCall {
				return -1
			}
			return 1
		}
		return strings.Compare(a.From+a.To, b.From+b.To)
	})
	return l
}

// Totals are the counts of one traced window.
type Totals struct {
	ByGoroutine, ByNetpoller, BySyscallReturn, Created int
	PStarts, EmptyPStarts                              int
	Syscalls                                           int
	// Sites counts the hand-offs by {from, to} (see Site).
	Sites map[[2]string]int
	// PStartSites counts the P starts by what happened last, on another
	// P, before each: {a goroutine's transition, where it was}.
	PStartSites map[[2]string]int
	// Calls are the scheduler events of each call, in order (see Step),
	// for the calls whose beginnings the trace marks (Measure's).
	Calls [][]event
}

// Handoffs is the sum of the four kinds of hand-off.
func (t Totals) Handoffs() int {
	return t.ByGoroutine + t.ByNetpoller + t.BySyscallReturn + t.Created
}

// PerCall divides the totals by n calls.
func (t Totals) PerCall(n int) Counts {
	per := func(x int) float64 { return float64(x) / float64(n) }
	return Counts{
		Calls:           n,
		Handoffs:        per(t.Handoffs()),
		ByGoroutine:     per(t.ByGoroutine),
		ByNetpoller:     per(t.ByNetpoller),
		BySyscallReturn: per(t.BySyscallReturn),
		Created:         per(t.Created),
		PStarts:         per(t.PStarts),
		EmptyPStarts:    per(t.EmptyPStarts),
		Syscalls:        per(t.Syscalls),
	}
}

// procState follows one P through the trace.
type procState struct {
	started bool // set running inside the window, and not stopped since
	ran     bool // a goroutine ran on it since it started
}

// Count reads a trace written by runtime/trace and counts the events
// between the "handoff" log messages "begin" and "end" that Measure
// writes. The goroutine that copies the trace out of the runtime is left
// out: it runs because of tracing, not because of the calls.
func Count(r io.Reader) (Totals, error) {
	rd, err := xtrace.NewReader(r)
	if err != nil {
		return Totals{}, err
	}
	var (
		t       = Totals{Sites: map[[2]string]int{}, PStartSites: map[[2]string]int{}}
		last    [2]string // the latest goroutine transition, for PStartSites
		lastP   = xtrace.NoProc
		in      bool
		seenEnd bool
		procs   = map[xtrace.ProcID]*procState{}
		tracer  = map[xtrace.GoID]bool{}
		waitsIn = map[xtrace.GoID]string{} // where each waiting goroutine blocked
		where   = map[xtrace.GoID]string{} // where each goroutine last parked, yielded or entered a system call
		callAt  xtrace.Time                // when the call under way began
		inCall  bool
	)
	// step adds what happened at time to the call under way. A goroutine
	// that yields and runs again, over and over (one that polls), is one
	// step: "spin", at its first yield.
	step := func(what string, at xtrace.Time) {
		if !inCall {
			return
		}
		c := &t.Calls[len(t.Calls)-1]
		if w, ok := strings.CutPrefix(what, "run "); ok && len(*c) > 0 {
			switch last := &(*c)[len(*c)-1]; last.what {
			case "yield " + w:
				last.what = "spin " + w
				if n := len(*c); n > 1 && (*c)[n-2].what == last.what {
					*c = (*c)[:n-1]
				}
				return
			}
		}
		*c = append(*c, event{what: what, at: time.Duration(at - callAt)})
	}
	proc := func(id xtrace.ProcID) *procState {
		p := procs[id]
		if p == nil {
			p = &procState{}
			procs[id] = p
		}
		return p
	}
	for {
		ev, err := rd.ReadEvent()
		if err == io.EOF {
			break
		}
		if err != nil {
			return Totals{}, err
		}
		switch ev.Kind() {
		case xtrace.EventLog:
			if l := ev.Log(); l.Category == logCategory {
				switch l.Message {
				case "begin":
					in = true
				case callMark:
					if in {
						callAt, inCall = ev.Time(), true
						t.Calls = append(t.Calls, nil)
					}
				case "end":
					in, seenEnd, inCall = false, true, false
				}
			}
		case xtrace.EventStateTransition:
			st := ev.StateTransition()
			switch st.Resource.Kind {
			case xtrace.ResourceGoroutine:
				id := st.Resource.Goroutine()
				from, to := st.Goroutine()
				if to == xtrace.GoWaiting {
					if isTraceReader(ev.Stack()) {
						tracer[id] = true
					}
					waitsIn[id] = site(ev.Stack())
				}
				if from == xtrace.GoRunning && (to == xtrace.GoWaiting || to == xtrace.GoRunnable || to == xtrace.GoSyscall) {
					where[id] = site(ev.Stack())
				}
				if to.Executing() && ev.Proc() != xtrace.NoProc {
					proc(ev.Proc()).ran = true
				}
				if !in || tracer[id] {
					continue
				}
				if ev.Goroutine() != xtrace.NoGoroutine && !tracer[ev.Goroutine()] {
					last, lastP = [2]string{from.String() + "→" + to.String(), site(ev.Stack())}, ev.Proc()
				}
				if what := stepOf(from, to, ev, st, where, id); what != "" {
					step(what, ev.Time())
				}
				switch {
				case from == xtrace.GoNotExist && to == xtrace.GoRunnable:
					t.Created++
					t.Sites[[2]string{"created by " + site(ev.Stack()), site(st.Stack)}]++
				case from == xtrace.GoWaiting && to == xtrace.GoRunnable:
					if ev.Goroutine() != xtrace.NoGoroutine {
						t.ByGoroutine++
						t.Sites[[2]string{site(ev.Stack()), waiting(waitsIn, id)}]++
					} else {
						t.ByNetpoller++
						t.Sites[[2]string{"netpoller", waiting(waitsIn, id)}]++
					}
				case from == xtrace.GoSyscall && to == xtrace.GoRunnable:
					t.BySyscallReturn++
				case from == xtrace.GoRunning && to == xtrace.GoSyscall:
					t.Syscalls++
				}
			case xtrace.ResourceProc:
				p := proc(st.Resource.Proc())
				from, to := st.Proc()
				switch {
				case from == xtrace.ProcIdle && to == xtrace.ProcRunning:
					*p = procState{started: in}
					if in {
						t.PStarts++
						if lastP != st.Resource.Proc() && last[0] != "" {
							t.PStartSites[last]++
						} else {
							t.PStartSites[[2]string{"?", "?"}]++
						}
					}
				case from == xtrace.ProcRunning && to == xtrace.ProcIdle:
					if p.started && !p.ran {
						t.EmptyPStarts++
					}
					*p = procState{}
				}
			}
		}
	}
	if !seenEnd {
		return Totals{}, errors.New("handoff: the trace has no end mark of the measured window")
	}
	return t, nil
}

// stepOf names goroutine id's transition from → to, of event ev, as a
// timeline step ("" for none worth one); where is where each goroutine
// last parked, yielded or entered a system call.
func stepOf(from, to xtrace.GoState, ev xtrace.Event, st xtrace.StateTransition, where map[xtrace.GoID]string, id xtrace.GoID) string {
	switch {
	case from == xtrace.GoNotExist && to == xtrace.GoRunnable:
		return "create " + site(st.Stack) + " by " + site(ev.Stack())
	case from == xtrace.GoWaiting && to == xtrace.GoRunnable:
		by := "netpoller"
		if ev.Goroutine() != xtrace.NoGoroutine {
			by = site(ev.Stack())
		}
		return "wake " + waiting(where, id) + " by " + by
	case from == xtrace.GoRunnable && to == xtrace.GoRunning:
		return "run " + waiting(where, id)
	case from == xtrace.GoRunning && to == xtrace.GoWaiting:
		return "park " + site(ev.Stack())
	case from == xtrace.GoRunning && to == xtrace.GoSyscall:
		return "syscall " + site(ev.Stack())
	case from == xtrace.GoSyscall && to == xtrace.GoRunning:
		return "syscall return " + waiting(where, id)
	case from == xtrace.GoSyscall && to == xtrace.GoRunnable:
		return "syscall return, P lost " + waiting(where, id)
	case from == xtrace.GoRunning && to == xtrace.GoRunnable:
		return "yield " + site(ev.Stack())
	}
	return ""
}

// waiting is where goroutine id blocked (or, given where, last stopped
// running), as far as the trace says.
func waiting(waitsIn map[xtrace.GoID]string, id xtrace.GoID) string {
	if w, ok := waitsIn[id]; ok {
		return w
	}
	return "?"
}

// site names the innermost frame of stack outside the runtime and the
// standard library's synchronisation and I/O plumbing ("?" when the
// trace has no stack).
func site(stack xtrace.Stack) string {
	first := ""
	for f := range stack.Frames() {
		if first == "" {
			first = f.Func
		}
		if !plumbing(f.Func) {
			return f.Func
		}
	}
	if first == "" {
		return "?"
	}
	return first
}

// plumbing reports whether fn is runtime or library code that every
// blocking or waking path goes through.
func plumbing(fn string) bool {
	for _, p := range []string{"runtime.", "sync.", "internal/", "context.", "time.", "net.", "os.", "io.", "bufio.", "syscall.", "golang.org/x/sys/"} {
		if strings.HasPrefix(fn, p) {
			return true
		}
	}
	return false
}

// isTraceReader reports whether stack is that of runtime/trace's goroutine
// that reads the trace out of the runtime, blocking in runtime.ReadTrace.
// (Not any stack under runtime/trace.Start: the caller of Start blocks
// there too while tracing starts.)
func isTraceReader(stack xtrace.Stack) bool {
	for f := range stack.Frames() {
		if f.Func == "runtime.ReadTrace" {
			return true
		}
	}
	return false
}
