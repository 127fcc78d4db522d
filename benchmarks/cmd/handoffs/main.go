// Command handoffs counts how often the Go scheduler hands work between
// goroutines per 4 KiB call: tensorrpc Fetch and Call on the tcp and shm
// data planes, through the public API, and raw TCP and unix-socket
// ping-pongs beside them as the ceiling (about two hand-offs per round
// trip: the server's goroutine woken by the request, the caller's by the
// reply).
//
// Each case runs its calls sequentially (or, with -streams N, the Fetch
// cases from N goroutines at once on one session: what concurrent
// streams add per call, and what they queue on), warms up, times -n calls
// untraced for the median, then traces -n calls with runtime/trace and
// counts per call (see package benchmarks/internal/handoff): hand-offs by
// goroutine unblock, by the netpoller (no goroutine running), by a
// syscall's return without a P, and goroutine creations; idle Ps started
// and of those the ones that ran nothing before stopping; syscalls. Server
// and client run in this one process, so the counts are both sides'
// together. With -timeline (the JSON always has it) it also prints the
// scheduler's events of a call, in the order most calls saw them, with
// the median time since the call began: where a call's time goes
// between system calls, wake-ups and code (traced, so a little slower
// than untraced).
//
// Usage:
//
//	go run ./benchmarks/cmd/handoffs                     # Markdown table, -n 2000
//	GOMAXPROCS=16 go run ./benchmarks/cmd/handoffs       # as on a 16-core machine
//	go run ./benchmarks/cmd/handoffs -json -cases fetch-shm,pingpong-unix
//	go run ./benchmarks/cmd/handoffs -cases fetch-tcp,pingpong-tcp -timeline
//	go run ./benchmarks/cmd/handoffs -streams 4 -size 1048576   # the Fetch cases, 4 streams on one session
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/handoff"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "handoffs:", err)
		}
		os.Exit(2)
	}
}

