// Package suite is tensorbench's engine: it measures tensorrpc against the
// transports people would use instead (gRPC with protobuf, FlatBuffers or
// compression) and against the ceilings of the machine (memcpy, sockets),
// all in one run on the same payloads, plus a ser/des micro-suite and a
// compression table.
package suite

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/encoding"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/compressors"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
)

// Config says what a run measures.
type Config struct {
	Quick       bool
	Sizes       []int
	Concurrency []int
	Cases       []Case
	Payloads    []Payload
	// AllPayloads runs content-blind cases on every payload, not only the
	// first.
	AllPayloads bool

	// Reps is the number of reps a measurement wants; fewer (but at least
	// MinReps) when they would take longer than Budget. A rep lasts at
	// least RepTime.
	Reps, MinReps   int
	RepTime, Budget time.Duration
	// WarmMaxSize is the largest size that gets warm-up transfers before
	// its reps; larger ones are too slow to warm and start cold.
	WarmMaxSize int
	// MaxInflight bounds concurrency × size: larger combinations are
	// skipped, to bound memory.
	MaxInflight int64
	// MaxCompressTime skips a compressed-gRPC measurement predicted to
	// take longer (from the same case at the previous size, or from the
	// compression table).
	MaxCompressTime time.Duration
	// CompressConcMaxSize is the largest size at which compressed cases
	// run with more than one stream: above it, on a machine with few
	// cores, more compressing streams only queue for the CPU, and the
	// measurements would take most of the run.
	CompressConcMaxSize int
	// SlowCodecMaxSize is the largest size compressed cases run at, except
	// the fastest codec's (s2): above it a transfer takes 10–30 s per
	// codec and payload, and their rates are flat from 64 MiB on.
	SlowCodecMaxSize int
	// RateSize is the size of the request and of the reply of the rate
	// case, and RateCallers the numbers of concurrent callers it runs
	// with, whatever Sizes and Concurrency say.
	RateSize    int
	RateCallers []int
	// RowsOf, Rows and RowBytes are the geometry of the rows cases: a
	// published table of RowsOf rows of RowBytes, of which each Fetch
	// asks for Rows, distinct and scattered. They run at each of
	// Concurrency, whatever Sizes say.
	RowsOf, Rows, RowBytes int
	// OpTimeout bounds one round of transfers, against hangs.
	OpTimeout time.Duration
	// Verify says which transfers have their bytes checked against the
	// source, outside the timed region: VerifyLast, VerifyAll or
	// VerifyOff. A mismatch ends the run with an error.
	Verify string

	Transfers, Serdes, Codecs bool
	CodecSize, CodecReps      int
	SerdesSizes               []int
	SerdesTime                time.Duration

	// JSON prints JSON lines on Out instead of tables.
	JSON bool
	// PlotDir, when set, receives the plots, as PNG and SVG.
	PlotDir string
	// Command is the command line, printed with the results.
	Command string
}

// DefaultConfig is a full run: 4 KiB to 1 GiB, with DefaultConcurrency
// streams.
func DefaultConfig() Config {
	cases, _ := SelectCases("", false)
	return Config{
		Sizes:               sizesBetween(4<<10, 1<<30),
		Concurrency:         DefaultConcurrency(runtime.NumCPU()),
		Cases:               cases,
		Payloads:            Payloads,
		Reps:                5,
		MinReps:             3,
		RepTime:             50 * time.Millisecond,
		Budget:              1500 * time.Millisecond,
		WarmMaxSize:         256 << 20,
		MaxInflight:         1 << 30,
		MaxCompressTime:     15 * time.Second,
		CompressConcMaxSize: 4 << 20,
		SlowCodecMaxSize:    256 << 20,
		RateSize:            4 << 10,
		RateCallers:         []int{1, 16},
		RowsOf:              4096,
		Rows:                256,
		RowBytes:            64 << 10,
		OpTimeout:           10 * time.Minute,
		Verify:              VerifyLast,
		Transfers:           true,
		Serdes:              true,
		Codecs:              true,
		CodecSize:           32 << 20,
		CodecReps:           3,
		SerdesSizes:         []int{4 << 10, 1 << 20, 64 << 20},
		SerdesTime:          50 * time.Millisecond,
	}
}

