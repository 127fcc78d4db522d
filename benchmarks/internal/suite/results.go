package suite

import (
	"fmt"
	"time"
)

// Measurement is one case moving one payload size at one concurrency: a
// line of -format json.
type Measurement struct {
	Kind      string `json:"kind"` // "transfer"
	Case      string `json:"case"`
	CaseKind  string `json:"case_kind"`
	Transport string `json:"transport"`
	Payload   string `json:"payload"`
	Bytes     int64  `json:"bytes"` // per transfer (each way, for a call)
	// BothWays is true for a call case: a transfer sends Bytes and
	// receives Bytes back, and GB/s count both (2 × Bytes per transfer).
	BothWays    bool  `json:"both_ways,omitempty"`
	Concurrency int   `json:"concurrency"`
	Reps        int   `json:"reps"`
	Ops         int64 `json:"ops"` // transfers timed, over every rep and stream
	// Seconds is the wall time of the timed reps.
	Seconds float64 `json:"seconds"`
	// GBps is the median over reps of bytes moved by all streams per
	// second, in GB/s (1e9 bytes); Min and Max are the extreme reps.
	GBps    float64 `json:"gb_per_s"`
	GBpsMin float64 `json:"gb_per_s_min"`
	GBpsMax float64 `json:"gb_per_s_max"`
	// P50us and P99us are latency percentiles of one transfer, in
	// microseconds, over every timed transfer.
	P50us float64 `json:"p50_us"`
	P99us float64 `json:"p99_us"`
	// Ceiling is the case that bounds this one. It ran the same transfers
	// in reps alternating with this case's: CeilingGBps is its median, and
	// OfCeiling the median over reps of this case's GB/s over the
	// ceiling's in the neighbouring rep.
	Ceiling     string  `json:"ceiling,omitempty"`
	CeilingGBps float64 `json:"ceiling_gb_per_s,omitempty"`
	OfCeiling   float64 `json:"of_ceiling,omitempty"`
	// Baseline is the case that does the same work without tensorrpc
	// (plain gRPC). It too ran alongside, in alternating reps:
	// BaselineGBps is its median, BaselineP50us its latency, and
	// OfBaseline the median over reps of this case's GB/s over the
	// baseline's in the neighbouring rep.
	Baseline      string  `json:"baseline,omitempty"`
	BaselineGBps  float64 `json:"baseline_gb_per_s,omitempty"`
	BaselineP50us float64 `json:"baseline_p50_us,omitempty"`
	OfBaseline    float64 `json:"of_baseline,omitempty"`
	// Verified counts the transfers of this measurement (and of its
	// partners alongside) whose bytes were checked against the source's,
	// outside the timed region; absent when nothing was checked.
	Verified int64 `json:"verified,omitempty"`
}

// Rate is the small-message rate of a call case at one number of callers
// sharing one client, against its baseline with as many callers sharing
// one connection, measured in alternating reps: a line of -format json.
type Rate struct {
	Kind      string `json:"kind"` // "rate"
	Case      string `json:"case"`
	Transport string `json:"transport"`
	Payload   string `json:"payload"`
	Bytes     int64  `json:"bytes"` // of the request, and of the reply
	Callers   int    `json:"callers"`
	Reps      int    `json:"reps"`
	Ops       int64  `json:"ops"` // calls timed, over every rep and caller
	// CallsPerS is the median over reps of calls per second, all callers;
	// Min and Max are the extreme reps.
	CallsPerS    float64 `json:"calls_per_s"`
	CallsPerSMin float64 `json:"calls_per_s_min"`
	CallsPerSMax float64 `json:"calls_per_s_max"`
	P50us        float64 `json:"p50_us"`
	P99us        float64 `json:"p99_us"`
	// Baseline is the case measured alongside (plain gRPC unary), with
	// its median calls per second and p50; Ratio is the median over reps
	// of this case's calls per second over the baseline's in the
	// neighbouring rep.
	Baseline          string  `json:"baseline"`
	BaselineTransport string  `json:"baseline_transport"`
	BaselineCallsPerS float64 `json:"baseline_calls_per_s"`
	BaselineP50us     float64 `json:"baseline_p50_us"`
	Ratio             float64 `json:"ratio"`
	Verified          int64   `json:"verified,omitempty"`
}

