package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/tensorrpc/tensorrpc/examples/internal/units"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
)

// summary is what a run measured over the timed all-reduces.
type summary struct {
	Plane    string
	Time     time.Duration // per all-reduce: mean over iterations of the slowest rank
	AlgBW    float64       // n·4 bytes / Time, in bytes per second
	BusBW    float64       // AlgBW · 2(P−1)/P
	Expected float64       // 2(P−1)/P · n·4: bytes each rank must send
	Sent     []int64       // per rank, per all-reduce (the same every time)
	Received []int64
	Copies   []int64
	Exact    bool
}

// header prints what the job is.
func header(out io.Writer, cfg *config) {
	fmt.Fprintf(out, "allreduce: %d processes, n = %d float32 (%s), 1 warm-up + %d timed all-reduces\n",
		cfg.Ranks, cfg.Elements, bytesize.Format(int64(cfg.Elements)*4), cfg.Iters)
}

// run starts the ranks, connects the ring, runs one warm-up and cfg.Iters
// timed all-reduces, checks every result and prints the summary.
func run(ctx context.Context, cfg *config, out io.Writer) (_ *summary, err error) {
	header(out, cfg)

	ranks := make(childproc.Group, 0, cfg.Ranks)
	defer func() {
		if stopErr := ranks.Stop(20 * time.Second); stopErr != nil {
			err = errors.Join(err, fmt.Errorf("stopping the ranks: %w", stopErr))
		}
	}()
	line := func(r int) (string, error) {
		lctx, cancel := context.WithTimeout(ctx, connectTimeout)
		defer cancel()
		l, err := ranks[r].ReadLine(lctx)
		if err != nil {
			return "", fmt.Errorf("rank %d: %w", r, err)
		}
		return l, nil
	}
	addrs := make([]string, cfg.Ranks)
	for r := range cfg.Ranks {
		p, err := childproc.Start(rankRole, "-rank", strconv.Itoa(r), "-p", strconv.Itoa(cfg.Ranks),
			"-n", strconv.Itoa(cfg.Elements), "-transports", strings.Join(cfg.Transports, ","))
		if err != nil {
			return nil, err
		}
		ranks = append(ranks, p)
		if addrs[r], err = line(r); err != nil {
			return nil, err
		}
	}
	for r := range cfg.Ranks {
		if err := ranks[r].WriteLine(addrs[(r+1)%cfg.Ranks]); err != nil {
			return nil, err
		}
	}
	planes := make([]string, cfg.Ranks)
	for r := range cfg.Ranks {
		l, err := line(r)
		if err != nil {
			return nil, err
		}
		var ok bool
		if planes[r], ok = strings.CutPrefix(l, "ready "); !ok {
			return nil, fmt.Errorf("rank %d said %q, want ready", r, l)
		}
	}
	t := newTally(cfg, out, planes)

	// Iteration 0 warms up: pools grow and peers map new regions.
	for iter := 0; iter <= cfg.Iters; iter++ {
		for r := range cfg.Ranks {
			if err := ranks[r].WriteLine("go"); err != nil {
				return nil, err
			}
		}
		results := make([]iterResult, cfg.Ranks)
		for r := range cfg.Ranks {
			l, err := line(r)
			if err != nil {
				return nil, err
			}
			if err := json.Unmarshal([]byte(l), &results[r]); err != nil {
				return nil, fmt.Errorf("rank %d: unexpected result %q", r, l)
			}
		}
		if err := t.add(iter, results); err != nil {
			return nil, err
		}
	}
	return t.finish()
}

// tally turns the ranks' results into the summary, the same whichever
// process collects them: the parent, or rank 0 when the ranks were
// launched (launch.go).
type tally struct {
	cfg   *config
	out   io.Writer
	sum   summary
	total time.Duration // the slowest rank's time, summed over the timed all-reduces
}