// QuickConfig is the -quick run: small sizes, few reps, the quick cases.
func QuickConfig() Config {
	c := DefaultConfig()
	c.Quick = true
	c.Cases, _ = SelectCases("", true)
	c.Sizes = []int{4 << 10, 64 << 10, 1 << 20, 8 << 20}
	c.Concurrency = []int{1, 4}
	c.Reps, c.MinReps = 3, 3
	c.RepTime = 15 * time.Millisecond
	c.Budget = 250 * time.Millisecond
	c.MaxCompressTime = 2 * time.Second
	c.CodecSize = 1 << 20
	c.CodecReps = 3
	c.SerdesSizes = []int{4 << 10, 1 << 20}
	c.SerdesTime = 10 * time.Millisecond
	c.Verify = VerifyAll
	return c
}

// DefaultConcurrency is the default numbers of concurrent streams on a
// machine of cpus cores: 1, 4, 16 and 64 from 8 cores on; below that 1
// and 4, since more streams than cores only queue for them.
func DefaultConcurrency(cpus int) []int {
	if cpus >= 8 {
		return []int{1, 4, 16, 64}
	}
	return []int{1, 4}
}

// sizesBetween returns lo, 4·lo, 16·lo, ... up to hi, and hi.
func sizesBetween(lo, hi int) []int {
	var s []int
	for n := lo; n < hi; n *= 4 {
		s = append(s, n)
	}
	return append(s, hi)
}

// fastestCodec is the compressor measured at every size.
const fastestCodec = compressors.S2

// runner holds the state of one run.
type runner struct {
	cfg      Config
	out      io.Writer // tables or JSON lines
	jsonl    io.Writer // JSON lines, or nil
	progress io.Writer
	start    time.Time
	report   *Report
	src      *payloadSource
}

// Run measures what cfg asks for. It writes tables (or JSON lines, with
// cfg.JSON) to out, JSON lines also to jsonl when it is not nil, and
// progress to progress.
func Run(ctx context.Context, cfg Config, out, jsonl, progress io.Writer) (*Report, error) {
	r := &runner{cfg: cfg, out: out, jsonl: jsonl, progress: progress, start: time.Now()}
	r.report = &Report{Machine: describeMachine(), Command: cfg.Command, Config: cfg, Cases: cfg.Cases}
	r.report.Machine.Command = cfg.Command
	m := r.report.Machine
	r.logf("machine: %s, %d cores (GOMAXPROCS %d), %.1f GiB, %s, %s, load %.2f %.2f %.2f",
		m.CPUModel, m.Cores, m.GOMAXPROCS, m.MemoryGiB, m.Kernel, m.GoVersion, m.LoadBefore[0], m.LoadBefore[1], m.LoadBefore[2])
	r.emit(m)
	compressors.Register()

	largest := slices.Max(append(append(slices.Clone(cfg.Sizes), cfg.SerdesSizes...), cfg.CodecSize, cfg.RateSize))
	if slices.ContainsFunc(cfg.Cases, func(c Case) bool { return c.Rows }) {
		largest = max(largest, cfg.Rows*cfg.RowBytes) // the rows fetched do not repeat
	}
	r.src = newPayloadSource(cfg.Payloads, largest)

	if cfg.Codecs {
		res, err := runCodecs(r.src, cfg.Payloads, r.selectedCompressors(), cfg.CodecSize, cfg.CodecReps, r.logln)
		if err != nil {
			return nil, fmt.Errorf("compression table: %w", err)
		}
		for _, c := range res {
			r.emit(c)
		}
		r.report.Codecs = res
	}
	if cfg.Serdes && len(cfg.Payloads) > 0 {
		res, err := runSerdes(r.src, cfg.Payloads[0], cfg.SerdesSizes, cfg.SerdesTime, 3, r.logln)
		if err != nil {
			return nil, fmt.Errorf("ser/des: %w", err)
		}
		for _, s := range res {
			r.emit(s)
		}
		r.report.Serdes = res
	}
	if cfg.Transfers {
		if err := r.runTransfers(ctx); err != nil {
			return nil, err
		}
	}

	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	r.report.Machine.LoadAfter = loadAverage()
	r.report.Summary = Summary{
		Kind: "summary", Seconds: time.Since(r.start).Seconds(),
		Measurements: len(r.report.Transfers) + len(r.report.Rates) + len(r.report.Rows), Skipped: len(r.report.Skips),
		LoadAfter: r.report.Machine.LoadAfter, PeakRSSMiB: float64(ru.Maxrss) / 1024,
	}
	r.emit(r.report.Summary)
	r.logf("done in %.0f s, load %.2f %.2f %.2f, peak RSS %.0f MiB", r.report.Summary.Seconds,
		r.report.Machine.LoadAfter[0], r.report.Machine.LoadAfter[1], r.report.Machine.LoadAfter[2], r.report.Summary.PeakRSSMiB)

	if !cfg.JSON {
		writeText(out, r.report)
	}
	if cfg.PlotDir != "" && len(r.report.Transfers) > 0 {
		files, err := writePlots(cfg.PlotDir, r.report)
		if err != nil {
			return nil, fmt.Errorf("plots: %w", err)
		}
		r.logf("plots: %v", files)
	}
	return r.report, nil
}

