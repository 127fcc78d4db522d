package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/examples/internal/twohosts"
	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// commandRole is the test binary run as the kvcache command, as a user or
// a launcher starts it.
const commandRole = "kvcache-command"

// stderrToStdout, set in a command's environment, sends its errors to its
// stdout, which the test reads.
const stderrToStdout = "KVCACHE_TEST_STDERR_TO_STDOUT"

// TestMain lets the test binary play the prefill when kvcache re-executes
// it, and the command when a test starts it as a launched prefill or
// decode.
func TestMain(m *testing.M) {
	switch childproc.Role() {
	case prefillRole:
		os.Exit(prefillChild(os.Args[1:]))
	case commandRole:
		args := os.Args[1:]
		if len(args) > 0 && strings.HasPrefix(args[0], "-test.") { // childtest.Start's
			args = args[1:]
		}
		if os.Getenv(stderrToStdout) != "" {
			os.Stderr = os.Stdout // the test reads what went wrong
		}
		os.Exit(command(args, os.Stdout))
	}
	os.Exit(m.Run())
}

// tiny is a run small enough for a test: 64 blocks of 32 KiB, 16 per
// request (512 KiB, well above the eager threshold, so the Rows fetch and
// the write-back take the data plane), 3 timed requests.
var tiny = []string{"-blocks", "64", "-block-bytes", "32KiB", "-request-blocks", "16", "-requests", "3"}

func tinyConfig() config {
	cfg := defaultConfig()
	cfg.Blocks, cfg.BlockBytes, cfg.RequestBlocks, cfg.Requests = 64, 32<<10, 16, 3
	return cfg
}

