package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// Status is the outcome of a check.
type Status string

const (
	// StatusOK: the host has it and tensorrpc can use it.
	StatusOK Status = "ok"
	// StatusWarning: usable, but limited in a way that costs performance
	// or will fail at scale.
	StatusWarning Status = "warning"
	// StatusUnavailable: the host does not offer it; tensorrpc falls back.
	StatusUnavailable Status = "unavailable"
)

// Check is one line of the report.
type Check struct {
	Name   string `json:"name"`
	Status Status `json:"status"`
	// Detail says what was found, with the numbers or the error text.
	Detail string `json:"detail"`
	// Advice says what to do about a status other than ok; it is empty
	// when there is nothing to do.
	Advice string `json:"advice"`
}

// Report is what doctor prints.
type Report struct {
	Version   Version    `json:"version"`
	Env       []rpc.Knob `json:"environment"`
	GOOS      string     `json:"goos"`
	GOARCH    string     `json:"goarch"`
	GoVersion string     `json:"go_version"`
	RDMATag   bool       `json:"rdma_build_tag"`
	Checks    []Check    `json:"checks"`
}

// host is where the checks look: root is "/" except in tests, which point
// it at a fixture tree of /proc and /sys files. Checks that make system
// calls (memlock, pinning, memfd, data planes) always test the real host.
type host struct {
	root string
}

func defaultHost() host { return host{root: "/"} }

func (h host) path(p string) string { return filepath.Join(h.root, p) }

func (h host) exists(p string) bool {
	_, err := os.Stat(h.path(p))
	return err == nil
}

// readTrim returns the trimmed contents of a small file.
func (h host) readTrim(p string) (string, error) {
	b, err := os.ReadFile(h.path(p))
	return strings.TrimSpace(string(b)), err
}

// diagnose runs every check.
func diagnose(h host) *Report {
	rep := &Report{Version: buildVersion(), Env: rpc.EnvKnobs(), GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, GoVersion: runtime.Version(), RDMATag: builtWithRDMA}
	add := func(cs ...Check) { rep.Checks = append(rep.Checks, cs...) }
	add(checkRDMABuild(), checkRDMADevices(h))
	add(checkMemlock(h), checkPinning())
	add(checkHugepages(h), checkTransparentHugepages(h))
	add(checkMemfd(), checkSHM())
	add(checkDataPlanes()...)
	add(checkGPUDirect(h)...)
	return rep
}

func (r *Report) writeJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(r)
}

func (r *Report) writeText(w io.Writer) error {
	bw := bufio.NewWriter(w)
	tag := "without"
	if r.RDMATag {
		tag = "with"
	}
	fmt.Fprintf(bw, "tensorrpc doctor: %s/%s, %s, built %s -tags rdma\n", r.GOOS, r.GOARCH, r.GoVersion, tag)
	fmt.Fprintf(bw, "%s\n", r.Version)
	fmt.Fprintf(bw, "environment (read by NewServer and Dial; an explicit option wins):\n")
	for _, k := range r.Env {
		v := k.Value
		if v == "" {
			v = "unset (default: " + k.Default + ")"
		}
		fmt.Fprintf(bw, "  %-24s %s\n  %-24s   %s\n", k.Name, v, "", k.Meaning)
	}
	fmt.Fprintln(bw)
	counts := map[Status]int{}
	for _, c := range r.Checks {
		counts[c.Status]++
		fmt.Fprintf(bw, "%-11s  %s: %s\n", c.Status, c.Name, c.Detail)
		if c.Advice != "" {
			fmt.Fprintf(bw, "%-11s  → %s\n", "", c.Advice)
		}
	}
	fmt.Fprintf(bw, "\n%d ok, %d warning, %d unavailable\n", counts[StatusOK], counts[StatusWarning], counts[StatusUnavailable])
	fmt.Fprintln(bw, verdict(r.Checks))
	return bw.Flush()
}

// verdict sums the checks up in one line: which data planes work, and
// whether anything needs doing.
func verdict(cs []Check) string {
	var planes, broken, warnings []string
	for _, c := range cs {
		if p, ok := strings.CutPrefix(c.Name, "data-plane "); ok {
			switch {
			case c.Status == StatusOK:
				planes = append(planes, p)
			case p != rpc.TransportIBV:
				broken = append(broken, p) // ibv needs hardware most hosts lack
			}
		}
		if c.Status == StatusWarning {
			warnings = append(warnings, c.Name)
		}
	}
	works := "no data plane works"
	switch len(planes) {
	case 0:
	case 1:
		works = planes[0] + " works"
	default:
		works = strings.Join(planes, ", ") + " work"
	}
	switch {
	case len(broken) > 0:
		return fmt.Sprintf("verdict: %s; %s failed here: see its line above", works, strings.Join(broken, ", "))
	case len(warnings) > 0:
		return fmt.Sprintf("verdict: %s; look at the warnings (%s): they cost performance or fail at scale", works, strings.Join(warnings, ", "))
	}
	return fmt.Sprintf("verdict: %s; nothing to do (what is unavailable is hardware or drivers this host does not have)", works)
}

// meminfo parses /proc/meminfo into values; sizes in kB are converted to
// bytes, counts are left as they are.
func (h host) meminfo() (map[string]uint64, error) {
	f, err := os.Open(h.path("/proc/meminfo"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]uint64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseUint(fields[0], 10, 64)
		if err != nil {
			continue
		}
		if len(fields) > 1 && fields[1] == "kB" {
			v <<= 10
		}
		out[key] = v
	}
	return out, sc.Err()
}

// formatBytes writes n with a binary unit (internal/bytesize).
func formatBytes(n uint64) string { return bytesize.Format(int64(n)) }
