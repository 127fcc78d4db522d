// Package bytesize parses and formats byte counts for the command-line tools,
// examples and benchmarks, so that every flag reads sizes the same way.
//
// Units are binary throughout: K, KB and KiB all mean 1024 bytes, M, MB and
// MiB 1024², G, GB and GiB 1024³, T, TB and TiB 1024⁴ (the convention of
// perftest, NCCL and the shell tools people pass sizes to). Suffixes are
// case-insensitive; a space between number and unit is allowed.
package bytesize

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

var shifts = map[string]uint{
	"": 0, "b": 0,
	"k": 10, "kb": 10, "kib": 10,
	"m": 20, "mb": 20, "mib": 20,
	"g": 30, "gb": 30, "gib": 30,
	"t": 40, "tb": 40, "tib": 40,
}

// Parse reads a size such as "4096", "4KiB", "64 MiB" or "1G". It rejects
// negative numbers, fractions, unknown units and values that overflow int64.
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && t[i] >= '0' && t[i] <= '9' {
		i++
	}
	if i == 0 {
		return 0, fmt.Errorf("bad size %q: want a number with an optional unit (B, KiB, MiB, GiB, TiB)", s)
	}
	unit := strings.ToLower(strings.TrimSpace(t[i:]))
	sh, ok := shifts[unit]
	if !ok {
		return 0, fmt.Errorf("bad size %q: unknown unit %q (want B, KiB, MiB, GiB or TiB)", s, t[i:])
	}
	n, err := strconv.ParseInt(t[:i], 10, 64)
	if err != nil || n > math.MaxInt64>>sh {
		return 0, fmt.Errorf("bad size %q: too large", s)
	}
	return n << sh, nil
}

// ParseList reads a comma-separated list of sizes ("4KiB,1MiB,64MiB"). Empty
// items are an error, and so is an empty list.
func ParseList(s string) ([]int64, error) {
	var out []int64
	for _, f := range strings.Split(s, ",") {
		n, err := Parse(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// ParseInts is ParseList for callers that size buffers with int; it rejects
// values that do not fit.
func ParseInts(s string) ([]int, error) {
	l, err := ParseList(s)
	if err != nil {
		return nil, err
	}
	out := make([]int, len(l))
	for i, n := range l {
		if n > math.MaxInt {
			return nil, fmt.Errorf("bad size %d: too large for this platform", n)
		}
		out[i] = int(n)
	}
	return out, nil
}

// ParsePositiveInts is ParseInts for lists of transfer sizes: every size
// must also be above zero.
func ParsePositiveInts(s string) ([]int, error) {
	out, err := ParseInts(s)
	if err != nil {
		return nil, err
	}
	for _, n := range out {
		if n <= 0 {
			return nil, fmt.Errorf("bad size %d in %q: sizes must be positive", n, s)
		}
	}
	return out, nil
}

var units = []struct {
	shift uint
	name  string
}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}}

// Format writes n exactly when it is a whole number of some binary unit
// ("64 MiB", "4 KiB", "1000 B") and with three significant digits otherwise
// ("1.5 MiB", "97.7 KiB"). Negative values keep their sign.
func Format(n int64) string {
	if n < 0 {
		if n == math.MinInt64 {
			return "-8 EiB"
		}
		return "-" + Format(-n)
	}
	for _, u := range units {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return fmt.Sprintf("%d %s", n>>u.shift, u.name)
		}
	}
	return FormatApprox(float64(n))
}

// FormatApprox writes a (possibly fractional) byte count with three
// significant digits and the largest binary unit not above it: "1.50 MiB",
// "97.7 KiB", "512 B".
func FormatApprox(n float64) string {
	neg := ""
	if n < 0 {
		neg, n = "-", -n
	}
	for _, u := range units {
		if d := float64(uint64(1) << u.shift); n >= d {
			return neg + threeDigits(n/d) + " " + u.name
		}
	}
	return fmt.Sprintf("%s%.0f B", neg, math.Round(n))
}

func threeDigits(v float64) string {
	switch {
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}
