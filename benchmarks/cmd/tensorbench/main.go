// Command tensorbench measures tensorrpc against what people would use
// instead — gRPC with protobuf bytes (default and tuned), gRPC with
// FlatBuffers, gRPC with zstd, s2, snappy or gzip compression — and against
// the ceilings of the machine (memcpy, a raw TCP socket, a unix socket), all
// in one run on the same payloads; tensorrpc Calls (a tensor in, a tensor
// of the same size out) against plain gRPC unary calls, the rate of
// 4 KiB calls, and Fetches of 256 scattered rows of 64 KiB out of a
// published table of 4096 (rpc.Rows) against one Fetch per row and one
// contiguous Fetch of the same bytes; then a ser/des micro-suite and a
// compression table with the link speed above which compressing loses.
//
// Usage:
//
//	go run ./benchmarks/cmd/tensorbench -quick            # < 60 s smoke run
//	go run ./benchmarks/cmd/tensorbench -plots DIR        # full run, 4 KiB to 1 GiB
//	go run ./benchmarks/cmd/tensorbench -format json      # one JSON object per line
//	go run ./benchmarks/cmd/tensorbench -render run.jsonl -plots DIR  # tables and plots of a recorded run
//
// Tables (Markdown) or JSON lines go to stdout, progress to stderr.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/suite"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/rpc"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "tensorbench:", err)
		}
		os.Exit(2)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("tensorbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := suite.DefaultConfig()
	var (
		quick        = fs.Bool("quick", false, "smoke run: small sizes, few reps, a subset of the cases (at least one of each kind); under 60 s")
		format       = fs.String("format", "text", "stdout format: text (Markdown tables) or json (one object per line)")
		jsonFile     = fs.String("jsonl", "", "also write the JSON lines to this file")
		plotDir      = fs.String("plots", "", "write the plots (throughput against size, log-log), PNG and SVG, into this directory")
		render       = fs.String("render", "", "measure nothing: print the tables of the JSON lines in `FILE` (from -jsonl or -format json), and draw its plots with -plots")
		sizes        = fs.String("sizes", "", "transfer sizes, e.g. 4KiB,1MiB,1GiB (default: 4 KiB ×4 up to -max-size; quick: 4KiB,64KiB,1MiB,8MiB)")
		maxSize      = fs.String("max-size", "1GiB", "largest transfer size when -sizes is not given (full run)")
		conc         = fs.String("concurrency", "", "concurrent streams, e.g. 1,4 (default 1,4,16,64 on 8 cores or more, else 1,4; quick 1,4)")
		cases        = fs.String("cases", "", "comma-separated case names or kinds (ceiling, grpc, grpc-compressed, tensorrpc); default all (quick: the quick subset). Calls: trpc-tcp-call, trpc-shm-call, trpc-grpc-call, grpc-proto-call; the message rate: call-rate; scattered rows: trpc-tcp-rows, trpc-shm-rows, trpc-grpc-rows")
		rateCallers  = fs.String("rate-callers", "1,16", "concurrent callers of the message-rate case (call-rate), whatever -concurrency says")
		rows         = fs.Int("rows", def.Rows, "rows per Fetch of the rows cases (trpc-*-rows), distinct and scattered, whatever -sizes says")
		rowsOf       = fs.Int("rows-of", def.RowsOf, "rows of the table the rows cases fetch from")
		rowBytes     = fs.String("row-bytes", strings.ReplaceAll(bytesize.Format(int64(def.RowBytes)), " ", ""), "bytes of a row of the rows cases")
		payloads     = fs.String("payloads", "", "comma-separated payloads (gauss-f32, lowent-f16, sparse-f32, random); default all")
		allPayloads  = fs.Bool("all-payloads", false, "run content-blind cases on every payload too (their speed does not depend on it)")
		reps         = fs.Int("reps", 0, "reps per measurement when within -budget (default 5; quick 3)")
		minReps      = fs.Int("min-reps", 0, "reps per measurement even over -budget (default 3)")
		repTime      = fs.Duration("rep-time", 0, "shortest rep: small transfers repeat to fill it (default 50ms; quick 15ms)")
		budget       = fs.Duration("budget", 0, "time the reps of one measurement should take (default 1.5s; quick 250ms)")
		maxInflight  = fs.String("max-inflight", "1GiB", "skip concurrency × size above this, to bound memory")
		maxCompress  = fs.Duration("max-compress-time", 0, "skip compressed-gRPC measurements predicted to take longer (default 15s; quick 2s)")
		compressConc = fs.String("compress-conc-max-size", "4MiB", "largest size at which compressed cases run with more than one stream")
		slowCodec    = fs.String("slow-codec-max-size", "256MiB", "largest size at which compressed cases other than s2 (the fastest codec) run")
		codecSize    = fs.String("codec-size", "", "bytes per payload in the compression table (default 32MiB; quick 1MiB)")
		serdesSizes  = fs.String("serdes-sizes", "", "tensor sizes of the ser/des micro-suite (default 4KiB,1MiB,64MiB; quick 4KiB,1MiB)")
		verify       = fs.String("verify", "", "which transfers have their bytes checked (CRC32C against the source's, outside the timed region): all, last (each stream's last transfer of every round: every transfer of large sizes) or off (default last; quick all)")
		sections     = fs.String("sections", "transfers,serdes,codecs", "what to run: transfers, serdes, codecs, slowlink (tcp Fetch over a veth pair into a network namespace shaped with tbf to -slow-link-rates, each payload, compression off, auto and s2; and auto against off on unshaped loopback, tcp and shm; the shaped links need root and iproute2)")
		slowRates    = fs.String("slow-link-rates", "1gbit,10gbit", "tc rates of the slowlink section's links")
		slowSize     = fs.String("slow-link-size", "64MiB", "bytes of each Fetch of the slowlink section")
		slowServe    = fs.String("slow-link-serve", "", "internal: serve the slowlink section's server on `ADDR` (run inside its namespace)")
		cpuProfile   = fs.String("cpuprofile", "", "write a CPU profile of the run to this file")
		mutexProfile = fs.String("mutexprofile", "", "write a profile of contended mutexes (every contention sampled) to this file")
		blockProfile = fs.String("blockprofile", "", "write a profile of where goroutines blocked (every event sampled) to this file")
		memLimit     = fs.String("mem-limit", "8GiB", "Go soft memory limit (runtime/debug.SetMemoryLimit); the run is sized to stay under ~12 GiB")
	)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: tensorbench [flags]\n\nMeasures tensorrpc against gRPC (protobuf, FlatBuffers, compressed) and the machine's ceilings.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}

	if *render != "" {
		return renderFile(*render, *format, *plotDir, stdout, stderr, fs)
	}
	if *slowServe != "" {
		return slowLinkServe(*slowServe)
	}

	cfg := suite.DefaultConfig()
	if *quick {
		cfg = suite.QuickConfig()
	}
	cfg.Command = "tensorbench " + strings.Join(args, " ")
	var err error
	switch *format {
	case "text":
	case "json":
		cfg.JSON = true
	default:
		return fmt.Errorf("-format %q: want text or json", *format)
	}
	cfg.PlotDir = *plotDir
	if *sizes != "" {
		if cfg.Sizes, err = parseSizes(*sizes); err != nil {
			return fmt.Errorf("-sizes: %w", err)
		}
	} else if !*quick {
		top, err := parseSize(*maxSize)
		if err != nil {
			return fmt.Errorf("-max-size: %w", err)
		}
		cfg.Sizes = cfg.Sizes[:0]
		for _, n := range suite.DefaultConfig().Sizes {
			if n < top {
				cfg.Sizes = append(cfg.Sizes, n)
			}
		}
		cfg.Sizes = append(cfg.Sizes, top)
	}
	if *conc != "" {
		if cfg.Concurrency, err = parseInts(*conc); err != nil {
			return fmt.Errorf("-concurrency: %w", err)
		}
	}
	if cfg.RateCallers, err = parseInts(*rateCallers); err != nil {
		return fmt.Errorf("-rate-callers: %w", err)
	}
	cfg.Rows, cfg.RowsOf = *rows, *rowsOf
	if cfg.RowBytes, err = parseSize(*rowBytes); err != nil {
		return fmt.Errorf("-row-bytes: %w", err)
	}
	if cfg.Rows < 1 || cfg.Rows > cfg.RowsOf {
		return fmt.Errorf("-rows %d: want 1 to -rows-of (%d), the rows of a Fetch being distinct", cfg.Rows, cfg.RowsOf)
	}
	if *cases != "" {
		if cfg.Cases, err = suite.SelectCases(*cases, *quick); err != nil {
			return fmt.Errorf("-cases: %w", err)
		}
	}
	if *payloads != "" {
		cfg.Payloads = nil
		for _, name := range strings.Split(*payloads, ",") {
			p, err := suite.PayloadByName(strings.TrimSpace(name))
			if err != nil {
				return fmt.Errorf("-payloads: %w", err)
			}
			cfg.Payloads = append(cfg.Payloads, p)
		}
	}
	cfg.AllPayloads = *allPayloads
	setInt(&cfg.Reps, *reps)
	setInt(&cfg.MinReps, *minReps)
	cfg.MinReps = min(cfg.MinReps, cfg.Reps)
	setDuration(&cfg.RepTime, *repTime)
	setDuration(&cfg.Budget, *budget)
	setDuration(&cfg.MaxCompressTime, *maxCompress)
	if n, err := parseSize(*maxInflight); err != nil {
		return fmt.Errorf("-max-inflight: %w", err)
	} else {
		cfg.MaxInflight = int64(n)
	}
	if cfg.CompressConcMaxSize, err = parseSize(*compressConc); err != nil {
		return fmt.Errorf("-compress-conc-max-size: %w", err)
	}
	if cfg.SlowCodecMaxSize, err = parseSize(*slowCodec); err != nil {
		return fmt.Errorf("-slow-codec-max-size: %w", err)
	}
	if *codecSize != "" {
		if cfg.CodecSize, err = parseSize(*codecSize); err != nil {
			return fmt.Errorf("-codec-size: %w", err)
		}
	}
	if *serdesSizes != "" {
		if cfg.SerdesSizes, err = parseSizes(*serdesSizes); err != nil {
			return fmt.Errorf("-serdes-sizes: %w", err)
		}
	}
	switch *verify {
	case "":
	case suite.VerifyAll, suite.VerifyLast, suite.VerifyOff:
		cfg.Verify = *verify
	default:
		return fmt.Errorf("-verify %q: want all, last or off", *verify)
	}
	cfg.Transfers, cfg.Serdes, cfg.Codecs = false, false, false
	slowLink := false
	for _, s := range strings.Split(*sections, ",") {
		switch strings.TrimSpace(s) {
		case "transfers":
			cfg.Transfers = true
		case "serdes":
			cfg.Serdes = true
		case "codecs":
			cfg.Codecs = true
		case "slowlink":
			slowLink = true
		default:
			return fmt.Errorf("-sections: unknown section %q (transfers, serdes, codecs, slowlink)", s)
		}
	}
	var slowCfg slowLinkConfig
	if slowLink {
		slowCfg = slowLinkConfig{reps: 3, payloads: cfg.Payloads, modes: []string{rpc.CompressionOff, rpc.CompressionAuto, rpc.CompressionS2}}
		if *quick {
			slowCfg.reps = 1
		}
		if *reps > 0 {
			slowCfg.reps = *reps
		}
		for _, r := range strings.Split(*slowRates, ",") {
			if _, err := parseRate(strings.TrimSpace(r)); err != nil {
				return fmt.Errorf("-slow-link-rates: %w", err)
			}
			slowCfg.rates = append(slowCfg.rates, strings.TrimSpace(r))
		}
		if slowCfg.size, err = parseSize(*slowSize); err != nil {
			return fmt.Errorf("-slow-link-size: %w", err)
		}
	}
	limit, err := parseSize(*memLimit)
	if err != nil {
		return fmt.Errorf("-mem-limit: %w", err)
	}
	if len(cfg.Sizes) == 0 || len(cfg.Concurrency) == 0 || len(cfg.Payloads) == 0 {
		return errors.New("nothing to measure: sizes, concurrency and payloads must not be empty")
	}
	for _, n := range cfg.Concurrency {
		if n < 1 {
			return fmt.Errorf("-concurrency: %d streams", n)
		}
	}
	for _, n := range cfg.RateCallers {
		if n < 1 {
			return fmt.Errorf("-rate-callers: %d callers", n)
		}
	}
	for _, n := range cfg.Sizes {
		if n < 4 || n%4 != 0 {
			return fmt.Errorf("-sizes: %d is not a positive multiple of 4 bytes", n)
		}
	}
	old := debug.SetMemoryLimit(int64(limit))
	defer debug.SetMemoryLimit(old)

	var jsonl io.Writer
	if *jsonFile != "" {
		f, err := os.Create(*jsonFile)
		if err != nil {
			return err
		}
		defer f.Close()
		jsonl = f
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	for _, p := range []struct {
		file, name string
		start      func()
	}{
		{*mutexProfile, "mutex", func() { runtime.SetMutexProfileFraction(1) }},
		{*blockProfile, "block", func() { runtime.SetBlockProfileRate(1) }},
	} {
		if p.file == "" {
			continue
		}
		f, err := os.Create(p.file)
		if err != nil {
			return err
		}
		defer f.Close()
		p.start()
		defer pprof.Lookup(p.name).WriteTo(f, 0)
	}
	start := time.Now()
	if cfg.Transfers || cfg.Serdes || cfg.Codecs {
		if _, err := suite.Run(ctx, cfg, stdout, jsonl, stderr); err != nil {
			return err
		}
	}
	if slowLink {
		if err := runSlowLink(ctx, slowCfg, stdout, jsonl, stderr); err != nil {
			return err
		}
	}
	fmt.Fprintf(stderr, "tensorbench: finished in %s\n", time.Since(start).Round(time.Second))
	return nil
}

// renderFile prints the tables of a recorded run and draws its plots. Flags
// that say what to measure make no sense with it and are refused.
func renderFile(file, format, plotDir string, stdout, stderr io.Writer, fs *flag.FlagSet) error {
	var bad []string
	fs.Visit(func(f *flag.Flag) {
		if f.Name != "render" && f.Name != "plots" && f.Name != "format" {
			bad = append(bad, "-"+f.Name)
		}
	})
	if len(bad) > 0 {
		return fmt.Errorf("-render measures nothing: %s cannot go with it (only -plots and -format text)", strings.Join(bad, ", "))
	}
	if format != "text" {
		return fmt.Errorf("-render prints tables: -format %q is not text", format)
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	rep, err := suite.ReadReport(f)
	if err != nil {
		return fmt.Errorf("-render %s: %w", file, err)
	}
	files, err := suite.Render(rep, stdout, plotDir)
	if err != nil {
		return fmt.Errorf("plots: %w", err)
	}
	if len(files) > 0 {
		fmt.Fprintf(stderr, "tensorbench: plots in %s: %s\n", plotDir, strings.Join(files, ", "))
	}
	return nil
}

func setInt(dst *int, v int) {
	if v > 0 {
		*dst = v
	}
}

func setDuration(dst *time.Duration, v time.Duration) {
	if v > 0 {
		*dst = v
	}
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// parseSizes reads a comma-separated list of sizes (internal/bytesize:
// binary units); every size must be positive.
func parseSizes(s string) ([]int, error) { return bytesize.ParsePositiveInts(s) }

// parseSize reads one positive size: "4096", "4KiB", "64 MiB", "1G"
// (internal/bytesize: binary units throughout).
func parseSize(s string) (int, error) {
	l, err := parseSizes(s)
	if err != nil {
		return 0, err
	}
	if len(l) != 1 {
		return 0, fmt.Errorf("bad size %q: want one size", s)
	}
	return l[0], nil
}
