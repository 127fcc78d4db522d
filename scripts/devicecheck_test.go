// Package scripts_test checks the scripts that run outside Go's tooling:
// scripts/device-check.sh, which the GPU machine runs (docs/DEVICE.md), and
// its summary. Nothing here needs a GPU: the dry runs only list, and the
// summary is made from the H100 run committed in benchmarks/results.
package scripts_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/testenv"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// deviceCheck runs scripts/device-check.sh from the repository root.
func deviceCheck(t *testing.T, args ...string) string {
	t.Helper()
	if _, err := exec.LookPath("bash"); err != nil {
		testenv.Need(t, "bash is not installed")
	}
	cmd := exec.Command("bash", append([]string{"scripts/device-check.sh"}, args...)...)
	cmd.Dir = ".."
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("device-check.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestDeviceCheckDryRun checks that both modes' dry runs list what they
// would build and run, and create nothing.
func TestDeviceCheckDryRun(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "devbin")
	build := deviceCheck(t, "build", dir, "--dry-run")
	for _, want := range []string{"gpudirect.test", "rpc.test", "otel.test", "tensorbench", "handoffs", "streams", "devbench", "allreduce",
		"-buildmode=c-shared -o " + dir + "/bin/libtensorrpc.so", "gopeer", "tar cJf"} {
		if !strings.Contains(build, want) {
			t.Errorf("build --dry-run does not mention %q:\n%s", want, build)
		}
	}
	run := deviceCheck(t, "run", dir, "--dry-run")
	for _, step := range []string{"facts", "gpudirect-tests", "rpc-tests", "cuda-check", "devbench", "bench-cuda",
		"handoffs", "streams", "copyshare", "tensorbench", "python-spin", "otel", "allreduce", "summary"} {
		if !strings.Contains(run, "\n"+step+" ") {
			t.Errorf("run --dry-run does not list the step %s:\n%s", step, run)
		}
	}
	if !strings.Contains(run, "-streams 16 -size 1048576 -cases fetch-tcp,fetch-shm") {
		t.Errorf("run --dry-run does not count the hand-offs of 16 streams:\n%s", run)
	}
	if !strings.Contains(run, "TENSORRPC_TEST_CUDA=real") {
		t.Errorf("run --dry-run does not run the Go tests on the real driver:\n%s", run)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("a dry run created %s (stat: %v)", dir, err)
	}
}

// summarize runs the summary over stepDir and returns summary.md.
func summarize(t *testing.T, stepDir string, noGPU string) string {
	t.Helper()
	python, err := exec.LookPath("python3")
	if err != nil {
		testenv.Need(t, "python3 is not installed")
	}
	out := t.TempDir()
	cmd := exec.Command(python, "device_check_summary.py", stepDir, out, noGPU)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("device_check_summary.py: %v\n%s", err, b)
	}
	md, err := os.ReadFile(filepath.Join(out, "summary.md"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(out, "results.jsonl")); err != nil {
		t.Error(err)
	}
	return string(md)
}

// TestDeviceCheckSummaryNoGPU checks that a run that had nothing to
// measure says why instead of failing.
func TestDeviceCheckSummaryNoGPU(t *testing.T) {
	steps := t.TempDir()
	if err := os.WriteFile(filepath.Join(steps, "steps.tsv"), []byte("devbench\tskipped\t\t0\tno GPU: nvidia-smi lists none\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	md := summarize(t, steps, "no GPU: nvidia-smi lists none")
	for _, want := range []string{"**no GPU: nvidia-smi lists none**", "not measured: devbench skipped (no GPU: nvidia-smi lists none)", "0 goals met"} {
		if !strings.Contains(md, want) {
			t.Errorf("summary.md lacks %q:\n%s", want, md)
		}
	}
}

// TestDeviceCheckSummaryTimelines: the summary lays out handoffs'
// timelines, when its JSON lines have them (session 17's, 2 cores).
func TestDeviceCheckSummaryTimelines(t *testing.T) {
	summarizeHandoffs(t, "handoffs-2core-session17-2026-11-27.jsonl",
		"fetch-tcp: the scheduler's events in a call, as 2959 of 3000 calls went",
		"| 1 | 2.1 | 2.1 | syscall verbs/tcp.(*frameBatch).flush |",
		"| 23 | 27.6 | 0.1 | run rpc/internal/engine.(*bell).wait |",
		"pingpong-tcp: the scheduler's events in a call",
	)
}

// summarizeHandoffs makes the summary of a handoffs run committed in
// benchmarks/results and checks that summary.md has each of wants.
func summarizeHandoffs(t *testing.T, results string, wants ...string) {
	t.Helper()
	steps := t.TempDir()
	b, err := os.ReadFile(filepath.Join("..", "benchmarks", "results", results))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(steps, "handoffs.jsonl"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	md := summarize(t, steps, "")
	for _, want := range wants {
		if !strings.Contains(md, want) {
			t.Errorf("summary.md lacks %q:\n%s", want, md)
		}
	}
}

// TestDeviceCheckSummaryStreams: handoffs' lines with -streams are shown
// for their numbers, and the hand-off goals and timelines take the
// sequential 4 KiB lines wherever they are in the file (session 31's, 2
// cores: the streams and 1 MiB lines come first).
func TestDeviceCheckSummaryStreams(t *testing.T) {
	summarizeHandoffs(t, "handoffs-streams-2core-session31.jsonl",
		"| hand-offs per 4 KiB call, fetch-tcp (idle-P starts) | 3.01 (0.01) |",
		"| hand-offs per 4 KiB call, fetch-shm (idle-P starts) | 0.06 (0.00) |",
		"| hand-offs per 1 MiB Fetch, 4 streams on one session, fetch-shm (µs a call, all streams) | 2.71 (83.8 µs) |",
		"| hand-offs per 1 MiB Fetch, 4 streams on one session, fetch-tcp (µs a call, all streams) | 3.85 (351.2 µs) |",
		"fetch-tcp: the scheduler's events in a call, as ",
	)
}

// TestDeviceCheckSummaryH100 makes the summary of the H100 run committed
// in benchmarks/results and checks goals of each kind.
func TestDeviceCheckSummaryH100(t *testing.T) {
	steps := t.TempDir()
	for from, to := range map[string]string{
		"devbench-h100-session10b-2026-11-27.jsonl":      "devbench.jsonl",
		"bench-cuda-h100-session10-2026-11-27.jsonl":     "bench-cuda.jsonl",
		"handoffs-16core-session10-end-2026-11-27.jsonl": "handoffs.jsonl",
		"column-16core-session10-end-2026-11-27.jsonl":   "tensorbench.jsonl",
		"python-16core-session10-2026-11-27.jsonl":       "python-spin50.jsonl",
	} {
		b, err := os.ReadFile(filepath.Join("..", "benchmarks", "results", from))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(steps, to), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	allreduce := "allreduce-run plane=tcp p=4\ntime 38.90 ms per all-reduce (mean of 5, slowest rank); algbw 1.725 GB/s, busbw 2.587 GB/s\n" +
		"allreduce-run plane=gloo p=4\ngloo all_reduce: 4 processes, n = 16777216 float32 (64 MiB), 5 timed: 54.20 ms, algbw 1.24 GB/s, busbw 1.86 GB/s\n"
	if err := os.WriteFile(filepath.Join(steps, "allreduce.log"), []byte(allreduce), 0o644); err != nil {
		t.Fatal(err)
	}
	// The otel step's benchmark line, as the 2-core VM printed it
	// (session 15, -test.benchtime 45000x).
	otel := "BenchmarkFetch4KiBTwoProcesses-2   \t   45000\t   4265331 ns/op\t        31.19 metrics-only-cpu-µs\t        45.98 metrics-only-p50-µs\t         1.166 metrics-only/off\t         1.165 metrics-only/off-paired\t        29.95 nothing-cpu-µs\t        41.33 nothing-p50-µs\t         1.048 nothing/off\t         1.048 nothing/off-paired\t        28.71 off-cpu-µs\t        39.43 off-p50-µs\t        32.83 sampled-1pct-cpu-µs\t        50.85 sampled-1pct-p50-µs\t         1.290 sampled-1pct/off\t         1.291 sampled-1pct/off-paired\n"
	if err := os.WriteFile(filepath.Join(steps, "otel.log"), []byte(otel), 0o644); err != nil {
		t.Fatal(err)
	}
	md := summarize(t, steps, "")
	for _, want := range []string{
		"| 4 KiB Fetch p50 with telemetry (metrics only) / without, two processes | 46.0 µs | 39.4 µs (off) | 1.17 | ≤ 1.15 | **no** |",
		"| 4 KiB Fetch p50 with telemetry (1% of traces sampled) / without, two processes | 50.9 µs | 39.4 µs (off) | 1.29 | ≤ 1.15 | **no** |",
		"| gpudirect pinned htod / torch pinned, 256 MiB | 54.9 GB/s | 54.9 GB/s | 1.00 | ≥ 0.8 | yes |",
		"| staged FetchToDevice tcp / min(tcp Fetch, pinned copy), 1024 MiB | 16.1 GB/s | 16.7 GB/s (min(fetch-tcp, pinned-htod)) | 0.96 | ≥ 0.8 | yes |",
		"| CUDA IPC / PyTorch RPC cuda→cuda, 256 MiB | 160.8 GB/s | 74.0 GB/s (torch RPC) | 2.17 | ≥ 1.5 | yes |",
		"| Python CUDA fetch p50 / PyTorch RPC p50, 1 MiB | 288 µs | 677 µs (torch RPC) | 0.43 | ≤ 0.25 | **no** |",
		"| tcp Fetch, 16 streams, 64 MiB / raw sockets | 18.71 GB/s | 25.35 GB/s (tcp-socket) | 0.77 | ≥ 0.7 | yes |",
		"| 4 KiB Calls/s, 16 callers, call-rate / gRPC unary | 110357 calls/s | 45480 calls/s | 2.42 | ≥ 6 | **no** |",
		"| hand-offs per 4 KiB call, fetch-shm (idle-P starts) | 0.07 (1.07) |",
		"| Python / Go p50, shm, 4 KiB (poll 50 µs) | 47.9 µs | 17.5 µs (Go) | 2.73 | ≤ 1.5 | **no** |",
		"| PyTorch RPC p50 / Python p50, tcp, 16 MiB | 2095.0 µs | 6250.5 µs (torch RPC) | 2.98 | ≥ 1.5 | yes |",
		"| all-reduce tcp, P = 4, Gloo time / ours | 38.90 ms | 54.20 ms (Gloo) | 1.39 | ≥ 1.5 | **no** |",
		"| all-reduce shm, P = 4, Gloo time / ours | — | — | — | ≥ 1.5 | not measured: step allreduce did not run |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("summary.md lacks the line\n%s\nin:\n%s", want, md)
		}
	}
}