// RowsResult is a rows case at one number of streams: Fetches of Rows
// scattered rows of a table of OfRows rows of RowBytes, against one Fetch
// per row and one Fetch of the same rows back to back, on the same data
// plane in alternating reps: a line of -format json.
type RowsResult struct {
	Kind      string `json:"kind"` // "rows"
	Case      string `json:"case"`
	Transport string `json:"transport"`
	Payload   string `json:"payload"`
	Rows      int    `json:"rows"`    // per Fetch, distinct, in random order
	OfRows    int    `json:"of_rows"` // rows of the published table
	RowBytes  int64  `json:"row_bytes"`
	Bytes     int64  `json:"bytes"` // per Fetch: Rows × RowBytes
	// Concurrency is the number of streams, each with its own
	// destination, sharing one client.
	Concurrency int     `json:"concurrency"`
	Reps        int     `json:"reps"`
	Ops         int64   `json:"ops"` // Fetches timed, over every rep and stream
	Seconds     float64 `json:"seconds"`
	// GBps is the median over reps of bytes fetched per second, all
	// streams; Min and Max the extreme reps; RowsPerS the median in rows.
	GBps     float64 `json:"gb_per_s"`
	GBpsMin  float64 `json:"gb_per_s_min"`
	GBpsMax  float64 `json:"gb_per_s_max"`
	RowsPerS float64 `json:"rows_per_s"`
	// P50us and P99us are latency percentiles of one Fetch of the rows.
	P50us float64 `json:"p50_us"`
	P99us float64 `json:"p99_us"`
	// PerRow is one Fetch per row (Rows Fetches of one-row tensors, a
	// transfer being all of them): its median GB/s, the p50 of a
	// transfer, and OfPerRow, the median over reps of this case's GB/s
	// over its in the neighbouring rep.
	PerRowGBps  float64 `json:"per_row_gb_per_s"`
	PerRowP50us float64 `json:"per_row_p50_us"`
	OfPerRow    float64 `json:"of_per_row"`
	// Contiguous is one Fetch of the same rows back to back, likewise.
	ContiguousGBps  float64 `json:"contiguous_gb_per_s"`
	ContiguousP50us float64 `json:"contiguous_p50_us"`
	OfContiguous    float64 `json:"of_contiguous"`
	// Verified counts the transfers, of this case and its partners,
	// whose rows were checked against the source's.
	Verified int64 `json:"verified,omitempty"`
}

// Skip records a measurement that was not made, and why.
type Skip struct {
	Kind        string `json:"kind"` // "skip"
	Case        string `json:"case"`
	Payload     string `json:"payload,omitempty"`
	Bytes       int64  `json:"bytes,omitempty"`
	Concurrency int    `json:"concurrency,omitempty"`
	Reason      string `json:"reason"`
}

// Note is something the reader of the results must know, such as a data
// plane that is unavailable or did not do what its case asked.
type Note struct {
	Kind string `json:"kind"` // "note"
	Note string `json:"note"`
}

// Summary ends a run.
type Summary struct {
	Kind         string     `json:"kind"` // "summary"
	Seconds      float64    `json:"seconds"`
	Measurements int        `json:"measurements"`
	Skipped      int        `json:"skipped"`
	LoadAfter    [3]float64 `json:"load_after"`
	PeakRSSMiB   float64    `json:"peak_rss_mib"`
}

// Report is everything a run measured.
type Report struct {
	Machine   Machine
	Command   string
	Config    Config
	Cases     []Case
	Transfers []Measurement
	Rates     []Rate
	Rows      []RowsResult
	Skips     []Skip
	Serdes    []SerdesResult
	Codecs    []CodecResult
	Notes     []string
	Summary   Summary
}

// newMeasurement summarizes t, measured with c's partners in the order
// partnersOf gives them.
func newMeasurement(c Case, transport string, p Payload, size, conc int, t timing) Measurement {
	m := Measurement{
		Kind: "transfer", Case: c.Name, CaseKind: c.Kind, Transport: transport, Payload: p.Name,
		Bytes: int64(size), BothWays: c.Call, Concurrency: conc, Reps: t.reps, Ops: t.ops, Seconds: t.seconds,
		Ceiling: c.Ceiling, Baseline: c.Baseline, Verified: t.verified,
	}
	rates := append([]float64(nil), t.repRates...)
	m.GBps = median(rates) / 1e9
	m.GBpsMin, m.GBpsMax = rates[0]/1e9, rates[len(rates)-1]/1e9 // median sorted them
	m.P50us = usOf(percentile(t.latencies, 0.50))
	m.P99us = usOf(percentile(t.latencies, 0.99))
	pairs := t.pairs
	if c.Ceiling != "" && len(pairs) > 0 && len(pairs[0].ratios) > 0 {
		m.CeilingGBps = median(append([]float64(nil), pairs[0].rates...)) / 1e9
		m.OfCeiling = median(append([]float64(nil), pairs[0].ratios...))
	}
	if c.Ceiling != "" && len(pairs) > 0 {
		pairs = pairs[1:]
	}
	if c.Baseline != "" && len(pairs) > 0 && len(pairs[0].ratios) > 0 {
		m.BaselineGBps = median(append([]float64(nil), pairs[0].rates...)) / 1e9
		m.BaselineP50us = usOf(percentile(pairs[0].latencies, 0.50))
		m.OfBaseline = median(append([]float64(nil), pairs[0].ratios...))
	}
	return m
}

