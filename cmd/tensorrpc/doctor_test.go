package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// TestDoctorJSON runs every check on this host and validates the report.
func TestDoctorJSON(t *testing.T) {
	defer leakcheck.Check(t)
	t.Setenv(rpc.EnvTransports, "tcp,grpc") // the report lists it; the data-plane checks name their transports, which wins
	var stdout, stderr bytes.Buffer
	if code := runMain([]string{"doctor", "-json"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d, stderr %s", code, stderr.String())
	}
	dec := json.NewDecoder(&stdout)
	dec.DisallowUnknownFields()
	var rep Report
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("decoding the report: %v\n%s", err, stdout.String())
	}
	if rep.GOOS == "" || rep.GoVersion == "" || rep.RDMATag != builtWithRDMA {
		t.Errorf("bad header: %+v", rep)
	}
	if rep.Version.Module == "" || rep.Version.GoVersion != runtime.Version() || rep.Version.Protocol == 0 {
		t.Errorf("bad version: %+v", rep.Version)
	}
	knobs := map[string]rpc.Knob{}
	for _, k := range rep.Env {
		knobs[k.Name] = k
	}
	if k, ok := knobs[rpc.EnvTransports]; !ok || k.Value != "tcp,grpc" || k.Default == "" || k.Meaning == "" {
		t.Errorf("environment: %s = %+v, want the value set by the test", rpc.EnvTransports, k)
	}
	seen := map[string]bool{}
	for _, c := range rep.Checks {
		if c.Name == "" || c.Detail == "" || seen[c.Name] {
			t.Errorf("bad or repeated check %+v", c)
		}
		seen[c.Name] = true
		switch c.Status {
		case StatusOK:
		case StatusWarning, StatusUnavailable:
			if c.Advice == "" {
				t.Errorf("%s is %s without advice", c.Name, c.Status)
			}
		default:
			t.Errorf("%s: status %q", c.Name, c.Status)
		}
	}
	for _, name := range []string{"rdma-build", "rdma-devices", "memlock", "pinning", "hugepages", "transparent-hugepages",
		"memfd", "shm", "data-plane ibv", "data-plane shm", "data-plane tcp", "data-plane grpc",
		"gpu-driver", "nvidia-peermem", "dma-buf", "p2pmem"} {
		if !seen[name] {
			t.Errorf("no %s check", name)
		}
	}
	// The fallback needs nothing but loopback TCP, which this test uses.
	for _, c := range rep.Checks {
		if c.Name == "data-plane grpc" && c.Status != StatusOK {
			t.Errorf("the gRPC fallback does not work on loopback: %s", c.Detail)
		}
	}
}

