package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// commandRole is the test binary run as the paramserver command, as a
// user or a launcher starts it.
const commandRole = "paramserver-command"

// stderrToStdout, set in a command's environment, sends its errors to its
// stdout, which the test reads.
const stderrToStdout = "PARAMSERVER_TEST_STDERR_TO_STDOUT"

// TestMain lets the test binary play a shard or a worker when paramserver
// re-executes it, and the command when a test starts it as a launched
// shard or worker.
func TestMain(m *testing.M) {
	switch childproc.Role() {
	case shardRole, workerRole:
		os.Exit(child(childproc.Role(), os.Args[1:]))
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

func smallConfig() config {
	cfg := defaultConfig()
	cfg.Shards, cfg.Workers = 2, 3
	cfg.Params = 4096
	cfg.Steps = 25
	cfg.BetaBytes = 4 << 20
	return cfg
}

func runSmall(t *testing.T, cfg config) *summary {
	t.Helper()
	if err := cfg.check(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	var out bytes.Buffer
	sum, err := run(ctx, &cfg, &out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(sum.Losses) != cfg.Steps {
		t.Fatalf("%d losses for %d steps", len(sum.Losses), cfg.Steps)
	}
	if sum.StepTime <= 0 || sum.Beta <= 0 || sum.Model <= 0 {
		t.Errorf("timing not measured: %+v", sum)
	}
	return sum
}

// TestConverges trains in one process and checks that the loss falls to
// the noise: below the loss of the true weights (the least-squares
// optimum lies a little under it) and far below where it started.
func TestConverges(t *testing.T) {
	defer leakcheck.Check(t)
	cfg := smallConfig()
	cfg.InProcess = true
	sum := runSmall(t, cfg)
	first, last := sum.Losses[0], sum.Losses[len(sum.Losses)-1]
	if sum.LossAtOptimum <= 0 {
		t.Fatalf("loss at w* = %v", sum.LossAtOptimum)
	}
	if last > 1.01*sum.LossAtOptimum {
		t.Errorf("final loss %v, want at most 1.01 × L(w*) = %v", last, 1.01*sum.LossAtOptimum)
	}
	if first < 100*last {
		t.Errorf("loss fell only from %v to %v", first, last)
	}
	for i := 1; i < len(sum.Losses); i++ {
		if sum.Losses[i] > sum.Losses[i-1]*(1+1e-4) {
			t.Errorf("loss rose at step %d: %v → %v", i, sum.Losses[i-1], sum.Losses[i])
		}
	}
}

// TestProcesses runs a few steps with the shards and workers as processes.
func TestProcesses(t *testing.T) {
	defer leakcheck.Check(t)
	cfg := smallConfig()
	cfg.Steps = 6
	sum := runSmall(t, cfg)
	if sum.Losses[len(sum.Losses)-1] >= sum.Losses[0] {
		t.Errorf("loss did not fall: %v", sum.Losses)
	}
}

func TestConfigCheck(t *testing.T) {
	for _, bad := range []func(*config){
		func(c *config) { c.Shards = 0 },
		func(c *config) { c.Params = 1 },
		func(c *config) { c.NonZeros = 0 },
		func(c *config) { c.Steps = 1 },
	} {
		cfg := defaultConfig()
		bad(&cfg)
		if cfg.check() == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
}

// TestLaunched starts two shards and three workers as separate processes,
// as a launcher would, each given only its role, its index and the
// shards' addresses, workers before shards; worker 0 prints the summary
// and every process exits by itself.
func TestLaunched(t *testing.T) {
	var addrs []string
	for range 2 {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(lis.Addr().(*net.TCPAddr).Port))
		lis.Close()
	}
	job := []string{"-shards", strings.Join(addrs, ","), "-workers", "3", "-params", "4096", "-steps", "6",
		"-beta-bytes", "4194304", "-timeout", "40s"}
	var procs []*childproc.Process
	for _, p := range [][]string{{"worker", "0"}, {"worker", "1"}, {"shard", "1"}, {"worker", "2"}, {"shard", "0"}} {
		args := append([]string{"-role", p[0], "-index", p[1]}, job...)
		procs = append(procs, childtest.Start(t, commandRole, childproc.Options{Args: args}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := childtest.Job(ctx, t, procs)
	for _, want := range []string{"(launched processes)", "β = ", "final loss", "cost model"} {
		if !strings.Contains(out, want) {
			t.Errorf("worker 0 did not print %q", want)
		}
	}
}

// TestLaunchedWorkerDies: a worker killed while the job waits for it
// (here for worker 0's start, which never comes) fails its shard when the
// shard sees its session end, not at -timeout.
func TestLaunchedWorkerDies(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	job := []string{"-shards", addr, "-workers", "3", "-params", "4096", "-steps", "6", "-timeout", "5m"}
	shard := childtest.Start(t, commandRole, childproc.Options{
		Args: append([]string{"-role", "shard", "-index", "0"}, job...), Env: []string{stderrToStdout + "=1"}})
	worker := childtest.Start(t, commandRole, childproc.Options{Args: append([]string{"-role", "worker", "-index", "1"}, job...)})

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out strings.Builder
	killed := false
	for {
		l, err := shard.ReadLine(ctx)
		if errors.Is(err, childproc.ErrExited) {
			break
		}
		if err != nil {
			t.Fatalf("the shard went on after worker 1 was killed: %v; it printed:\n%s", err, out.String())
		}
		out.WriteString(l + "\n")
		if strings.Contains(l, "worker 1 joined") {
			worker.Kill()
			killed = true
		}
	}
	if err := shard.Wait(); err == nil || !killed {
		t.Fatalf("the shard exited (%v) before worker 1 was killed or without failing; it printed:\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "worker 1 left") {
		t.Fatalf("the shard failed without naming worker 1; it printed:\n%s", out.String())
	}
	t.Log("the shard printed:\n" + out.String())
}

func TestShardsFlag(t *testing.T) {
	var n int
	f := &shardsFlag{count: &n}
	if err := f.Set("3"); err != nil || n != 3 || f.addrs != nil {
		t.Fatalf("-shards 3: %v, %d, %v", err, n, f.addrs)
	}
	if err := f.Set("h1:1,[fd00::1]:2"); err != nil || n != 2 || len(f.addrs) != 2 {
		t.Fatalf("-shards h1:1,[fd00::1]:2: %v, %d, %v", err, n, f.addrs)
	}
	if err := f.Set("h1"); err == nil {
		t.Fatal("-shards h1 accepted")
	}
}
