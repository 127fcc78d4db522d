package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// soakLine is a report line: one per plane per interval, and in the summary.
var soakLine = regexp.MustCompile(`^\[ *\d+s\] (tcp |shm |grpc) transfers=(\d+) GB=\d+\.\d{3} errors=(\d+) verify-failures=(\d+) ` +
	`server-pool\(inuse=\d+\.\dMiB reserved=\d+\.\dMiB\) client-pool\(inuse=\d+\.\dMiB reserved=\d+\.\dMiB\) rss=\d+\.\dMiB goroutines=\d+$`)

func runSoakCmd(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := runMain(append([]string{"soak"}, args...), &stdout, &stderr)
	return code, stdout.String() + stderr.String()
}

// TestSoak runs the soak for 5 seconds over every loopback plane and checks
// its exit status and the shape of its output.
func TestSoak(t *testing.T) {
	defer leakcheck.Check(t)
	code, out := runSoakCmd(t, "-duration", "5s", "-streams", "3", "-report", "2s", "-size", "1MiB", "-planes", "tcp,shm,grpc", "-seed", "7")
	t.Logf("soak output:\n%s", out)
	if code != 0 {
		t.Fatalf("soak exited %d", code)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if !strings.HasPrefix(lines[0], "soak: planes=tcp,shm,grpc streams=3 duration=5s size=1048576 report=2s seed=7") {
		t.Errorf("header %q", lines[0])
	}
	reports := map[string]int{}
	var transfers = map[string]string{}
	for _, l := range lines {
		if m := soakLine.FindStringSubmatch(l); m != nil {
			plane := strings.TrimSpace(m[1])
			reports[plane]++
			transfers[plane] = m[2]
			if m[3] != "0" || m[4] != "0" {
				t.Errorf("errors reported: %q", l)
			}
		} else if strings.HasPrefix(l, "[") {
			t.Errorf("malformed report line %q", l)
		}
	}
	for _, p := range []string{"tcp", "shm", "grpc"} {
		// two interval reports (2 s, 4 s) and the summary's
		if reports[p] < 3 {
			t.Errorf("%s: %d report lines, want at least 3", p, reports[p])
		}
		if transfers[p] == "0" || transfers[p] == "" {
			t.Errorf("%s: no transfers", p)
		}
	}
	for _, want := range []string{"soak: summary after ", "soak: total transfers=", "goroutines-after-shutdown=", "soak: PASS"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output", want)
		}
	}
}

// TestSoakFailsOnCorruption: a verification failure makes the soak exit 1
// and name it.
func TestSoakFailsOnCorruption(t *testing.T) {
	defer leakcheck.Check(t)
	soakCorrupt = func(b []byte) {
		if len(b) > 0 {
			b[len(b)/2] ^= 0x40
		}
	}
	defer func() { soakCorrupt = nil }()
	code, out := runSoakCmd(t, "-duration", "1s", "-streams", "2", "-report", "1s", "-size", "64KiB", "-planes", "grpc")
	if code != 1 {
		t.Fatalf("soak with corrupted receives exited %d, want 1:\n%s", code, out)
	}
	if !strings.Contains(out, "CRC32C") || !strings.Contains(out, "soak: FAIL") || !regexp.MustCompile(`verify-failures=[1-9]`).MatchString(out) {
		t.Errorf("the output does not report the verification failures:\n%s", out)
	}
}

func TestSoakUsage(t *testing.T) {
	for _, args := range [][]string{{"-planes", "udp"}, {"-size", "2GiB"}, {"-streams", "0"}, {"extra"}} {
		if code, out := runSoakCmd(t, args...); code != 2 {
			t.Errorf("soak %q exited %d, want 2:\n%s", args, code, out)
		}
	}
}