// newRate summarizes t, a call case measured with its baseline alone, as
// calls per second.
func newRate(c Case, transport, baselineTransport string, p Payload, size, callers int, t timing) Rate {
	perCall := 2 * float64(size) // what a rep's bytes per second count
	rates := append([]float64(nil), t.repRates...)
	r := Rate{
		Kind: "rate", Case: c.Name, Transport: transport, Payload: p.Name, Bytes: int64(size), Callers: callers,
		Reps: t.reps, Ops: t.ops, Baseline: c.Baseline, BaselineTransport: baselineTransport, Verified: t.verified,
	}
	r.CallsPerS = median(rates) / perCall
	r.CallsPerSMin, r.CallsPerSMax = rates[0]/perCall, rates[len(rates)-1]/perCall
	r.P50us = usOf(percentile(t.latencies, 0.50))
	r.P99us = usOf(percentile(t.latencies, 0.99))
	if len(t.pairs) > 0 && len(t.pairs[0].ratios) > 0 {
		r.BaselineCallsPerS = median(append([]float64(nil), t.pairs[0].rates...)) / perCall
		r.BaselineP50us = usOf(percentile(t.pairs[0].latencies, 0.50))
		r.Ratio = median(append([]float64(nil), t.pairs[0].ratios...))
	}
	return r
}

// newRowsResult summarizes t, a rows case measured with its partners one
// Fetch per row and contiguous, in that order.
func newRowsResult(c Case, transport string, p Payload, rows, of, rowBytes, conc int, t timing) RowsResult {
	rates := append([]float64(nil), t.repRates...)
	r := RowsResult{
		Kind: "rows", Case: c.Name, Transport: transport, Payload: p.Name, Rows: rows, OfRows: of,
		RowBytes: int64(rowBytes), Bytes: int64(rows) * int64(rowBytes), Concurrency: conc,
		Reps: t.reps, Ops: t.ops, Seconds: t.seconds, Verified: t.verified,
	}
	r.GBps = median(rates) / 1e9
	r.GBpsMin, r.GBpsMax = rates[0]/1e9, rates[len(rates)-1]/1e9 // median sorted them
	r.RowsPerS = r.GBps * 1e9 / float64(rowBytes)
	r.P50us = usOf(percentile(t.latencies, 0.50))
	r.P99us = usOf(percentile(t.latencies, 0.99))
	partner := func(i int) (gbps, p50, of float64) {
		if i >= len(t.pairs) || len(t.pairs[i].ratios) == 0 {
			return 0, 0, 0
		}
		pr := t.pairs[i]
		return median(append([]float64(nil), pr.rates...)) / 1e9, usOf(percentile(pr.latencies, 0.50)), median(append([]float64(nil), pr.ratios...))
	}
	r.PerRowGBps, r.PerRowP50us, r.OfPerRow = partner(0)
	r.ContiguousGBps, r.ContiguousP50us, r.OfContiguous = partner(1)
	return r
}

// spread is half the range of the reps over the median, in percent.
func (r *RowsResult) spread() float64 {
	if r.GBps == 0 {
		return 0
	}
	return 100 * (r.GBpsMax - r.GBpsMin) / 2 / r.GBps
}

func usOf(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// find returns the measurement of case name at size and conc, preferring
// payload, or nil.
func (r *Report) find(name, payload string, size int64, conc int) *Measurement {
	var any *Measurement
	for i := range r.Transfers {
		m := &r.Transfers[i]
		if m.Case == name && m.Bytes == size && m.Concurrency == conc {
			if m.Payload == payload {
				return m
			}
			any = m
		}
	}
	return any
}

// spread is half the range of the reps over the median, in percent.
func (m *Measurement) spread() float64 {
	if m.GBps == 0 {
		return 0
	}
	return 100 * (m.GBpsMax - m.GBpsMin) / 2 / m.GBps
}

// spread is half the range of the reps over the median, in percent.
func (r *Rate) spread() float64 {
	if r.CallsPerS == 0 {
		return 0
	}
	return 100 * (r.CallsPerSMax - r.CallsPerSMin) / 2 / r.CallsPerS
}

func fmtNs(ns float64) string {
	switch {
	case ns >= 1e9:
		return fmt.Sprintf("%.2f s", ns/1e9)
	case ns >= 1e6:
		return fmt.Sprintf("%.2f ms", ns/1e6)
	case ns >= 1e3:
		return fmt.Sprintf("%.2f µs", ns/1e3)
	}
	return fmt.Sprintf("%.0f ns", ns)
}

func fmtUs(us float64) string { return fmtNs(us * 1e3) }

// fmtRate prints GB/s with three significant digits.
func fmtRate(gbps float64) string {
	switch {
	case gbps >= 100:
		return fmt.Sprintf("%.0f", gbps)
	case gbps >= 10:
		return fmt.Sprintf("%.1f", gbps)
	case gbps >= 1:
		return fmt.Sprintf("%.2f", gbps)
	case gbps >= 0.1:
		return fmt.Sprintf("%.3f", gbps)
	}
	return fmt.Sprintf("%.2g", gbps)
}