// result is one case's line of -json output.
type result struct {
	Case       string `json:"case"`
	What       string `json:"what"`
	Bytes      int    `json:"bytes"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	CPUs       int    `json:"cpus"`
	// OneProcess says the server and the client ran in this process, so
	// the counts are both sides' together.
	OneProcess bool `json:"one_process"`
	handoff.Counts
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("handoffs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var names []string
	for _, c := range allCases {
		names = append(names, c.name)
	}
	var (
		n      = fs.Int("n", 2000, "calls traced per case (and as many timed untraced for the median)")
		warmup = fs.Int("warmup", 200, "untraced calls per case before anything is measured")
		cases  = fs.String("cases", "", "comma-separated cases (default all: "+strings.Join(names, ",")+")")
		asJSON = fs.Bool("json", false, "print one JSON object per case instead of a Markdown table")
		sites  = fs.Int("sites", 0, "also list, per case, the N places with the most hand-offs (who woke whom); the JSON has them all")
		tl     = fs.Bool("timeline", false, "also print, per case, the scheduler events most calls went through, in order, with the median time since the call began (the JSON always has it)")
		bytes  = fs.Int("size", size, "bytes of each call's tensor (4 KiB rides in the frames; past the eager threshold, 16 KiB, a Fetch's bytes take the data plane)")
		nstrm  = fs.Int("streams", 1, "goroutines making the calls at once, on one session (Fetch cases only: "+strings.Join(streamableNames(), ", ")+"); the counts stay per call, and the table adds the wall-clock time per call of all streams together")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *n <= 0 {
		return fmt.Errorf("-n %d: want at least one call", *n)
	}
	if *bytes <= 0 {
		return fmt.Errorf("-size %d: want at least one byte", *bytes)
	}
	size = *bytes
	if *nstrm < 1 || *nstrm > *n {
		return fmt.Errorf("-streams %d: want 1 to -n (%d)", *nstrm, *n)
	}
	if *warmup <= 0 {
		*warmup = -1 // handoff.Options: negative for none
	}
	selected := allCases
	if *cases != "" {
		selected = nil
		for _, name := range strings.Split(*cases, ",") {
			i := slices.IndexFunc(allCases, func(c caseDef) bool { return c.name == strings.TrimSpace(name) })
			if i < 0 {
				return fmt.Errorf("-cases: unknown case %q (have %s)", name, strings.Join(names, ", "))
			}
			selected = append(selected, allCases[i])
		}
	} else if *nstrm > 1 {
		selected = slices.DeleteFunc(slices.Clone(allCases), func(c caseDef) bool { return !streamable[c.name] })
	}
	if *nstrm > 1 {
		for _, c := range selected {
			if !streamable[c.name] {
				return fmt.Errorf("-streams %d: case %s makes its calls on one tensor or connection; the cases that take streams are %s", *nstrm, c.name, strings.Join(streamableNames(), ", "))
			}
		}
	}

	var results []result
	for _, c := range selected {
		fmt.Fprintf(stderr, "%s: %d calls\n", c.name, *n)
		counts, err := measure(ctx, c, *n, *warmup, *nstrm)
		if err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		r := result{Case: c.name, What: c.what, Bytes: size, GOMAXPROCS: runtime.GOMAXPROCS(0), CPUs: runtime.NumCPU(), OneProcess: true, Counts: counts}
		if *asJSON {
			line, err := json.Marshal(r)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "%s\n", line)
		}
		results = append(results, r)
	}
	if !*asJSON {
		printTable(stdout, results)
		if *sites > 0 {
			printSites(stdout, results, *sites)
		}
		if *tl {
			printTimelines(stdout, results)
		}
	}
	return nil
}

// printSites lists the top n hand-off sites of each case, and what came
// before its P starts.
func printSites(w io.Writer, rs []result, n int) {
	for _, r := range rs {
		fmt.Fprintf(w, "\n%s: where the hand-offs happen (per call)\n\n| from | to | per call |\n|---|---|--:|\n", r.Case)
		for _, s := range r.Sites[:min(n, len(r.Sites))] {
			fmt.Fprintf(w, "| %s | %s | %.2f |\n", s.From, s.To, s.PerCall)
		}
		fmt.Fprintf(w, "\n%s: what happened last, on another P, before each P start (per call)\n\n| transition | where | per call |\n|---|---|--:|\n", r.Case)
		for _, s := range r.PStartSites[:min(n, len(r.PStartSites))] {
			fmt.Fprintf(w, "| %s | %s | %.2f |\n", s.From, s.To, s.PerCall)
		}
	}
}

// printTimelines prints each case's timeline: the steps most calls
// took, with the median time since the call began and since the step
// before.
func printTimelines(w io.Writer, rs []result) {
	for _, r := range rs {
		tl := r.Timeline
		if tl == nil {
			continue
		}
		fmt.Fprintf(w, "\n%s: the scheduler's events in a call, as %d of %d calls went (median µs since the call began, traced; the gaps are system calls, wake-ups and code)\n\n", r.Case, tl.Calls, r.Calls)
		if len(tl.Steps) == 0 {
			fmt.Fprintln(w, "(no events: the calls neither parked, yielded nor made a system call)")
			continue
		}
		fmt.Fprintln(w, "| step | µs | gap µs | what |\n|--:|--:|--:|---|")
		var prev float64
		for i, s := range tl.Steps {
			at := float64(s.At.Nanoseconds()) / 1e3
			fmt.Fprintf(w, "| %d | %.1f | %.1f | %s |\n", i+1, at, at-prev, strings.ReplaceAll(s.What, modulePrefix, ""))
			prev = at
		}
	}
}

// modulePrefix is left out of the timelines' function names.
const modulePrefix = "github.com/tensorrpc/tensorrpc/"

// streamableNames lists the cases -streams takes, in allCases' order.
func streamableNames() []string {
	var names []string
	for _, c := range allCases {
		if streamable[c.name] {
			names = append(names, c.name)
		}
	}
	return names
}

func measure(ctx context.Context, c caseDef, n, warmup, streams int) (handoff.Counts, error) {
	call, closeCase, err := c.open(ctx)
	if err != nil {
		return handoff.Counts{}, err
	}
	counts, err := handoff.Measure(ctx, n, handoff.Options{Warmup: warmup, Streams: streams}, call)
	return counts, errors.Join(err, closeCase())
}

func printTable(w io.Writer, rs []result) {
	if len(rs) == 0 {
		return
	}
	how, wallHead, wallRule := "sequential", "", ""
	if s := rs[0].Streams; s > 1 {
		how = fmt.Sprintf("%d streams at once on one session", s)
		wallHead, wallRule = " µs a call, all streams |", "--:|"
	}
	fmt.Fprintf(w, "Per call of %d bytes, %s, %d calls traced per case; GOMAXPROCS=%d on %d CPUs. "+
		"Server and client in one process: the counts are both sides' together.\n\n", rs[0].Bytes, how, rs[0].Calls, rs[0].GOMAXPROCS, rs[0].CPUs)
	fmt.Fprintln(w, "| case | hand-offs | by goroutine | by netpoller | by syscall return | created | P starts | empty P starts | syscalls | p50 µs |"+wallHead)
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"+wallRule)
	for _, r := range rs {
		wall := ""
		if wallHead != "" {
			wall = fmt.Sprintf(" %.1f |", float64(r.WallPerCall.Nanoseconds())/1e3)
		}
		fmt.Fprintf(w, "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f |%s\n", r.Case,
			r.Handoffs, r.ByGoroutine, r.ByNetpoller, r.BySyscallReturn, r.Created,
			r.PStarts, r.EmptyPStarts, r.Syscalls, float64(r.P50.Nanoseconds())/1e3, wall)
	}
}
