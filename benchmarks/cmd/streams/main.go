// Command streams measures how evenly concurrent streams on one session
// progress: -streams goroutines Fetch a published tensor of -size bytes
// from one client, free-running, for -duration, with server and client in
// this process. It prints, per plane, the throughput, the slowest
// stream's Fetches against the fastest's over the whole run and within
// each -window (p10 and p50 over the windows), and the longest Fetch of
// the median stream and of the worst. A step that waits for every stream
// (an all-reduce, tensorbench's reps) goes at the pace of the slowest
// within its window, not at the average. -busy N runs N goroutines that
// compute without yielding meanwhile: what CPU-bound work on every P
// costs the calls.
//
//	go run ./benchmarks/cmd/streams -planes shm,tcp -streams 16 -size 1048576
//	TENSORRPC_LANES=1 go run ./benchmarks/cmd/streams -planes shm
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime/trace"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "streams:", err)
		os.Exit(1)
	}
}

// result is one plane's measurement (one JSON line with -json).
type result struct {
	Plane          string  `json:"plane"`
	LanesEnv       string  `json:"lanes_env,omitempty"` // TENSORRPC_LANES, when set
	Busy           int     `json:"busy,omitempty"`      // goroutines computing beside the streams
	Streams        int     `json:"streams"`
	Bytes          int     `json:"bytes"`
	Seconds        float64 `json:"seconds"`
	GBps           float64 `json:"gb_per_s"`
	SlowestFastest float64 `json:"slowest_over_fastest"`
	WindowMs       float64 `json:"window_ms"`
	WindowP10      float64 `json:"window_slowest_over_fastest_p10"`
	WindowP50      float64 `json:"window_slowest_over_fastest_p50"`
	P50us          float64 `json:"p50_fetch_us"`
	P99us          float64 `json:"p99_fetch_us"`
	MaxFetchMedMs  float64 `json:"longest_fetch_median_stream_ms"`
	MaxFetchMs     float64 `json:"longest_fetch_ms"`
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("streams", flag.ContinueOnError)
	planes := fs.String("planes", "shm,tcp", "comma-separated data planes")
	size := fs.Int("size", 1<<20, "bytes per Fetch")
	streams := fs.Int("streams", 16, "goroutines fetching at once")
	dur := fs.Duration("duration", 2*time.Second, "how long each plane runs")
	win := fs.Duration("window", 50*time.Millisecond, "window of the per-window slowest/fastest")
	asJSON := fs.Bool("json", false, "print JSON lines instead of a table")
	traceTo := fs.String("trace", "", "write a runtime trace of 300 ms in the middle of the first plane's run to this file")
	busy := fs.Int("busy", 0, "goroutines that compute without yielding while the streams run (what CPU-bound work on every P costs the calls)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *streams < 1 || *size < 1 || *win <= 0 || *dur < *win {
		return fmt.Errorf("need -streams and -size of at least 1 and -duration of at least one -window")
	}
	if !*asJSON {
		fmt.Fprintf(out, "%d streams of %d-byte Fetches on one session, free-running, %v a plane; slowest/fastest: the slowest stream's Fetches over the fastest's\n\n", *streams, *size, *dur)
		fmt.Fprintf(out, "| plane | GB/s | Fetch p50 | p99 | slowest/fastest | per %v window, p10 | p50 | longest Fetch, median stream | worst |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|\n", *win)
	}
	for i, plane := range strings.Split(*planes, ",") {
		tr := ""
		if i == 0 {
			tr = *traceTo
		}
		r, err := measure(ctx, plane, *size, *streams, *busy, *dur, *win, tr)
		if err != nil {
			return fmt.Errorf("%s: %w", plane, err)
		}
		if *asJSON {
			b, _ := json.Marshal(r)
			fmt.Fprintln(out, string(b))
			continue
		}
		fmt.Fprintf(out, "| %s | %.2f | %.1f µs | %.1f µs | %.2f | %.2f | %.2f | %.1f ms | %.1f ms |\n", r.Plane, r.GBps, r.P50us, r.P99us, r.SlowestFastest, r.WindowP10, r.WindowP50, r.MaxFetchMedMs, r.MaxFetchMs)
	}
	return nil
}