// newTally starts the summary of a ring whose ranks use planes (one per
// rank) to their right neighbours, and prints them.
func newTally(cfg *config, out io.Writer, planes []string) *tally {
	var distinct []string
	for _, p := range planes {
		if !slices.Contains(distinct, p) {
			distinct = append(distinct, p)
		}
	}
	t := &tally{cfg: cfg, out: out, sum: summary{
		Plane: strings.Join(distinct, ","), // one plane, unless ranks differ
		Exact: true,
		Sent:  make([]int64, cfg.Ranks), Received: make([]int64, cfg.Ranks), Copies: make([]int64, cfg.Ranks),
	}}
	fmt.Fprintf(out, "data plane %s\n", t.sum.Plane)
	return t
}

// add takes the results of all-reduce iter, one per rank in rank order.
func (t *tally) add(iter int, results []iterResult) error {
	sum := &t.sum
	var slowest time.Duration
	for r, res := range results {
		if res.Rank != r || res.Iter != iter {
			return fmt.Errorf("rank %d: result of rank %d, all-reduce %d, want all-reduce %d", r, res.Rank, res.Iter, iter)
		}
		if !res.Exact {
			sum.Exact = false
			fmt.Fprintf(t.out, "rank %d, all-reduce %d: WRONG: %s\n", r, iter, res.Mismatch)
		}
		if iter > 0 && (res.Sent != sum.Sent[r] || res.Received != sum.Received[r]) {
			return fmt.Errorf("rank %d moved %d/%d bytes in all-reduce %d, %d/%d before", r, res.Sent, res.Received, iter, sum.Sent[r], sum.Received[r])
		}
		sum.Sent[r], sum.Received[r], sum.Copies[r] = res.Sent, res.Received, res.Copies
		slowest = max(slowest, res.Time)
	}
	if iter > 0 {
		t.total += slowest
	}
	return nil
}

// finish prints the summary after the last all-reduce, and fails when a
// result was wrong or a rank's traffic differs from what the algorithm
// needs.
func (t *tally) finish() (*summary, error) {
	cfg, out, sum := t.cfg, t.out, &t.sum
	bytes := int64(cfg.Elements) * 4
	p := float64(cfg.Ranks)
	sum.Time = t.total / time.Duration(cfg.Iters)
	sum.AlgBW = float64(bytes) / sum.Time.Seconds()
	sum.BusBW = sum.AlgBW * 2 * (p - 1) / p
	sum.Expected = 2 * (p - 1) / p * float64(bytes)

	fmt.Fprintf(out, "%4s  %14s  %14s  %7s  %14s  %6s\n", "rank", "sent", "2(p−1)/p·n", "diff", "received", "copies")
	trafficOK := true
	for r := range cfg.Ranks {
		diff := (float64(sum.Sent[r]) - sum.Expected) / sum.Expected
		if math.Abs(diff) > 0.05 {
			trafficOK = false
		}
		fmt.Fprintf(out, "%4d  %14d  %14.0f  %+6.2f%%  %14d  %6d\n", r, sum.Sent[r], sum.Expected, 100*diff, sum.Received[r], sum.Copies[r])
	}
	fmt.Fprintln(out, "(bytes and CPU copies per all-reduce, from each rank's rpc.Stats)")
	if sum.Exact {
		fmt.Fprintf(out, "result exact: every element on every rank in all %d all-reduces equals the integer sum\n", cfg.Iters+1)
	}
	fmt.Fprintf(out, "time %s per all-reduce (mean of %d, slowest rank); algbw %.3f GB/s, busbw %.3f GB/s\n",
		units.Duration(sum.Time), cfg.Iters, sum.AlgBW/1e9, sum.BusBW/1e9)
	switch {
	case !sum.Exact:
		return sum, errors.New("the all-reduce result is wrong")
	case !trafficOK:
		return sum, errors.New("a rank's traffic differs from 2(p−1)/p·n by more than 5%")
	}
	return sum, nil
}