// TestRun decodes in this process against a prefill child on every plane
// and checks the report: every operation timed, every block checked, the
// prefill's cache at the versions written, and no copy on the decode's
// side where the data plane reads into its pool.
func TestRun(t *testing.T) {
	defer leakcheck.Check(t)
	cfg := tinyConfig()
	if err := cfg.check(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	rep, err := run(ctx, &cfg, &out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	var planes []string
	for _, p := range rep.Planes {
		planes = append(planes, p.Plane)
		for op, tm := range p.Ops {
			if tm.Requests != cfg.Requests || tm.Total <= 0 {
				t.Errorf("%s %s: %d requests in %v, want %d", p.Plane, operation(op), tm.Requests, tm.Total, cfg.Requests)
			}
		}
		if p.Plane == rpc.TransportGRPC {
			continue
		}
		for _, op := range []operation{fetchRows, fetchContiguous, writeRows} {
			if c := p.Ops[op].Copies; c != 0 {
				t.Errorf("%s %s: %d copies on the decode's side, want 0 (pool memory on a data plane)", p.Plane, op, c)
			}
		}
	}
	if !slices.Equal(planes, cfg.Transports) {
		t.Fatalf("measured %v, want %v (skipped: %v)", planes, cfg.Transports, rep.Skipped)
	}
	// Per plane: the warm-up and the timed requests of the three fetches,
	// and the read-back of the last write.
	perPlane := (1+cfg.Requests)*3*cfg.RequestBlocks + cfg.RequestBlocks
	if want := int64(len(planes) * perPlane); rep.BlocksChecked != want {
		t.Errorf("%d blocks checked, want %d", rep.BlocksChecked, want)
	}
	if want := int64(len(planes) * (1 + cfg.Requests) * cfg.RequestBlocks); rep.BlocksWritten != want {
		t.Errorf("%d blocks written, want %d", rep.BlocksWritten, want)
	}
	if rep.ReadBack < int64(len(planes)*cfg.RequestBlocks) {
		t.Errorf("%d written blocks read back, want at least the last write of each plane (%d)", rep.ReadBack, len(planes)*cfg.RequestBlocks)
	}
	if rep.PrefillChecked != cfg.Blocks || rep.PrefillWritten == 0 {
		t.Errorf("the prefill checked %d blocks, %d written; want %d, some", rep.PrefillChecked, rep.PrefillWritten, cfg.Blocks)
	}
	checkOutput(t, out.String(), cfg.Transports)
}

// Lines of the decode's report.
var (
	opLine       = regexp.MustCompile(`(?m)^(\w+)\s+(fetch rows|fetch per block|fetch contiguous|write rows)\s+(\d+)\s+(\d+)\s+([\d.]+ (?:µs|ms|s))\s+(\d+)\s+([\d.]+)\s+([\d.]+)$`)
	ratioLine    = regexp.MustCompile(`(?m)^(\w+): rows fetch ([\d.]+)× the rate of one Fetch per block, ([\d.]+)× the rate of one contiguous Fetch$`)
	verifiedLine = regexp.MustCompile(`(?m)^bytes verified: (\d+) blocks fetched \(([\w, ]+)\), every one checked .*; (\d+) blocks written back with SendRows, (\d+) read back .*; the prefill found all (\d+) blocks of its own cache at the versions written \((\d+) written\)$`)
)

// checkOutput checks that the report has, for each plane in planes, the
// four operations with their numbers and the ratios to the baselines, and
// the line saying the bytes were verified.
func checkOutput(t *testing.T, out string, planes []string) {
	t.Helper()
	ops := map[string]int{}
	for _, m := range opLine.FindAllStringSubmatch(out, -1) {
		ops[m[1]]++
		for _, f := range []string{m[6], m[7]} { // blocks/s, GB/s
			if v, err := strconv.ParseFloat(f, 64); err != nil || v <= 0 {
				t.Errorf("%q: a rate of %s", m[0], f)
			}
		}
	}
	ratios := map[string]bool{}
	for _, m := range ratioLine.FindAllStringSubmatch(out, -1) {
		for _, f := range m[2:] {
			if v, err := strconv.ParseFloat(f, 64); err != nil || v <= 0 {
				t.Errorf("%q: a ratio of %s", m[0], f)
			}
		}
		ratios[m[1]] = true
	}
	for _, p := range planes {
		if ops[p] != int(numOperations) || !ratios[p] {
			t.Errorf("%s: %d operation lines and ratios %v in the output", p, ops[p], ratios[p])
		}
	}
	v := verifiedLine.FindStringSubmatch(out)
	if v == nil {
		t.Fatal("no \"bytes verified\" line")
	}
	if v[2] != strings.Join(planes, ", ") {
		t.Errorf("bytes verified on %s, want %v", v[2], planes)
	}
	for _, f := range []string{v[1], v[3], v[4], v[5], v[6]} {
		if n, _ := strconv.Atoi(f); n <= 0 {
			t.Errorf("%q: a count of %s", v[0], f)
		}
	}
}

// TestLaunched runs the prefill and the decode as separate processes, as a
// launcher would, decode first, on tcp, shm and grpc; the decode prints
// the report and stops the prefill, and both exit 0.
func TestLaunched(t *testing.T) {
	addr := freeAddr(t, "127.0.0.1")
	planes := []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC}
	out := runLaunched(t, nil, nil, addr, addr, planes)
	checkOutput(t, out, planes)
}

// TestLaunchedTwoHosts runs the prefill on one host and the decode on
// another (network namespaces joined by a veth pair, each process started
// by `ip netns exec`, as ssh would start it on another machine). tcp and
// grpc cross the link; shm, which needs one host, is listed with its
// reason.
func TestLaunchedTwoHosts(t *testing.T) {
	h := twohosts.New(t)
	addr := net.JoinHostPort(h.IP[0], "29700")
	out := runLaunched(t, h.Prefix(0), h.Prefix(1), addr, addr, []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC})
	checkOutput(t, out, []string{rpc.TransportTCP, rpc.TransportGRPC})
	if !strings.Contains(out, "shm: not measured: ") {
		t.Error("shm between two hosts was not listed as not measured, with its reason")
	}
}

// runLaunched starts a launched prefill listening on listen (under
// prefillPrefix) and a launched decode dialing addr (under decodePrefix),
// decode first, waits for both to exit successfully and returns the
// decode's output.
func runLaunched(t *testing.T, prefillPrefix, decodePrefix []string, listen, addr string, planes []string) string {
	t.Helper()
	job := append([]string{"-timeout", "60s", "-transports", strings.Join(planes, ",")}, tiny...)
	decode := childtest.Start(t, commandRole, childproc.Options{Prefix: decodePrefix, Env: []string{stderrToStdout + "=1"},
		Args: append([]string{"-role", "decode", "-prefill", addr}, job...)})
	prefill := childtest.Start(t, commandRole, childproc.Options{Prefix: prefillPrefix,
		Args: append([]string{"-role", "prefill", "-listen", listen}, job...)})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	return childtest.Job(ctx, t, []*childproc.Process{decode, prefill})
}

