package bytesize

import (
	"math"
	"testing"
)

func TestParse(t *testing.T) {
	good := map[string]int64{
		"0": 0, "4096": 4096, "4KiB": 4096, "4k": 4096, "4 KB": 4096, " 64MiB ": 64 << 20,
		"1G": 1 << 30, "1gib": 1 << 30, "2TiB": 2 << 40, "7B": 7, "8388607TiB": 8388607 << 40,
	}
	for in, want := range good {
		got, err := Parse(in)
		if err != nil || got != want {
			t.Errorf("Parse(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "KiB", "-1", "1.5MiB", "4 XB", "4KiBs", "8388608TiB", "99999999999999999999"} {
		if n, err := Parse(in); err == nil {
			t.Errorf("Parse(%q) = %d, want an error", in, n)
		}
	}
}

func TestParseList(t *testing.T) {
	got, err := ParseInts("4KiB, 1MiB,64MiB")
	if err != nil || len(got) != 3 || got[0] != 4096 || got[1] != 1<<20 || got[2] != 64<<20 {
		t.Fatalf("ParseInts = %v, %v", got, err)
	}
	for _, in := range []string{"", "4KiB,", ",4KiB", "4KiB,,1MiB"} {
		if _, err := ParseList(in); err == nil {
			t.Errorf("ParseList(%q) succeeded, want an error", in)
		}
	}
}

func TestParsePositiveInts(t *testing.T) {
	if got, err := ParsePositiveInts("1,4KiB"); err != nil || len(got) != 2 || got[1] != 4096 {
		t.Errorf("ParsePositiveInts = %v, %v", got, err)
	}
	if _, err := ParsePositiveInts("4KiB,0"); err == nil {
		t.Error("ParsePositiveInts accepted a zero size")
	}
}

func TestFormat(t *testing.T) {
	cases := map[int64]string{
		0: "0 B", 1000: "1000 B", 1024: "1 KiB", 64 << 20: "64 MiB", 3 << 30: "3 GiB", 5 << 40: "5 TiB",
		1536 << 10: "1536 KiB", 1536<<10 + 1: "1.50 MiB", 100000: "97.7 KiB", -4096: "-4 KiB", math.MinInt64: "-8 EiB",
	}
	for in, want := range cases {
		if got := Format(in); got != want {
			t.Errorf("Format(%d) = %q, want %q", in, got, want)
		}
	}
	if got := FormatApprox(512.4); got != "512 B" {
		t.Errorf("FormatApprox(512.4) = %q", got)
	}
	if got := FormatApprox(200 << 20); got != "200 MiB" {
		t.Errorf("FormatApprox(200 MiB) = %q", got)
	}
}

func TestRoundTrip(t *testing.T) {
	for _, n := range []int64{1, 4096, 64 << 20, 1 << 30, 3 << 40} {
		got, err := Parse(Format(n))
		if err != nil || got != n {
			t.Errorf("Parse(Format(%d)) = %d, %v", n, got, err)
		}
	}
}
