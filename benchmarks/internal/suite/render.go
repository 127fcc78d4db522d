package suite

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"slices"
)

// ReadReport rebuilds a report from the JSON lines of a run (-jsonl, or
// stdout with -format json), so that its tables and plots can be drawn
// again without measuring anything. The run's configuration is not
// recorded; what the tables and plots need of it (payloads, concurrencies,
// cases) is taken from the lines themselves.
func ReadReport(r io.Reader) (*Report, error) {
	rep := &Report{}
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 16<<20)
	var payloads []string
	var concs []int
	var cases []string
	caseKind := map[string]Measurement{}
	rateCases := map[string]Rate{}
	rowsCases := map[string]bool{}
	seen := func(c, payload string, conc int) {
		if payload != "" && !slices.Contains(payloads, payload) {
			payloads = append(payloads, payload)
		}
		if conc > 0 && !slices.Contains(concs, conc) {
			concs = append(concs, conc)
		}
		if c != "" && !slices.Contains(cases, c) {
			cases = append(cases, c)
		}
	}
	for line := 1; sc.Scan(); line++ {
		b := sc.Bytes()
		if len(b) == 0 {
			continue
		}
		var head struct {
			Kind string `json:"kind"`
		}
		if err := json.Unmarshal(b, &head); err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		var err error
		switch head.Kind {
		case "machine":
			err = json.Unmarshal(b, &rep.Machine)
			rep.Command = rep.Machine.Command
		case "transfer":
			var m Measurement
			if err = json.Unmarshal(b, &m); err == nil {
				rep.Transfers = append(rep.Transfers, m)
				seen(m.Case, m.Payload, m.Concurrency)
				caseKind[m.Case] = m
			}
		case "rate":
			var rt Rate
			if err = json.Unmarshal(b, &rt); err == nil {
				rep.Rates = append(rep.Rates, rt)
				seen(rt.Case, rt.Payload, 0)
				rateCases[rt.Case] = rt
			}
		case "rows":
			var rr RowsResult
			if err = json.Unmarshal(b, &rr); err == nil {
				rep.Rows = append(rep.Rows, rr)
				seen(rr.Case, rr.Payload, rr.Concurrency)
				rowsCases[rr.Case] = true
			}
		case "skip":
			var s Skip
			if err = json.Unmarshal(b, &s); err == nil {
				rep.Skips = append(rep.Skips, s)
				seen(s.Case, s.Payload, s.Concurrency)
			}
		case "serdes":
			var s SerdesResult
			if err = json.Unmarshal(b, &s); err == nil {
				rep.Serdes = append(rep.Serdes, s)
			}
		case "codec":
			var c CodecResult
			if err = json.Unmarshal(b, &c); err == nil {
				rep.Codecs = append(rep.Codecs, c)
				seen("", c.Payload, 0)
			}
		case "note":
			var n Note
			if err = json.Unmarshal(b, &n); err == nil {
				rep.Notes = append(rep.Notes, n.Note)
			}
		case "summary":
			err = json.Unmarshal(b, &rep.Summary)
			rep.Machine.LoadAfter = rep.Summary.LoadAfter
		default:
			err = fmt.Errorf("unknown kind %q", head.Kind)
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if rep.Machine.Kind == "" {
		return nil, fmt.Errorf("no machine line: not the JSON lines of a tensorbench run")
	}

	// Payloads and cases in the order a run reports them; names this
	// build does not know (from an older run) keep what their lines say.
	for _, p := range Payloads {
		if slices.Contains(payloads, p.Name) {
			rep.Config.Payloads = append(rep.Config.Payloads, p)
		}
	}
	for _, name := range payloads {
		if !slices.ContainsFunc(rep.Config.Payloads, func(p Payload) bool { return p.Name == name }) {
			rep.Config.Payloads = append(rep.Config.Payloads, Payload{Name: name, About: "(not a payload of this build)"})
		}
	}
	for _, c := range Cases() {
		if slices.Contains(cases, c.Name) {
			rep.Cases = append(rep.Cases, c)
		}
	}
	for _, name := range cases {
		if !slices.ContainsFunc(rep.Cases, func(c Case) bool { return c.Name == name }) {
			if rowsCases[name] {
				rep.Cases = append(rep.Cases, Case{Name: name, Kind: KindTensorRPC, Rows: true, About: "(not a case of this build)"})
				continue
			}
			if rt, ok := rateCases[name]; ok {
				rep.Cases = append(rep.Cases, Case{Name: name, Kind: KindTensorRPC, Baseline: rt.Baseline, Call: true, Rate: true,
					About: "(not a case of this build)"})
				continue
			}
			m := caseKind[name]
			rep.Cases = append(rep.Cases, Case{Name: name, Kind: m.CaseKind, Ceiling: m.Ceiling, Baseline: m.Baseline,
				Call: m.BothWays, Content: m.CaseKind == KindCompressed, About: "(not a case of this build)"})
		}
	}
	slices.Sort(concs)
	rep.Config.Concurrency = concs
	rep.Config.Cases = rep.Cases
	if len(rep.Config.Payloads) == 0 {
		rep.Config.Payloads = Payloads[:1]
	}
	if len(rep.Config.Concurrency) == 0 {
		rep.Config.Concurrency = []int{1}
	}
	return rep, nil
}

// Render writes rep's tables to out (nil: none) and, when plotDir is not
// empty, its plots into plotDir; it returns the plots' file names.
func Render(rep *Report, out io.Writer, plotDir string) ([]string, error) {
	if out != nil {
		writeText(out, rep)
	}
	if plotDir == "" || len(rep.Transfers) == 0 {
		return nil, nil
	}
	return writePlots(plotDir, rep)
}
