// Command verbsperf measures a verbs provider like perftest's ib_write_bw
// and ib_write_lat, beside the ceiling of the provider's medium measured in
// the same run: a raw TCP socket for tcp, a single-threaded memcpy for shm.
//
//	go run ./cmd/verbsperf -provider tcp -test write_bw -size 1MiB
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
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
)

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
	var cfg config
	var sizes string
	flag.StringVar(&cfg.provider, "provider", "tcp", "provider: "+strings.Join(providerNames(), ", "))
	flag.StringVar(&cfg.test, "test", "write_bw", "test: write_bw, read_bw, write_lat or send_lat")
	flag.StringVar(&sizes, "size", "", "message sizes, comma-separated, e.g. 64,4KiB,1MiB (default 1MiB for bandwidth, 64 for latency)")
	flag.IntVar(&cfg.iters, "iters", 0, "iterations per size (default: 4 GiB worth for bandwidth, capped at 100000; 10000 for latency)")
	flag.IntVar(&cfg.depth, "depth", 16, "requests in flight for bandwidth tests")
	flag.DurationVar(&cfg.duration, "duration", 10*time.Second, "upper bound on each measurement")
	flag.BoolVar(&cfg.server, "server", false, "serve one client's tests on -port")
	flag.StringVar(&cfg.client, "client", "", "run the tests against the server at `ADDR` (host or host:port)")
	flag.IntVar(&cfg.port, "port", 18515, "bootstrap port of client/server mode")
	flag.BoolVar(&cfg.noCeiling, "no-ceiling", false, "skip the ceiling measurement")
	flag.IntVar(&cfg.rounds, "rounds", 3, "measure each size this many times, alternating with the ceiling, and report the medians")
	flag.DurationVar(&cfg.timeout, "timeout", 30*time.Second, "bound on connection setup and on waiting for the peer")
	flag.Parse()
	if err := run(cfg, sizes); err != nil {
		fmt.Fprintln(os.Stderr, "verbsperf:", err)
		os.Exit(1)
	}
}

func providerNames() []string {
	var names []string
	for n := range providers {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func run(cfg config, sizes string) error {
	if cfg.server {
		return serve(cfg.port, cfg.timeout)
	}
	spec, ok := providers[cfg.provider]
	if !ok {
		return fmt.Errorf("unknown provider %q; known: %s", cfg.provider, strings.Join(providerNames(), ", "))
	}
	t, ok := tests[cfg.test]
	if !ok {
		return fmt.Errorf("unknown test %q; known: write_bw, read_bw, write_lat, send_lat", cfg.test)
	}
	if sizes == "" {
		sizes = "1MiB"
		if t.latency {
			sizes = "64"
		}
	}
	var err error
	if cfg.sizes, err = parseSizes(sizes); err != nil {
		return err
	}
	if cfg.depth < 1 {
		return fmt.Errorf("-depth %d must be at least 1", cfg.depth)
	}
	if cfg.duration <= 0 {
		return fmt.Errorf("-duration %v must be positive", cfg.duration)
	}

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
	fmt.Printf("verbsperf: provider %s, test %s, %s", cfg.provider, cfg.test, mode)
	if !t.latency {
		fmt.Printf(", depth %d", cfg.depth)
	}
	fmt.Println()

	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	ceilName := spec.ceiling.String()
	if t.latency {
		fmt.Fprintf(w, "size\titerations\tp50 µs\tp99 µs\tceiling p50 µs\tceiling p99 µs\tp50 / ceiling\t\n")
	} else {
		fmt.Fprintf(w, "size\titerations\tGB/s\tceiling GB/s\tratio\t\n")
	}
	for _, size := range cfg.sizes {
		p := params{Test: cfg.test, Size: size, Iters: cfg.iters, Depth: cfg.depth, Duration: cfg.duration}
		if p.Iters <= 0 {
			p.Iters = defaultIters(t.latency, size)
		}
		var results, ceilings []result
		for range max(cfg.rounds, 1) {
			var res, ceil result
			if cl != nil {
				res, ceil, err = cl.session(p, cfg.noCeiling, cfg.timeout)
			} else {
				res, ceil, err = loopback(spec, p, cfg.noCeiling, cfg.timeout)
			}
			if err != nil {
				w.Flush()
				return fmt.Errorf("%s at %s: %w", cfg.test, formatSize(size), err)
			}
			results, ceilings = append(results, res), append(ceilings, ceil)
		}
		res, ceil := median(results, t.latency), median(ceilings, t.latency)
		if t.latency {
			p50, p99 := percentile(res.lat, 50), percentile(res.lat, 99)
			c50, c99, ratio := "-", "-", "-"
			if len(ceil.lat) > 0 {
				q50 := percentile(ceil.lat, 50)
				c50, c99 = micros(q50), micros(percentile(ceil.lat, 99))
				ratio = fmt.Sprintf("%.2f", float64(p50)/float64(q50))
			}
			fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t\n", formatSize(size), res.iters, micros(p50), micros(p99), c50, c99, ratio)
		} else {
			bw := gbps(res)
			cbw, ratio := "-", "-"
			if ceil.elapsed > 0 {
				cbw = formatGBps(gbps(ceil))
				ratio = fmt.Sprintf("%.2f", bw/gbps(ceil))
			}
			fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t\n", formatSize(size), res.iters, formatGBps(bw), cbw, ratio)
		}
	}
	w.Flush()
	if cfg.rounds > 1 {
		fmt.Printf("medians of %d rounds, each measuring the provider and then the ceiling\n", cfg.rounds)
	}
	if !cfg.noCeiling {
		fmt.Printf("ceiling: %s, measured in this run", ceilName)
		if t.latency {
			fmt.Print("; latencies are half the round trip, as perftest reports them")
		}
		fmt.Println()
	}
	return nil
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
	case !latency:
		ceil, err = memcpyBandwidth(p.Size, res.iters, p.Duration)
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
			return float64(percentile(r.lat, 50))
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

func percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)]
}

func micros(d time.Duration) string {
	return fmt.Sprintf("%.1f", float64(d)/float64(time.Microsecond))
}
