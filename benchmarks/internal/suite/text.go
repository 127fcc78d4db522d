package suite

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
)

// writeText prints the report as Markdown tables, readable in a terminal
// and pasteable into RESULTS.md.
func writeText(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	m := r.Machine
	p("# tensorbench results\n\n")
	if r.Command != "" {
		p("Command: `%s`\n\n", r.Command)
	}
	p("| machine | |\n| --- | --- |\n")
	p("| CPU | %s |\n| cores | %d (GOMAXPROCS %d) |\n| memory | %.1f GiB |\n| kernel | %s |\n| Go | %s (%s) |\n",
		orDash(m.CPUModel), m.Cores, m.GOMAXPROCS, m.MemoryGiB, orDash(m.Kernel), m.GoVersion, m.OS)
	p("| load average (1/5/15 min) | %.2f %.2f %.2f at start, %.2f %.2f %.2f at end |\n",
		m.LoadBefore[0], m.LoadBefore[1], m.LoadBefore[2], m.LoadAfter[0], m.LoadAfter[1], m.LoadAfter[2])
	p("| run | %s, %.0f s, %d measurements, %d skipped, peak RSS %.0f MiB |\n\n",
		m.Time.Format("2006-01-02 15:04 UTC"), r.Summary.Seconds, r.Summary.Measurements, r.Summary.Skipped, r.Summary.PeakRSSMiB)
	for _, n := range r.Notes {
		p("- %s\n", n)
	}
	if len(r.Notes) > 0 {
		p("\n")
	}

	if slices.ContainsFunc(r.Transfers, func(m Measurement) bool { return !m.BothWays }) {
		writeTransfers(w, r)
	}
	if slices.ContainsFunc(r.Transfers, func(m Measurement) bool { return m.BothWays }) {
		writeCalls(w, r)
	}
	if len(r.Rates) > 0 {
		writeRates(w, r)
	}
	if len(r.Rows) > 0 {
		writeRows(w, r)
	}
	if len(r.Serdes) > 0 {
		writeSerdes(w, r)
	}
	if len(r.Codecs) > 0 {
		writeCodecs(w, r)
	}
	if len(r.Skips) > 0 {
		writeSkips(w, r.Skips)
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// row is one line of a transfer table: a case on a payload.
type row struct {
	c       Case
	payload string
	label   string
}

// transferRows are the rows of the one-way cases (calls: true, of the call
// cases).
func transferRows(r *Report, calls bool) []row {
	var rows []row
	for _, c := range r.Cases {
		if c.Call != calls || c.Rate || c.Rows {
			continue
		}
		var payloads []string
		for _, p := range r.Config.Payloads {
			if slices.ContainsFunc(r.Transfers, func(m Measurement) bool { return m.Case == c.Name && m.Payload == p.Name }) {
				payloads = append(payloads, p.Name)
			}
		}
		for _, p := range payloads {
			label := c.Name
			if c.Content || len(payloads) > 1 {
				label += " · " + p
			}
			rows = append(rows, row{c: c, payload: p, label: label})
		}
	}
	return rows
}

// sizes are the sizes of the one-way transfers (calls: true, of the calls).
func (r *Report) sizes(calls bool) []int64 {
	var s []int64
	for _, m := range r.Transfers {
		if m.BothWays == calls && !slices.Contains(s, m.Bytes) {
			s = append(s, m.Bytes)
		}
	}
	slices.Sort(s)
	return s
}

func (r *Report) exact(name, payload string, size int64, conc int) *Measurement {
	for i := range r.Transfers {
		m := &r.Transfers[i]
		if m.Case == name && m.Payload == payload && m.Bytes == size && m.Concurrency == conc {
			return m
		}
	}
	return nil
}

func writeTransfers(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	p("## Transfers\n\n")
	p("A server holds the tensor; each stream asks for it and receives all of it, again and again. ")
	p("GB/s is 1e9 bytes per second over all streams (the median of the reps, ± half their range); ")
	p("streams of gRPC and tensorrpc cases share one connection or session, socket streams each have a connection.")
	var checked int64
	for _, m := range r.Transfers {
		checked += m.Verified
	}
	if checked > 0 {
		p(" %d transfers (warm-up, calibration and timed ones, of the cases and of their ceilings alongside) had the bytes that arrived compared with the source's (CRC32C), outside the timed region: none differed.", checked)
	}
	p("\n\n")
	p("Payloads:\n\n")
	for _, pl := range r.Config.Payloads {
		p("- `%s`: %s\n", pl.Name, pl.About)
	}
	p("\nCases (content-blind cases run on `%s` only; compressed ones on every payload):\n\n", r.Config.Payloads[0].Name)
	for _, c := range r.Cases {
		if c.Call {
			continue
		}
		ceil := ""
		if c.Ceiling != "" {
			ceil = "; ceiling: " + c.Ceiling
		}
		p("- `%s` (%s): %s%s\n", c.Name, c.Kind, c.About, ceil)
	}
	p("\n")

	sizes := r.sizes(false)
	rows := transferRows(r, false)
	header := func(first string, extra ...string) {
		p("| %s |", first)
		for _, e := range extra {
			p(" %s |", e)
		}
		for _, s := range sizes {
			p(" %s |", bytesize.Format(s))
		}
		p("\n|%s", strings.Repeat(" --- |", 1+len(extra)))
		p("%s\n", strings.Repeat(" ---: |", len(sizes)))
	}
	for _, conc := range r.Config.Concurrency {
		if !slices.ContainsFunc(r.Transfers, func(m Measurement) bool { return m.Concurrency == conc && !m.BothWays }) {
			continue
		}
		p("### Throughput, GB/s, %d stream%s\n\n", conc, plural(conc))
		header("case")
		for _, rw := range rows {
			p("| %s |", rw.label)
			for _, s := range sizes {
				if m := r.exact(rw.c.Name, rw.payload, s, conc); m != nil {
					p(" %s ±%.0f%% |", fmtRate(m.GBps), m.spread())
				} else {
					p(" - |")
				}
			}
			p("\n")
		}
		p("\n### Fraction of the ceiling, %d stream%s\n\n", conc, plural(conc))
		p("The ceiling runs the same transfers with as many streams, in reps alternating with the case's; each cell is the median over reps of the case's GB/s over the ceiling's in the neighbouring rep.\n\n")
		header("case", "ceiling")
		for _, rw := range rows {
			if rw.c.Ceiling == "" {
				continue
			}
			p("| %s | %s |", rw.label, rw.c.Ceiling)
			for _, s := range sizes {
				if m := r.exact(rw.c.Name, rw.payload, s, conc); m != nil && m.OfCeiling > 0 {
					p(" %.2f |", m.OfCeiling)
				} else {
					p(" - |")
				}
			}
			p("\n")
		}
		p("\n")
	}

	// Latency matters for small transfers; past a few MiB it is size/throughput.
	var small []int64
	for _, s := range sizes {
		if s <= 1<<20 {
			small = append(small, s)
		}
	}
	if len(small) == 0 {
		return
	}
	conc := r.Config.Concurrency[0]
	p("### Latency of one transfer, %d stream%s: p50 / p99\n\n", conc, plural(conc))
	p("| case |")
	for _, s := range small {
		p(" %s |", bytesize.Format(s))
	}
	p(" p50 at %s vs its ping-pong | p50 at %s vs grpc-proto |\n|---|%s ---: | ---: |\n",
		bytesize.Format(small[0]), bytesize.Format(small[0]), strings.Repeat(" ---: |", len(small)))
	base := r.exact("grpc-proto", r.Config.Payloads[0].Name, small[0], conc)
	ratio := func(m, of *Measurement) string {
		if m == nil || of == nil || of.P50us <= 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f×", m.P50us/of.P50us)
	}
	for _, rw := range rows {
		p("| %s |", rw.label)
		for _, s := range small {
			if m := r.exact(rw.c.Name, rw.payload, s, conc); m != nil {
				p(" %s / %s |", fmtUs(m.P50us), fmtUs(m.P99us))
			} else {
				p(" - |")
			}
		}
		m := r.exact(rw.c.Name, rw.payload, small[0], conc)
		var pp *Measurement
		if name := pingPong(rw.c); name != "" {
			pp = r.exact(name, r.Config.Payloads[0].Name, small[0], conc)
		}
		p(" %s | %s |\n", ratio(m, pp), ratio(m, base))
	}
	p("\n")
}

// pingPong is the raw socket round trip that bounds a transfer case's
// latency: the unix socket for cases whose bytes move through memory
// (ceiling memcpy), the TCP socket for those over TCP, none for the
// ceilings themselves.
func pingPong(c Case) string {
	switch {
	case c.Kind == KindCeiling:
		return ""
	case c.Ceiling == "memcpy":
		return "unix-socket"
	case c.Ceiling == "tcp-socket":
		return "tcp-socket"
	}
	return ""
}

// writeCalls prints the call cases' tables: GB/s both ways, against the
// ceiling and the baseline, and latency.
func writeCalls(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	p("## Calls: tensor in, tensor out\n\n")
	p("Each stream calls a method with one tensor of the size and receives a tensor of the same size back; ")
	p("GB/s count the bytes moved both ways (2 × the size per call) over all streams, the median of the reps ± half their range. ")
	p("The ceiling and the baseline ran the same calls with as many streams, in reps alternating with the case's; ")
	p("the ratios are medians over reps of the case's GB/s over theirs in the neighbouring rep. ")
	p("The bytes checked are the reply's, which must equal the request's.\n\n")
	for _, c := range r.Cases {
		if !c.Call || c.Rate {
			continue
		}
		var extra []string
		if c.Ceiling != "" {
			extra = append(extra, "ceiling: "+c.Ceiling)
		}
		if c.Baseline != "" {
			extra = append(extra, "baseline: "+c.Baseline)
		}
		more := ""
		if len(extra) > 0 {
			more = "; " + strings.Join(extra, ", ")
		}
		p("- `%s` (%s): %s%s\n", c.Name, c.Kind, c.About, more)
	}
	p("\n")
	sizes := r.sizes(true)
	rows := transferRows(r, true)
	for _, conc := range r.Config.Concurrency {
		if !slices.ContainsFunc(r.Transfers, func(m Measurement) bool { return m.Concurrency == conc && m.BothWays }) {
			continue
		}
		at := func(rw row, s int64) *Measurement { return r.exact(rw.c.Name, rw.payload, s, conc) }
		header := func(title, extraHead string) {
			p("%s\n\n| case |", title)
			if extraHead != "" {
				p(" %s |", extraHead)
			}
			for _, s := range sizes {
				p(" %s |", bytesize.Format(s))
			}
			p("\n| --- |")
			if extraHead != "" {
				p(" --- |")
			}
			p("%s\n", strings.Repeat(" ---: |", len(sizes)))
		}
		cells := func(rw row, cell func(*Measurement) string) {
			for _, s := range sizes {
				if m := at(rw, s); m != nil {
					p(" %s |", cell(m))
				} else {
					p(" - |")
				}
			}
			p("\n")
		}
		header(fmt.Sprintf("### Calls, GB/s both ways, %d stream%s", conc, plural(conc)), "")
		for _, rw := range rows {
			p("| %s |", rw.label)
			cells(rw, func(m *Measurement) string { return fmt.Sprintf("%s ±%.0f%%", fmtRate(m.GBps), m.spread()) })
		}
		p("\n")
		header(fmt.Sprintf("### Calls against their ceiling and against plain gRPC, %d stream%s", conc, plural(conc)), "against")
		for _, rw := range rows {
			if rw.c.Ceiling != "" {
				p("| %s | %s |", rw.label, rw.c.Ceiling)
				cells(rw, func(m *Measurement) string { return ratioCell(m.OfCeiling) })
			}
			if rw.c.Baseline != "" {
				p("| %s | %s |", rw.label, rw.c.Baseline)
				cells(rw, func(m *Measurement) string { return ratioCell(m.OfBaseline) })
			}
		}
		p("\n")
		header(fmt.Sprintf("### Latency of one call, %d stream%s: p50 / p99", conc, plural(conc)), "")
		for _, rw := range rows {
			p("| %s |", rw.label)
			cells(rw, func(m *Measurement) string { return fmtUs(m.P50us) + " / " + fmtUs(m.P99us) })
		}
		p("\n")
	}
}

// ratioCell prints a ratio with two decimals, or two significant digits
// below 0.1 (a call against memcpy), and "-" for none.
func ratioCell(x float64) string {
	switch {
	case x <= 0:
		return "-"
	case x < 0.1:
		return fmt.Sprintf("%.2g", x)
	}
	return fmt.Sprintf("%.2f", x)
}

// writeRates prints the small-message rate table.
func writeRates(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	size := r.Rates[0].Bytes
	p("## Small-message rate: %s calls per second\n\n", bytesize.Format(size))
	p("Callers share one client (tensorrpc: one rpc.Client; gRPC: one ClientConn) and each makes calls back to back, ")
	p("a %s tensor in and %s back; calls/s is over all callers, the median of the reps ± half their range. ", bytesize.Format(size), bytesize.Format(size))
	p("The baseline ran with as many callers in reps alternating with the case's, on the same machine in the same run; ")
	p("the ratio is the median over reps of the case's calls/s over the baseline's in the neighbouring rep.\n\n")
	for _, c := range r.Cases {
		if c.Rate {
			p("- `%s`: %s\n", c.Name, c.About)
		}
	}
	p("\n| case | transport | callers | calls/s | baseline | baseline calls/s | ratio | p50 | baseline p50 |\n")
	p("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |\n")
	for _, rt := range r.Rates {
		p("| %s | %s | %d | %.0f ±%.0f%% | %s | %.0f | %s | %s | %s |\n", rt.Case, rt.Transport, rt.Callers, rt.CallsPerS, rt.spread(),
			rt.Baseline, rt.BaselineCallsPerS, ratioCell(rt.Ratio), fmtUs(rt.P50us), fmtUs(rt.BaselineP50us))
	}
	p("\n")
}

// writeRows prints the table of the rows cases.
func writeRows(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	first := r.Rows[0]
	p("## Rows: %d scattered rows of %s out of %d per Fetch\n\n", first.Rows, bytesize.Format(first.RowBytes), first.OfRows)
	p("A server publishes a table of %d rows of %s (a paged KV cache, an embedding table); each Fetch asks for %d of them (%s), ",
		first.OfRows, bytesize.Format(first.RowBytes), first.Rows, bytesize.Format(first.Bytes))
	p("distinct and in random order (a fixed seed), with rpc.Rows, and lands them with rpc.Into in a tensor of the stream's own. ")
	p("Alongside, on the same data plane in reps alternating with the case's: one Fetch per row (%d Fetches of one-row tensors, each Into a one-row tensor, a transfer being all of them) ", first.Rows)
	p("and one Fetch of the same rows back to back. GB/s is the median of the reps ± half their range, all streams; ")
	p("×per-row and ×contiguous are the medians over reps of the case's GB/s over the partner's in the neighbouring rep; p50 is one transfer's latency.\n\n")
	for _, c := range r.Cases {
		if c.Rows {
			p("- `%s`: %s\n", c.Name, c.About)
		}
	}
	p("\n| case | transport | streams | GB/s | rows/s | p50 | per-row GB/s | per-row p50 | ×per-row | contiguous GB/s | contiguous p50 | ×contiguous |\n")
	p("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, rr := range r.Rows {
		p("| %s | %s | %d | %s ±%.0f%% | %.0f | %s | %s | %s | %s | %s | %s | %s |\n", rr.Case, rr.Transport, rr.Concurrency,
			fmtRate(rr.GBps), rr.spread(), rr.RowsPerS, fmtUs(rr.P50us), fmtRate(rr.PerRowGBps), fmtUs(rr.PerRowP50us), ratioCell(rr.OfPerRow),
			fmtRate(rr.ContiguousGBps), fmtUs(rr.ContiguousP50us), ratioCell(rr.OfContiguous))
	}
	p("\n")
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func writeSerdes(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	p("## Ser/des of one tensor message (%s, in process)\n\n", r.Config.Payloads[0].Name)
	p("Encode: build the message from a key, dtype, shape and the tensor bytes. ")
	p("Decode+traverse: parse it and read every field, and the first and last tensor byte. ")
	p("Allocations are per message, averaged over the timed loops (the first call, which fills reused buffers, is not counted).\n\n")
	for _, f := range serdesFormats() {
		p("- `%s`: %s\n", f.name, f.about)
	}
	p("\n| format | tensor | wire size | encode | decode+traverse | encode allocs | decode allocs |\n")
	p("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, s := range r.Serdes {
		p("| %s | %s | %s | %s | %s | %.1f (%s) | %.1f (%s) |\n", s.Format, bytesize.Format(s.Bytes), bytesize.FormatApprox(float64(s.WireBytes)),
			fmtNs(s.EncodeNs), fmtNs(s.DecodeNs), s.EncodeAllocs, bytesize.FormatApprox(s.EncodeAllocBytes), s.DecodeAllocs, bytesize.FormatApprox(s.DecodeAllocBytes))
	}
	p("\n")
}

func writeCodecs(w io.Writer, r *Report) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	size := r.Codecs[0].Bytes
	p("## Compression, %s per payload, one core\n\n", bytesize.Format(size))
	p("Through the same encoding.Compressor the gRPC cases use. MB/s are uncompressed MB (1e6 bytes) per second. ")
	p("Break-even is the link speed above which compressing makes the transfer slower: with ratio r, compression Cc and decompression Cd, ")
	p("compress-send-decompress beats sending raw bytes over a link of B only if n/B > n/Cc + n/(r·B) + n/Cd, that is B < (1 − 1/r) / (1/Cc + 1/Cd) (serial). ")
	p("A perfect pipeline would move the bound to min(Cc, Cd) (pipelined), though with r close to 1 it gains next to nothing below it either. 100 Gb/s is 12.5 GB/s.\n\n")
	p("| codec | payload | ratio | compress MB/s | decompress MB/s | break-even, serial | pipelined |\n")
	p("| --- | --- | ---: | ---: | ---: | ---: | ---: |\n")
	for _, c := range r.Codecs {
		p("| %s | %s | %.3f | %.0f | %.0f | %s | %s |\n", strings.TrimPrefix(c.Codec, "tb-"), c.Payload, c.Ratio,
			c.CompressMBps, c.DecompressMBps, fmtGbps(c.BreakEvenGbps), fmtGbps(c.PipelinedBreakEvenGbps))
	}
	p("\n")
}

func fmtGbps(g float64) string {
	if g == 0 {
		return "never"
	}
	return fmt.Sprintf("%.2f Gb/s", g)
}

// writeSkips lists the measurements not made, grouped by reason.
func writeSkips(w io.Writer, skips []Skip) {
	fmt.Fprintf(w, "## Skipped\n\n")
	var reasons []string
	byReason := map[string][]string{}
	for _, s := range skips {
		if _, ok := byReason[s.Reason]; !ok {
			reasons = append(reasons, s.Reason)
		}
		what := s.Case
		if s.Bytes > 0 {
			what = fmt.Sprintf("%s %s %s c=%d", s.Case, bytesize.Format(s.Bytes), s.Payload, s.Concurrency)
		}
		byReason[s.Reason] = append(byReason[s.Reason], what)
	}
	for _, reason := range reasons {
		fmt.Fprintf(w, "- %s (%d): %s\n", reason, len(byReason[reason]), strings.Join(byReason[reason], ", "))
	}
	fmt.Fprintf(w, "\n")
}
