package main

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestMain lets the test binary play a shard or a worker when paramserver
// re-executes it.
func TestMain(m *testing.M) {
	switch childproc.Role() {
	case shardRole, workerRole:
		os.Exit(child(childproc.Role(), os.Args[1:]))
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