// TestLaunchedDecodeDies: a decode killed mid-run fails the prefill when
// the prefill sees its session end, not at -timeout.
func TestLaunchedDecodeDies(t *testing.T) {
	addr := freeAddr(t, "127.0.0.1")
	// Enough requests that the decode is still at work when killed.
	job := []string{"-timeout", "5m", "-blocks", "64", "-block-bytes", "32KiB", "-request-blocks", "16", "-requests", "1000000"}
	prefill := childtest.Start(t, commandRole, childproc.Options{Env: []string{stderrToStdout + "=1"},
		Args: append([]string{"-role", "prefill", "-listen", addr}, job...)})
	decode := childtest.Start(t, commandRole, childproc.Options{Args: append([]string{"-role", "decode", "-prefill", addr}, job...)})

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// The decode prints its header once its hello went through.
	if l, err := decode.ReadLine(ctx); err != nil || !strings.HasPrefix(l, "kvcache decode: ") {
		t.Fatalf("the decode's first line: %q, %v", l, err)
	}
	decode.Kill()
	var out strings.Builder
	for {
		l, err := prefill.ReadLine(ctx)
		if errors.Is(err, childproc.ErrExited) {
			break
		}
		if err != nil {
			t.Fatalf("the prefill went on after the decode was killed: %v; it printed:\n%s", err, out.String())
		}
		out.WriteString(l + "\n")
	}
	if err := prefill.Wait(); err == nil {
		t.Fatalf("the prefill succeeded; it printed:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "the decode left") {
		t.Fatalf("the prefill failed without naming the decode; it printed:\n%s", out.String())
	}
	t.Log("the prefill printed:\n" + out.String())
}

// freeAddr is host and a port nothing listens on now.
func freeAddr(t *testing.T, host string) string {
	t.Helper()
	lis, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// TestPattern checks that a block's pattern catches what a wrong fetch or
// write would deliver: another block, another version, shifted bytes, one
// flipped bit.
func TestPattern(t *testing.T) {
	const n = 4096
	b := make([]byte, n)
	fillBlock(b, 7, 3)
	if err := checkBlock(b, 7, 3); err != nil {
		t.Fatal(err)
	}
	other := make([]byte, n)
	for _, tc := range []struct {
		name string
		make func() []byte
	}{
		{"another block", func() []byte { fillBlock(other, 8, 3); return other }},
		{"another version", func() []byte { fillBlock(other, 7, 2); return other }},
		{"shifted by a word", func() []byte { fillBlock(other, 7, 3); copy(other, other[8:]); return other }},
		{"one bit", func() []byte { fillBlock(other, 7, 3); other[n-1] ^= 1; return other }},
	} {
		if err := checkBlock(tc.make(), 7, 3); err == nil {
			t.Errorf("%s: not caught", tc.name)
		}
	}
}

// TestRequests checks that a request's blocks are distinct and in range,
// and that the seed fixes them.
func TestRequests(t *testing.T) {
	a, b := newRequests(1, 100, 30), newRequests(1, 100, 30)
	c := newRequests(2, 100, 30)
	differ := false
	for range 50 {
		x, y, z := a.next(), b.next(), c.next()
		if !slices.Equal(x, y) {
			t.Fatal("the same seed drew different blocks")
		}
		differ = differ || !slices.Equal(x, z)
		seen := map[int64]bool{}
		for _, id := range x {
			if id < 0 || id >= 100 || seen[id] {
				t.Fatalf("request %v: block %d out of range or repeated", x, id)
			}
			seen[id] = true
		}
	}
	if !differ {
		t.Error("seeds 1 and 2 drew the same blocks")
	}
}

func TestConfigCheck(t *testing.T) {
	for _, bad := range []func(*config){
		func(c *config) { c.Blocks = 0 },
		func(c *config) { c.BlockBytes = 12 },
		func(c *config) { c.RequestBlocks = c.Blocks + 1 },
		func(c *config) { c.Requests = 0 },
		func(c *config) { c.Transports = []string{"udp"} },
	} {
		cfg := defaultConfig()
		bad(&cfg)
		if cfg.check() == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
}