// selectedCompressors are the compressors of the selected compressed cases,
// or all of them when none is selected (the table still describes them).
func (r *runner) selectedCompressors() []encoding.Compressor {
	var sel []encoding.Compressor
	for _, c := range r.cfg.Cases {
		if c.Compressor != "" {
			sel = append(sel, compressors.Get(c.Compressor))
		}
	}
	if len(sel) == 0 {
		return compressors.All()
	}
	return sel
}

func (r *runner) emit(v any) {
	if !r.cfg.JSON && r.jsonl == nil {
		return
	}
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // our own types always marshal
	}
	b = append(b, '\n')
	if r.cfg.JSON {
		r.out.Write(b)
	}
	if r.jsonl != nil {
		r.jsonl.Write(b)
	}
}

func (r *runner) logf(format string, args ...any) {
	fmt.Fprintf(r.progress, "[%6.1fs] %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func (r *runner) logln(s string) { r.logf("%s", s) }

// note records something the reader of the results must know, once.
func (r *runner) note(text string) {
	if slices.Contains(r.report.Notes, text) {
		return
	}
	r.report.Notes = append(r.report.Notes, text)
	r.emit(Note{Kind: "note", Note: text})
	r.logf("note: %s", text)
}

func (r *runner) skip(s Skip) {
	s.Kind = "skip"
	r.report.Skips = append(r.report.Skips, s)
	r.emit(s)
	where := s.Case
	if s.Bytes > 0 {
		where = fmt.Sprintf("%s %s %s c=%d", s.Case, bytesize.Format(s.Bytes), s.Payload, s.Concurrency)
	}
	r.logf("skip %s: %s", where, s.Reason)
}

// runTransfers measures every selected case, size by size, so that cases
// compared with each other ran minutes apart at most.
func (r *runner) runTransfers(ctx context.Context) error {
	cfg := r.cfg
	cases := slices.Clone(cfg.Cases)
	if i := slices.IndexFunc(cases, func(c Case) bool { return c.Name == "trpc-ibv" }); i >= 0 {
		if ok, reason := probeIBV(ctx); !ok {
			r.note("ibv: unavailable: " + reason)
			r.skip(Skip{Case: "trpc-ibv", Reason: "unavailable: " + reason})
			cases = slices.Delete(cases, i, i+1)
		}
	}
	var rates, rows []Case
	cases = slices.DeleteFunc(cases, func(c Case) bool {
		switch {
		case c.Rate:
			rates = append(rates, c)
		case c.Rows:
			rows = append(rows, c)
		}
		return c.Rate || c.Rows
	})
	if len(cases) > 0 {
		if err := r.runSizes(ctx, cases); err != nil {
			return err
		}
	}
	for _, c := range rates {
		if err := r.runRate(ctx, c); err != nil {
			return err
		}
	}
	for _, c := range rows {
		if err := r.runRows(ctx, c); err != nil {
			return err
		}
	}
	return nil
}

// runSizes measures the transfer cases at every size, payload and
// concurrency.
func (r *runner) runSizes(ctx context.Context, cases []Case) error {
	cfg := r.cfg
	maxConc := slices.Max(cfg.Concurrency)
	buf := make([]byte, slices.Max(cfg.Sizes))
	total := r.countTransfers(cases)
	done := 0
	for _, size := range cfg.Sizes {
		data := buf[:size]
		for pi, p := range cfg.Payloads {
			r.src.fill(p, data)
			for _, c := range cases {
				if !c.Content && pi > 0 && !cfg.AllPayloads {
					continue
				}
				conc := slices.DeleteFunc(slices.Clone(cfg.Concurrency), func(n int) bool {
					if int64(n)*int64(size) > cfg.MaxInflight {
						r.skip(Skip{Case: c.Name, Payload: p.Name, Bytes: int64(size), Concurrency: n,
							Reason: fmt.Sprintf("%d streams × %s is over -max-inflight %s", n, bytesize.Format(int64(size)), bytesize.Format(cfg.MaxInflight))})
						done++
						return true
					}
					if c.Compressor != "" && c.Compressor != fastestCodec && size > cfg.SlowCodecMaxSize {
						r.skip(Skip{Case: c.Name, Payload: p.Name, Bytes: int64(size), Concurrency: n,
							Reason: fmt.Sprintf("above -slow-codec-max-size %s only %s, the fastest codec, compresses", bytesize.Format(int64(cfg.SlowCodecMaxSize)), fastestCodec)})
						done++
						return true
					}
					if c.Compressor != "" && n > 1 && size > cfg.CompressConcMaxSize {
						r.skip(Skip{Case: c.Name, Payload: p.Name, Bytes: int64(size), Concurrency: n,
							Reason: fmt.Sprintf("compressed cases run with more than one stream only up to -compress-conc-max-size %s", bytesize.Format(int64(cfg.CompressConcMaxSize)))})
						done++
						return true
					}
					if why := r.tooSlowToCompress(c, p, size, n); why != "" {
						r.skip(Skip{Case: c.Name, Payload: p.Name, Bytes: int64(size), Concurrency: n, Reason: why})
						done++
						return true
					}
					return false
				})
				if len(conc) == 0 {
					continue
				}
				env := &caseEnv{payload: p, data: data, maxConc: min(maxConc, max(1, int(cfg.MaxInflight/int64(size))))}
				sess, err := c.open(ctx, env)
				if err != nil {
					return fmt.Errorf("%s at %s: open: %w", c.Name, bytesize.Format(int64(size)), err)
				}
				partners, err := openPartners(ctx, c, env)
				if err != nil {
					sess.close()
					return fmt.Errorf("%s at %s: %w", c.Name, bytesize.Format(int64(size)), err)
				}
				for _, n := range conc {
					done++
					t, err := measure(ctx, sess, partners, data, n, r.plan(c, size))
					if err != nil {
						sess.close()
						closePartners(partners)
						return fmt.Errorf("%s at %s, %s, %d streams: %w", c.Name, bytesize.Format(int64(size)), p.Name, n, err)
					}
					m := newMeasurement(c, sess.transport(), p, size, n, t)
					if n, ok := sess.(interface{ note() string }); ok && n.note() != "" {
						r.note(n.note())
					}
					r.report.Transfers = append(r.report.Transfers, m)
					r.emit(m)
					ofCeil := ""
					if m.OfCeiling > 0 {
						ofCeil = fmt.Sprintf(" = %.2f× %s (%s GB/s alongside)", m.OfCeiling, m.Ceiling, fmtRate(m.CeilingGBps))
					}
					if m.OfBaseline > 0 {
						ofCeil += fmt.Sprintf(", %.2f× %s (%s GB/s)", m.OfBaseline, m.Baseline, fmtRate(m.BaselineGBps))
					}
					r.logf("[%d/%d] %-18s %8s %-10s c=%d: %s GB/s ±%.0f%%%s, p50 %s (%d reps, %d transfers checked)",
						done, total, c.Name, bytesize.Format(int64(size)), p.Name, n, fmtRate(m.GBps), m.spread(), ofCeil, fmtUs(m.P50us), m.Reps, m.Verified)
				}
				if err := closePartners(partners); err != nil {
					sess.close()
					return fmt.Errorf("%s at %s: close %w", c.Name, bytesize.Format(int64(size)), err)
				}
				if err := sess.close(); err != nil {
					return fmt.Errorf("%s at %s: close: %w", c.Name, bytesize.Format(int64(size)), err)
				}
				if size >= 64<<20 {
					// Hand the last case's buffers back before the next
					// case maps its own: the run must stay within memory.
					runtime.GC()
					debug.FreeOSMemory()
				}
			}
		}
	}
	return nil
}

// plan is how case c measures at size.
func (r *runner) plan(c Case, size int) plan {
	cfg := r.cfg
	p := plan{warm: size <= cfg.WarmMaxSize, repTime: cfg.RepTime, reps: cfg.Reps, minReps: cfg.MinReps, budget: cfg.Budget,
		opTimeout: cfg.OpTimeout, verify: cfg.Verify}
	if c.Call {
		p.moved = 2 * size
	}
	return p
}

// openPartners opens the sessions measured alongside c: its ceiling, then
// its baseline (the order newMeasurement expects).
func openPartners(ctx context.Context, c Case, env *caseEnv) ([]partner, error) {
	var ps []partner
	for _, x := range []struct{ role, name string }{{"ceiling", c.Ceiling}, {"baseline", c.Baseline}} {
		if x.name == "" {
			continue
		}
		sess, err := caseByName(x.name).open(ctx, env)
		if err != nil {
			closePartners(ps)
			return nil, fmt.Errorf("open its %s %s: %w", x.role, x.name, err)
		}
		ps = append(ps, partner{name: x.role + " " + x.name, sess: sess})
	}
	return ps, nil
}

// closePartners closes every partner and returns the first error, naming
// its partner.
func closePartners(ps []partner) error {
	var first error
	for _, p := range ps {
		if err := p.sess.close(); err != nil && first == nil {
			first = fmt.Errorf("its %s: %w", p.name, err)
		}
	}
	return first
}

// runRate measures the rate case c: Calls of RateSize at each of
// RateCallers concurrent callers sharing one client, against its baseline
// in alternating reps, on the first payload.
func (r *runner) runRate(ctx context.Context, c Case) error {
	cfg := r.cfg
	if len(cfg.Payloads) == 0 || len(cfg.RateCallers) == 0 {
		return nil
	}
	p, size := cfg.Payloads[0], cfg.RateSize
	data := make([]byte, size)
	r.src.fill(p, data)
	env := &caseEnv{payload: p, data: data, maxConc: slices.Max(cfg.RateCallers)}
	where := fmt.Sprintf("%s at %s", c.Name, bytesize.Format(int64(size)))
	sess, err := c.open(ctx, env)
	if err != nil {
		return fmt.Errorf("%s: open: %w", where, err)
	}
	partners, err := openPartners(ctx, Case{Baseline: c.Baseline}, env)
	if err != nil {
		sess.close()
		return fmt.Errorf("%s: %w", where, err)
	}
	baseTransport := ""
	if len(partners) > 0 {
		baseTransport = partners[0].sess.transport()
	}
	for _, n := range cfg.RateCallers {
		t, err := measure(ctx, sess, partners, data, n, r.plan(c, size))
		if err != nil {
			sess.close()
			closePartners(partners)
			return fmt.Errorf("%s, %d callers: %w", where, n, err)
		}
		rt := newRate(c, sess.transport(), baseTransport, p, size, n, t)
		r.report.Rates = append(r.report.Rates, rt)
		r.emit(rt)
		r.logf("[rate] %-18s %8s callers=%d: %.0f calls/s ±%.0f%%, %s %.0f calls/s alongside, ratio %.2f; p50 %s vs %s (%d reps, %d calls checked)",
			c.Name, bytesize.Format(int64(size)), n, rt.CallsPerS, rt.spread(), rt.Baseline, rt.BaselineCallsPerS, rt.Ratio,
			fmtUs(rt.P50us), fmtUs(rt.BaselineP50us), rt.Reps, rt.Verified)
	}
	if err := closePartners(partners); err != nil {
		sess.close()
		return fmt.Errorf("%s: close %w", where, err)
	}
	if err := sess.close(); err != nil {
		return fmt.Errorf("%s: close: %w", where, err)
	}
	return nil
}

// rowsSeed fixes the rows the rows cases fetch.
const rowsSeed = 1

// runRows measures the rows case c at each concurrency: Fetches of
// cfg.Rows scattered rows of a table of cfg.RowsOf, against one Fetch per
// row and one contiguous Fetch on the same plane in alternating reps, on
// the first payload.
func (r *runner) runRows(ctx context.Context, c Case) error {
	cfg := r.cfg
	if len(cfg.Payloads) == 0 {
		return nil
	}
	p := cfg.Payloads[0]
	env := &rowsEnv{plane: c.rowsPlane, of: cfg.RowsOf, rowBytes: cfg.RowBytes, idx: rowsIndices(cfg.RowsOf, cfg.Rows, rowsSeed),
		data: make([]byte, cfg.Rows*cfg.RowBytes), maxConc: slices.Max(cfg.Concurrency)}
	r.src.fill(p, env.data)
	stampRows(env.data, cfg.RowBytes)
	where := fmt.Sprintf("%s, %d rows of %d × %s", c.Name, cfg.Rows, cfg.RowsOf, bytesize.Format(int64(cfg.RowBytes)))
	sess, err := openRows(ctx, env, rowsScattered)
	if err != nil {
		return fmt.Errorf("%s: open: %w", where, err)
	}
	var partners []partner
	for _, m := range []rowsMode{rowsEach, rowsContiguous} {
		ps, err := openRows(ctx, env, m)
		if err != nil {
			closePartners(partners)
			sess.close()
			return fmt.Errorf("%s: open its partner %s: %w", where, m, err)
		}
		partners = append(partners, partner{name: m.String(), sess: ps})
	}
	for _, n := range cfg.Concurrency {
		if int64(n)*int64(len(env.data)) > cfg.MaxInflight {
			r.skip(Skip{Case: c.Name, Payload: p.Name, Bytes: int64(len(env.data)), Concurrency: n,
				Reason: fmt.Sprintf("%d streams × %s is over -max-inflight %s", n, bytesize.Format(int64(len(env.data))), bytesize.Format(cfg.MaxInflight))})
			continue
		}
		t, err := measure(ctx, sess, partners, env.data, n, r.plan(c, len(env.data)))
		if err != nil {
			closePartners(partners)
			sess.close()
			return fmt.Errorf("%s, %d streams: %w", where, n, err)
		}
		res := newRowsResult(c, sess.transport(), p, cfg.Rows, cfg.RowsOf, cfg.RowBytes, n, t)
		r.report.Rows = append(r.report.Rows, res)
		r.emit(res)
		r.logf("[rows] %-18s %d×%s of %d c=%d: %s GB/s ±%.0f%% (%.0f rows/s), %.2f× one Fetch per row (%s GB/s), %.2f× contiguous (%s GB/s); p50 %s vs %s, %s (%d reps, %d transfers checked)",
			c.Name, res.Rows, bytesize.Format(res.RowBytes), res.OfRows, n, fmtRate(res.GBps), res.spread(), res.RowsPerS,
			res.OfPerRow, fmtRate(res.PerRowGBps), res.OfContiguous, fmtRate(res.ContiguousGBps),
			fmtUs(res.P50us), fmtUs(res.PerRowP50us), fmtUs(res.ContiguousP50us), res.Reps, res.Verified)
	}
	if err := closePartners(partners); err != nil {
		sess.close()
		return fmt.Errorf("%s: close %w", where, err)
	}
	if err := sess.close(); err != nil {
		return fmt.Errorf("%s: close: %w", where, err)
	}
	return nil
}

func (r *runner) countTransfers(cases []Case) int {
	n := 0
	for range r.cfg.Sizes {
		for pi := range r.cfg.Payloads {
			for _, c := range cases {
				if c.Content || pi == 0 || r.cfg.AllPayloads {
					n += len(r.cfg.Concurrency)
				}
			}
		}
	}
	return n
}

// tooSlowToCompress predicts how long a compressed-gRPC measurement would
// take and says why it is skipped when that is over MaxCompressTime. The
// prediction scales the same case's throughput at the largest smaller size
// measured; without one, it adds the compression table's compress and
// decompress times to the uncompressed case it is built on
// (grpc-proto-tuned, measured just before at the same size).
func (r *runner) tooSlowToCompress(c Case, p Payload, size, conc int) string {
	if c.Compressor == "" {
		return ""
	}
	rounds := float64(r.cfg.MinReps)
	if size <= r.cfg.WarmMaxSize {
		rounds++
	}
	bytesPerRound := float64(size) * float64(conc)
	var round float64
	var basis string
	var prev *Measurement
	for i := range r.report.Transfers {
		m := &r.report.Transfers[i]
		if m.Case == c.Name && m.Payload == p.Name && m.Concurrency == conc && m.Bytes < int64(size) && m.GBps > 0 &&
			(prev == nil || m.Bytes > prev.Bytes) {
			prev = m
		}
	}
	if prev != nil {
		round = bytesPerRound / (prev.GBps * 1e9)
		basis = fmt.Sprintf("%s GB/s measured at %s", fmtRate(prev.GBps), bytesize.Format(prev.Bytes))
	} else {
		for _, cr := range r.report.Codecs {
			if cr.Codec != c.Compressor || cr.Payload != p.Name {
				continue
			}
			codecSeconds := float64(size) * (1/(cr.CompressMBps*1e6) + 1/(cr.DecompressMBps*1e6))
			round = codecSeconds * float64(conc) / float64(min(conc, runtime.GOMAXPROCS(0)))
			basis = fmt.Sprintf("compress at %.0f MB/s and decompress at %.0f MB/s from the compression table", cr.CompressMBps, cr.DecompressMBps)
			if m := r.report.find("grpc-proto-tuned", p.Name, int64(size), conc); m != nil && m.GBps > 0 {
				round += bytesPerRound / (m.GBps * 1e9)
				basis += " plus grpc-proto-tuned"
			}
		}
	}
	predicted := time.Duration(round * rounds * float64(time.Second))
	if basis != "" && predicted > r.cfg.MaxCompressTime {
		return fmt.Sprintf("predicted %.0f s for %.0f rounds (from %s), over -max-compress-time %s",
			predicted.Seconds(), rounds, basis, r.cfg.MaxCompressTime)
	}
	return ""
}