func measure(ctx context.Context, plane string, size, streams, busy int, dur, win time.Duration, traceTo string) (result, error) {
	tr := rpc.WithTransports(plane, rpc.TransportGRPC)
	s, err := rpc.NewServer(tr)
	if err != nil {
		return result{}, err
	}
	defer s.Stop()
	t, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
	if err != nil {
		return result{}, err
	}
	err = s.Publish(ctx, "t", t)
	t.Release()
	if err != nil {
		return result{}, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return result{}, err
	}
	go s.Serve(lis)
	c, err := rpc.Dial(ctx, lis.Addr().String(), tr, rpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return result{}, err
	}
	defer c.Close()
	if got := c.Transport(); got != plane {
		return result{}, fmt.Errorf("negotiated %s (%v)", got, c.Rejections())
	}
	stopBusy := spin(busy)
	defer stopBusy()
	counts := make([]atomic.Int64, streams)
	longest := make([]time.Duration, streams)
	took := make([][]time.Duration, streams) // every Fetch's time, by stream
	errs := make(chan error, streams)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				region := trace.StartRegion(ctx, "fetch") // for -trace
				x, err := c.Fetch(ctx, "t")
				region.End()
				if err != nil {
					errs <- err
					return
				}
				x.Release()
				d := time.Since(t0)
				longest[i] = max(longest[i], d)
				took[i] = append(took[i], d)
				counts[i].Add(1)
			}
		}()
	}
	prev := make([]int64, streams)
	var windows []float64
	start := time.Now()
	traced := traceTo == ""
	for time.Since(start) < dur {
		time.Sleep(win)
		if !traced && time.Since(start) >= dur/2 {
			traced = true
			if err := traceFor(traceTo, 300*time.Millisecond); err != nil {
				close(stop)
				wg.Wait()
				return result{}, err
			}
			for i := range counts {
				prev[i] = counts[i].Load() // the traced window is not counted
			}
			continue
		}
		lo, hi := int64(1<<62), int64(0)
		for i := range counts {
			v := counts[i].Load()
			lo, hi = min(lo, v-prev[i]), max(hi, v-prev[i])
			prev[i] = v
		}
		if hi > 0 {
			windows = append(windows, float64(lo)/float64(hi))
		}
	}
	close(stop)
	wg.Wait()
	elapsed := time.Since(start)
	select {
	case err := <-errs:
		return result{}, err
	default:
	}
	var total, lo, hi int64 = 0, 1 << 62, 0
	for i := range counts {
		v := counts[i].Load()
		total += v
		lo, hi = min(lo, v), max(hi, v)
	}
	r := result{Plane: plane, LanesEnv: os.Getenv("TENSORRPC_LANES"), Busy: busy, Streams: streams, Bytes: size, Seconds: elapsed.Seconds(),
		GBps: float64(total) * float64(size) / elapsed.Seconds() / 1e9, WindowMs: float64(win) / 1e6}
	if hi > 0 {
		r.SlowestFastest = float64(lo) / float64(hi)
	}
	if len(windows) > 0 {
		slices.Sort(windows)
		r.WindowP10, r.WindowP50 = windows[len(windows)/10], windows[len(windows)/2]
	}
	var all []time.Duration
	for _, t := range took {
		all = append(all, t...)
	}
	if len(all) > 0 {
		slices.Sort(all)
		r.P50us, r.P99us = float64(all[len(all)/2])/1e3, float64(all[len(all)*99/100])/1e3
	}
	slices.Sort(longest)
	r.MaxFetchMedMs, r.MaxFetchMs = float64(longest[streams/2])/1e6, float64(longest[streams-1])/1e6
	return r, nil
}

// spin starts n goroutines that compute without blocking or yielding
// (only Go's asynchronous preemption takes their P), until the returned
// function is called.
func spin(n int) (stop func()) {
	var done atomic.Bool
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := uint64(1)
			for !done.Load() {
				for range 1 << 12 {
					x = x*6364136223846793005 + 1442695040888963407
				}
			}
			sink.Add(x)
		}()
	}
	return func() {
		done.Store(true)
		wg.Wait()
	}
}

// sink keeps spin's arithmetic from being optimised away.
var sink atomic.Uint64

// traceFor writes a runtime trace of d to path.
func traceFor(path string, d time.Duration) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := trace.Start(f); err != nil {
		f.Close()
		return err
	}
	time.Sleep(d)
	trace.Stop()
	return f.Close()
}
