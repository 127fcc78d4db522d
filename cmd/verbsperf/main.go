// Command verbsperf measures a verbs provider like perftest's ib_write_bw
// and ib_write_lat, beside the ceiling of the provider's medium measured in
// the same run: a raw TCP socket for tcp, a single-threaded memcpy for shm.
//
//	go run ./cmd/verbsperf -provider tcp -test write_bw -size 1MiB
//	go run ./cmd/verbsperf -provider shm -test write_bw -a   # 2 B to 8 MiB, like perftest -a
//	go run ./cmd/verbsperf -provider tcp -test send_lat -size 64
//	go run ./cmd/verbsperf -server -port 18515            # on one host
//	go run ./cmd/verbsperf -client HOST -port 18515 -test read_bw -size 4KiB,1MiB
//
// Without -server or -client both ends run in this process (loopback). In
// client/server mode the two processes exchange connection info and buffer
// descriptors over a bootstrap TCP connection on -port, which afterwards
// carries the raw-socket ceiling. Tests: write_bw and read_bw keep -depth
// requests in flight; write_lat (WriteImm ping-pong) and send_lat (Send
// ping-pong) report half the round trip, as perftest does. Every run stops
// after -iters iterations or -duration, whichever comes first.
//
// Columns follow perftest: for bandwidth #bytes, #iterations, BW peak,
// BW average (GB/s = 1e9 bytes per second) and MsgRate (Mpps), then the
// ceiling; for latency #bytes, #iterations, t_min, t_max, t_typical (the
// median), t_avg, t_stdev, 99% and 99.9% percentiles in µs, then the
// ceiling. The header says what the ceiling is.
//
// The ibv provider is in binaries built with -tags rdma (Linux, cgo,
// libibverbs-dev).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
)

// usage is what -h prints before the flags.
const usage = `Usage: verbsperf [flags]

Measures a verbs provider like perftest's ib_write_bw and ib_write_lat,
beside the ceiling of its medium in the same run (a raw TCP socket for
tcp, a single-threaded memcpy for shm).

Examples:
  verbsperf -provider tcp -test write_bw -size 1MiB
  verbsperf -provider shm -test write_bw -a     # 2 B to 8 MiB, like perftest -a
  verbsperf -provider tcp -test send_lat -size 64
  verbsperf -server -port 18515                 # on one host
  verbsperf -client HOST -port 18515 -test read_bw -size 4KiB,1MiB

Without -server or -client both ends run in this process. Columns, as
perftest's: bandwidth tests print #bytes, #iterations, BW peak and BW
average (GB/s, 1e9 bytes per second), MsgRate (Mpps), then the ceiling;
latency tests print #bytes, #iterations, t_min, t_max, t_typical (the
median), t_avg, t_stdev and the 99% and 99.9% percentiles in µs, then the
ceiling (half the round trip, as perftest reports).

Flags:
`