func TestDoctorText(t *testing.T) {
	defer leakcheck.Check(t)
	var stdout, stderr bytes.Buffer
	if code := runMain([]string{"doctor"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d, stderr %s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"tensorrpc doctor: ", "tensorrpc (devel)", "build tags: ", rpc.EnvLog, rpc.EnvSocketIfname, "memlock: ", "data-plane grpc: ", " ok, ", "\nverdict: "} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestVerdict: the last line says which planes work and whether anything
// needs doing.
func TestVerdict(t *testing.T) {
	plane := func(p string, s Status) Check { return Check{Name: "data-plane " + p, Status: s} }
	for _, tc := range []struct {
		checks []Check
		want   string
	}{
		{[]Check{plane("ibv", StatusUnavailable), plane("shm", StatusOK), plane("tcp", StatusOK), plane("grpc", StatusOK), {Name: "gpu-driver", Status: StatusUnavailable}},
			"verdict: shm, tcp, grpc work; nothing to do"},
		{[]Check{plane("shm", StatusOK), {Name: "memlock", Status: StatusWarning}},
			"verdict: shm works; look at the warnings (memlock)"},
		{[]Check{plane("shm", StatusUnavailable), plane("grpc", StatusOK)},
			"verdict: grpc works; shm failed here"},
	} {
		if got := verdict(tc.checks); !strings.HasPrefix(got, tc.want) {
			t.Errorf("verdict(%v) = %q, want it to start %q", tc.checks, got, tc.want)
		}
	}
}

func TestVersion(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := runMain([]string{"version"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"tensorrpc ", runtime.Version(), "build tags: ", "cgo: ", "session protocol "} {
		if !strings.Contains(out, want) {
			t.Errorf("version output lacks %q:\n%s", want, out)
		}
	}
}

func TestUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
	}{
		{nil, 2},
		{[]string{"bogus"}, 2},
		{[]string{"doctor", "-bogus"}, 2},
		{[]string{"doctor", "extra"}, 2},
		{[]string{"doctor", "-h"}, 0},
		{[]string{"help"}, 0},
		{[]string{"version"}, 0},
		{[]string{"version", "extra"}, 2},
	} {
		var stdout, stderr bytes.Buffer
		if code := runMain(tc.args, &stdout, &stderr); code != tc.code {
			t.Errorf("%q: exit %d, want %d", tc.args, code, tc.code)
		}
	}
}

// fixture builds a fake / with the given files.
func fixture(t *testing.T, files map[string]string) host {
	t.Helper()
	root := t.TempDir()
	for name, content := range files {
		p := filepath.Join(root, name)
		dir := filepath.Dir(p)
		if strings.HasSuffix(name, "/") { // a directory
			dir = p
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if dir == p {
			continue
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return host{root: root}
}

func TestFixtureGPUHost(t *testing.T) {
	h := fixture(t, map[string]string{
		"/sys/module/nvidia/version":                         "550.54.15\n",
		"/sys/module/nvidia_peermem/":                        "",
		"/proc/sys/kernel/osrelease":                         "6.1.0-18-amd64\n",
		"/sys/bus/pci/devices/0000:3b:00.0/p2pmem/size":      "0x4000000\n",
		"/sys/bus/pci/devices/0000:3b:00.0/p2pmem/available": "33554432\n",
		"/sys/class/infiniband/mlx5_0/":                      "",
		"/sys/class/infiniband_verbs/uverbs0/":               "",
		"/proc/meminfo":                                      "MemTotal: 100 kB\nHugePages_Total:     512\nHugePages_Free:      500\nHugepagesize:       2048 kB\n",
		"/sys/kernel/mm/transparent_hugepage/enabled":        "always madvise [never]\n",
	})
	checks := map[string]Check{}
	for _, c := range checkGPUDirect(h) {
		checks[c.Name] = c
	}
	for _, c := range []Check{checkHugepages(h), checkTransparentHugepages(h)} {
		checks[c.Name] = c
	}
	want := map[string]Status{
		"gpu-driver": StatusOK, "nvidia-peermem": StatusOK, "dma-buf": StatusOK, "p2pmem": StatusOK,
		"hugepages": StatusOK, "transparent-hugepages": StatusUnavailable,
	}
	for name, status := range want {
		if checks[name].Status != status {
			t.Errorf("%s: %+v, want %s", name, checks[name], status)
		}
	}
	if d := checks["p2pmem"].Detail; !strings.Contains(d, "0000:3b:00.0 64 MiB (32 MiB available)") {
		t.Errorf("p2pmem detail %q", d)
	}
	if d := checks["gpu-driver"].Detail; !strings.Contains(d, "550.54.15") {
		t.Errorf("gpu-driver detail %q", d)
	}
	if d := checks["hugepages"].Detail; !strings.Contains(d, "1000 MiB free") {
		t.Errorf("hugepages detail %q", d)
	}
	if detail, devices, uverbs := h.rdmaSysfs(); !devices || !uverbs || !strings.Contains(detail, "mlx5_0") {
		t.Errorf("rdmaSysfs = %q, %v, %v", detail, devices, uverbs)
	}
}

func TestFixtureBareHost(t *testing.T) {
	h := fixture(t, map[string]string{
		"/proc/sys/kernel/osrelease": "5.10.0-28-amd64\n",
		"/proc/meminfo":              "HugePages_Total:       0\nHugePages_Free:        0\nHugepagesize:       2048 kB\n",
		"/proc/self/status":          "Name:\tx\nCapEff:\t0000000000000000\n",
	})
	for _, c := range append(checkGPUDirect(h), checkHugepages(h), checkTransparentHugepages(h)) {
		if c.Status != StatusUnavailable || c.Advice == "" {
			t.Errorf("%s: %+v, want unavailable with advice", c.Name, c)
		}
	}
	if d := checkGPUDirect(h)[2].Detail; !strings.Contains(d, "5.12") {
		t.Errorf("dma-buf on 5.10: %q", d)
	}
	if detail, devices, _ := h.rdmaSysfs(); devices || !strings.Contains(detail, "does not exist") {
		t.Errorf("rdmaSysfs = %q, %v", detail, devices)
	}
	if h.capIPCLock() {
		t.Error("CAP_IPC_LOCK found in an empty set")
	}
}

func TestMemlockCheck(t *testing.T) {
	for _, tc := range []struct {
		soft uint64
		cap  bool
		want Status
	}{
		{8 << 20, false, StatusWarning},
		{8 << 20, true, StatusOK},
		{unlimited, false, StatusOK},
		{mempool.DefaultLimit, false, StatusOK},
	} {
		c := memlockCheck(tc.soft, tc.soft, tc.cap)
		if c.Status != tc.want || (c.Status != StatusOK) != (c.Advice != "") {
			t.Errorf("memlockCheck(%d, cap %v) = %+v, want %s", tc.soft, tc.cap, c, tc.want)
		}
	}
}

func TestKernelAtLeast(t *testing.T) {
	for release, want := range map[string]bool{
		"5.12.0": true, "5.11.22": false, "6.1.0-18-amd64": true, "4.19.0": false, "5.15-rc1": true, "": false, "x.y": false,
	} {
		if got := kernelAtLeast(release, 5, 12); got != want {
			t.Errorf("kernelAtLeast(%q) = %v", release, got)
		}
	}
}

// TestDoctorExplain: -explain lists, per plane and size, how a Fetch moved
// on this host; shm, tcp and grpc work on every test machine.
func TestDoctorExplain(t *testing.T) {
	defer leakcheck.Check(t)
	var stdout, stderr bytes.Buffer
	if code := runMain([]string{"doctor", "-explain", "-json"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d, stderr %s", code, stderr.String())
	}
	var es []Explained
	if err := json.Unmarshal(stdout.Bytes(), &es); err != nil {
		t.Fatal(err)
	}
	got := map[string]Explained{}
	for _, e := range es {
		got[fmt.Sprint(e.Plane, "/", e.Bytes)] = e
	}
	for key, want := range map[string]string{
		"shm/4096": "inline", "shm/1048576": "pulled", "shm/67108864": "pulled",
		"tcp/4096": "inline", "tcp/1048576": "pulled", "tcp/67108864": "pulled",
		"grpc/4096": "stream", "grpc/67108864": "stream",
	} {
		if e := got[key]; e.Moved != want || e.Err != "" {
			t.Errorf("%s: %+v, want moved %s", key, e, want)
		}
	}
	if e := got["tcp/1048576"]; e.Lanes != 1 || e.Copies != 0 {
		t.Errorf("tcp 1 MiB: %+v, want 1 lane and no copy", e)
	}
	stdout.Reset()
	if code := runMain([]string{"doctor", "-explain"}, &stdout, &stderr); code != 0 || !strings.Contains(stdout.String(), "client copies") {
		t.Errorf("exit %d, text:\n%s", code, stdout.String())
	}
}