type config struct {
	provider  string
	test      string
	sizes     []int
	iters     int
	depth     int
	duration  time.Duration
	server    bool
	client    string
	port      int
	noCeiling bool
	timeout   time.Duration
	rounds    int
}

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return // -h asked for the usage, which went to stderr: not a failure
		}
		fmt.Fprintln(os.Stderr, "verbsperf:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command line into a config with its sizes resolved.
func parseFlags(args []string, stderr io.Writer) (config, error) {
	var cfg config
	var sizes, maxSweep string
	var sweep bool
	fs := flag.NewFlagSet("verbsperf", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.provider, "provider", "tcp", "provider: "+strings.Join(providerNames(), ", ")+" (ibv with -tags rdma)")
	fs.StringVar(&cfg.test, "test", "write_bw", "test: write_bw, read_bw, write_lat or send_lat")
	fs.StringVar(&sizes, "size", "", "message sizes, comma-separated, e.g. 64,4KiB,1MiB (default 1MiB for bandwidth, 64 for latency)")
	fs.BoolVar(&sweep, "a", false, "sweep every power of two from 2 bytes to -max-size, like perftest's -a")
	fs.StringVar(&maxSweep, "max-size", "8MiB", "largest size of the -a sweep (perftest's: 2^23 = 8 MiB)")
	fs.IntVar(&cfg.iters, "iters", 0, "iterations per size (default: 4 GiB worth for bandwidth, capped at 100000; 10000 for latency)")
	fs.IntVar(&cfg.depth, "depth", 16, "requests in flight for bandwidth tests")
	fs.DurationVar(&cfg.duration, "duration", 10*time.Second, "upper bound on each measurement")
	fs.BoolVar(&cfg.server, "server", false, "serve one client's tests on -port")
	fs.StringVar(&cfg.client, "client", "", "run the tests against the server at `ADDR` (host or host:port)")
	fs.IntVar(&cfg.port, "port", 18515, "bootstrap port of client/server mode")
	fs.BoolVar(&cfg.noCeiling, "no-ceiling", false, "skip the ceiling measurement")
	fs.IntVar(&cfg.rounds, "rounds", 3, "measure each size this many times, alternating with the ceiling, and report the medians")
	fs.DurationVar(&cfg.timeout, "timeout", 30*time.Second, "bound on connection setup and on waiting for the peer")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if cfg.server {
		return cfg, nil
	}
	t, ok := tests[cfg.test]
	if !ok {
		return cfg, fmt.Errorf("unknown test %q; known: write_bw, read_bw, write_lat, send_lat", cfg.test)
	}
	setMax := false
	fs.Visit(func(f *flag.Flag) { setMax = setMax || f.Name == "max-size" })
	var err error
	switch {
	case sweep && sizes != "":
		return cfg, errors.New("-a sweeps the sizes: it cannot go with -size")
	case sweep:
		top, err := parseSizes(maxSweep)
		if err != nil || len(top) != 1 || top[0] < 2 {
			return cfg, fmt.Errorf("-max-size %q: want one size of at least 2 bytes", maxSweep)
		}
		cfg.sizes = sweepSizes(top[0])
	case setMax:
		return cfg, errors.New("-max-size bounds the -a sweep: give -a too")
	default:
		if sizes == "" {
			sizes = "1MiB"
			if t.latency {
				sizes = "64"
			}
		}
		if cfg.sizes, err = parseSizes(sizes); err != nil {
			return cfg, fmt.Errorf("-size: %w", err)
		}
	}
	if cfg.depth < 1 {
		return cfg, fmt.Errorf("-depth %d must be at least 1", cfg.depth)
	}
	if cfg.duration <= 0 {
		return cfg, fmt.Errorf("-duration %v must be positive", cfg.duration)
	}
	return cfg, nil
}

// sweepSizes are the powers of two from 2 up to top, as perftest -a runs
// them, and top itself when it is not one.
func sweepSizes(top int) []int {
	var s []int
	for n := 2; n <= top; n *= 2 {
		s = append(s, n)
	}
	if s[len(s)-1] != top {
		s = append(s, top)
	}
	return s
}

func providerNames() []string {
	var names []string
	for n := range providers {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func run(args []string, stdout, stderr io.Writer) error {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if cfg.server {
		return serve(cfg.port, cfg.timeout)
	}
	spec, err := lookupProvider(cfg.provider)
	if err != nil {
		return err
	}
	return measureAll(cfg, spec, stdout)
}

// measureAll measures every size and prints the table.
func measureAll(cfg config, spec providerSpec, stdout io.Writer) error {
	t := tests[cfg.test]
	noCeil := cfg.noCeiling || spec.ceiling == noCeiling || (t.latency && spec.ceiling == memcpyCeiling)
	var cl *client
	mode := "loopback, both ends in this process"
	if cfg.client != "" {
		c, err := dialServer(cfg.client, cfg.port, cfg.timeout)
		if err != nil {
			return err
		}
		defer c.Close()
		cl = &client{c: c, spec: spec, name: cfg.provider}
		mode = "client of " + c.RemoteAddr().String()
	}
	fmt.Fprintf(stdout, "verbsperf: provider %s, test %s, %s", cfg.provider, cfg.test, mode)
	if !t.latency {
		fmt.Fprintf(stdout, ", depth %d", cfg.depth)
	}
	fmt.Fprintln(stdout)
	fmt.Fprintf(stdout, "ceiling: %s\n", describeCeiling(spec, t.latency, cfg))
	if t.latency {
		fmt.Fprintln(stdout, "latencies: half the round trip, in µs, as perftest reports them; t_typical is the median")
	} else {
		fmt.Fprintln(stdout, "GB/s: 1e9 bytes per second; BW peak: the best rate over any stretch of at least max(depth, iterations/16) completions; MsgRate: millions of messages per second")
	}
	if cfg.rounds > 1 {
		fmt.Fprintf(stdout, "each size: %d rounds, each measuring the provider and then its ceiling; medians shown (peak: the best of the rounds)\n", cfg.rounds)
	}

	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	if t.latency {
		fmt.Fprintf(w, "#bytes\t#iterations\tt_min[usec]\tt_max[usec]\tt_typical[usec]\tt_avg[usec]\tt_stdev[usec]\t99%% percentile[usec]\t99.9%% percentile[usec]\tceiling t_typical[usec]\tceiling 99%%[usec]\tt_typical/ceiling\t\n")
	} else {
		fmt.Fprintf(w, "#bytes\t#iterations\tBW peak[GB/s]\tBW average[GB/s]\tMsgRate[Mpps]\tceiling BW[GB/s]\tBW/ceiling\t\n")
	}
	parallel, socketAbove := false, false
	for _, size := range cfg.sizes {
		p := params{Test: cfg.test, Size: size, Iters: cfg.iters, Depth: cfg.depth, Duration: cfg.duration}
		if p.Iters <= 0 {
			p.Iters = defaultIters(t.latency, size)
		}
		var results, ceilings []result
		peak := 0.0
		for range max(cfg.rounds, 1) {
			var res, ceil result
			var err error
			if cl != nil {
				res, ceil, err = cl.session(p, noCeil, cfg.timeout)
			} else {
				res, ceil, err = loopback(spec, p, noCeil, cfg.timeout)
			}
			if err != nil {
				w.Flush()
				return fmt.Errorf("%s at %s: %w", cfg.test, formatSize(size), err)
			}
			results, ceilings = append(results, res), append(ceilings, ceil)
			peak = max(peak, peakGBps(res, size, cfg.depth))
		}
		res, ceil := median(results, t.latency), median(ceilings, t.latency)
		if t.latency {
			st := latencyStats(res.lat)
			c50, c99, ratio := "-", "-", "-"
			if len(ceil.lat) > 0 {
				q50 := percentile(ceil.lat, 0.5)
				c50, c99 = micros(q50), micros(percentile(ceil.lat, 0.99))
				ratio = fmt.Sprintf("%.2f", float64(st.typical)/float64(q50))
			}
			fmt.Fprintf(w, "%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", size, res.iters,
				micros(st.min), micros(st.max), micros(st.typical), micros(st.avg), micros(st.stdev), micros(st.p99), micros(st.p999),
				c50, c99, ratio)
			continue
		}
		bw := gbps(res)
		cbw, ratio := "-", "-"
		if ceil.elapsed > 0 {
			c := gbps(ceil)
			mark := ""
			// One thread's memcpy is no bound on a provider whose copies
			// overlap on several cores: compare with as many threads.
			if bw > c && spec.ceiling == memcpyCeiling && runtime.GOMAXPROCS(0) > 1 {
				pc, err := memcpyBandwidth(spec.newMemory, size, res.iters, runtime.GOMAXPROCS(0), cfg.duration)
				if err != nil {
					w.Flush()
					return fmt.Errorf("%s at %s: %w", cfg.test, formatSize(size), err)
				}
				c, mark, parallel = max(c, gbps(pc)), "†", true
			}
			cbw = formatGBps(c) + mark
			ratio = fmt.Sprintf("%.2f", bw/c)
			if bw > c && spec.ceiling == socketCeiling {
				ratio += "*"
				socketAbove = true
			}
		}
		mpps := 0.0
		if res.elapsed > 0 {
			mpps = float64(res.iters) / res.elapsed.Seconds() / 1e6
		}
		fmt.Fprintf(w, "%d\t%d\t%s\t%s\t%.3f\t%s\t%s\t\n", size, res.iters, formatGBps(max(peak, bw)), formatGBps(bw), mpps, cbw, ratio)
	}
	w.Flush()
	if socketAbove {
		fmt.Fprintf(stdout, "*: above 1: the socket ceiling is one blocking writer, while the provider keeps %d requests queued; for short runs and small messages on a loaded machine that can win, within the noise of the rounds: read such a ratio as about 1\n", cfg.depth)
	}
	if parallel {
		fmt.Fprintf(stdout, "†: the provider beat one thread's memcpy (its copies overlap on several cores); the ceiling shown is the faster of that and %d threads copying slices of the same buffers at once\n", runtime.GOMAXPROCS(0))
	}
	return nil
}

// describeCeiling says what the ceiling column measures, for the header.
func describeCeiling(spec providerSpec, latency bool, cfg config) string {
	switch {
	case cfg.noCeiling:
		return "not measured (-no-ceiling)"
	case spec.ceiling == noCeiling:
		return "none measured: a TCP socket does not bound RDMA; compare with the NIC's line rate (perftest on the same ports)"
	case spec.ceiling == memcpyCeiling && latency:
		return "none for latency: a same-host copy has no round trip to compare with"
	case spec.ceiling == memcpyCeiling:
		llc := "unknown"
		if n := lastLevelCache(); n > 0 {
			llc = bytesize.Format(n)
		}
		return fmt.Sprintf("single-thread memcpy of the same size between two buffers of the provider's kind of memory, reused every iteration as its registered buffers are: "+
			"in cache while 2 × size fits the last-level cache (%s) for both; measured in this run after each round; a multi-thread memcpy where the provider beats it (†)", llc)
	case latency:
		return "a raw TCP socket between the same two ends, ping-pong of the same size (half round trip), measured in this run after each round"
	}
	return "a raw TCP socket between the same two ends, one writer of whole messages and one reader, the same bytes, measured in this run after each round"
}

// lastLevelCache is the size of CPU 0's last-level cache from sysfs, or 0.
func lastLevelCache() int64 {
	var best int64
	for i := range 8 {
		b, err := os.ReadFile(fmt.Sprintf("/sys/devices/system/cpu/cpu0/cache/index%d/size", i))
		if err != nil {
			break
		}
		if n, err := bytesize.Parse(strings.TrimSpace(string(b))); err == nil {
			best = max(best, n)
		}
	}
	return best
}

// peakGBps is the best rate over any stretch of at least max(depth,
// iters/16) completions of a bandwidth result, in GB/s; the average when
// the run is shorter than that.
func peakGBps(r result, size, depth int) float64 {
	window := max(depth, r.iters/16)
	best := 0.0
	i := 0
	for j := range r.marks {
		for i+1 < j && r.marks[j].done-r.marks[i+1].done >= window {
			i++
		}
		d, dt := r.marks[j].done-r.marks[i].done, r.marks[j].at-r.marks[i].at
		if d >= window && dt > 0 {
			best = max(best, float64(d)*float64(size)/dt.Seconds()/1e9)
		}
	}
	return max(best, gbps(r))
}

// latStats are perftest's latency columns.
type latStats struct {
	min, max, typical, avg, stdev, p99, p999 time.Duration
}

func latencyStats(d []time.Duration) latStats {
	if len(d) == 0 {
		return latStats{}
	}
	var sum float64
	for _, x := range d {
		sum += float64(x)
	}
	mean := sum / float64(len(d))
	var sq float64
	for _, x := range d {
		sq += (float64(x) - mean) * (float64(x) - mean)
	}
	return latStats{
		min: slices.Min(d), max: slices.Max(d), typical: percentile(d, 0.5),
		avg: time.Duration(mean), stdev: time.Duration(math.Sqrt(sq / float64(len(d)))),
		p99: percentile(d, 0.99), p999: percentile(d, 0.999),
	}
}

func micros(d time.Duration) string {
	return fmt.Sprintf("%.2f", float64(d)/float64(time.Microsecond))
}

// loopback runs one measurement with both ends in this process, then its
// ceiling.
func loopback(spec providerSpec, p params, noCeiling bool, timeout time.Duration) (res, ceil result, err error) {
	a, err := newEndpoint(spec, "127.0.0.1", p.Size, p.Depth)
	if err != nil {
		return res, ceil, fmt.Errorf("end a: %w", err)
	}
	defer a.close()
	b, err := newEndpoint(spec, "127.0.0.1", p.Size, p.Depth)
	if err != nil {
		return res, ceil, fmt.Errorf("end b: %w", err)
	}
	defer b.close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	err = connectBoth(ctx, a, b)
	cancel()
	if err != nil {
		return res, ceil, fmt.Errorf("connecting: %w", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), p.Duration+timeout)
	defer cancel()
	pctx, pcancel := context.WithCancel(ctx)
	passive := make(chan error, 1)
	go func() { passive <- runPassive(pctx, b, a.desc(), p) }()
	res, err = runActive(ctx, a, b.desc(), p)
	pcancel()
	if perr := <-passive; err == nil && perr != nil {
		err = fmt.Errorf("passive end: %w", perr)
	}
	if err != nil || noCeiling {
		return res, ceil, err
	}
	a.close()
	b.close()
	latency := tests[p.Test].latency
	switch {
	case spec.ceiling == socketCeiling:
		ceil, err = localSocketCeiling(latency, p.Size, res.iters, p.Duration)
	case spec.ceiling == memcpyCeiling && !latency:
		ceil, err = memcpyBandwidth(spec.newMemory, p.Size, res.iters, 1, p.Duration)
	}
	return res, ceil, err
}

func defaultIters(latency bool, size int) int {
	if latency {
		return 10000
	}
	return int(min(100000, max(100, (4<<30)/int64(max(size, 1)))))
}

// maxSize bounds a message: one registered buffer of each end holds it.
const maxSize = 1 << 40

// parseSizes parses a comma-separated list of sizes with internal/bytesize
// (64, 64B, 4K, 4KiB, 1M, 1MiB, 1G, 1GiB: powers of 1024); each must be
// positive and at most 1 TiB.
func parseSizes(s string) ([]int, error) {
	out, err := bytesize.ParseInts(s)
	if err != nil {
		return nil, err
	}
	for _, n := range out {
		if n < 1 || n > maxSize {
			return nil, fmt.Errorf("bad size %s: want a positive size of at most 1 TiB", bytesize.Format(int64(n)))
		}
	}
	return out, nil
}

func formatSize(n int) string { return bytesize.Format(int64(n)) }

// formatGBps keeps three significant digits for small bandwidths.
func formatGBps(v float64) string {
	if v < 1 {
		return fmt.Sprintf("%.3g", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func gbps(r result) float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.bytes) / r.elapsed.Seconds() / 1e9
}

// median returns the round with the median bandwidth, or for latency the
// median p50.
func median(rs []result, latency bool) result {
	key := func(r result) float64 {
		if latency {
			return float64(percentile(r.lat, 0.5))
		}
		return gbps(r)
	}
	s := slices.Clone(rs)
	slices.SortFunc(s, func(a, b result) int {
		ka, kb := key(a), key(b)
		switch {
		case ka < kb:
			return -1
		case ka > kb:
			return 1
		}
		return 0
	})
	return s[len(s)/2]
}

// percentile returns the q-quantile (0 ≤ q < 1) of d, as perftest takes
// it: the sample at index ⌊n·q⌋ of the sorted samples.
func percentile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*q))]
}
