// Command paramserver trains a model with K parameter-server shards and P
// workers that exchange parameters and gradients over tensorrpc, and
// compares the measured step time with the communication cost model.
//
//	go run ./examples/paramserver                       # 2 shards, 4 workers, processes
//	go run ./examples/paramserver -shards 4 -workers 8 -params 1000000
//	go run ./examples/paramserver -inprocess            # everything in one process
//
// The model is linear regression on generated sparse data (see model.go):
// each worker holds its own samples, pulls the parameters from every shard
// (Client.Fetch, with rpc.WaitForKey, of the tensor the shard publishes once
// every worker has pushed the previous step), computes its gradient
// and pushes each shard its slice (Client.Call of the "push" method); a
// shard sums the P gradients of a step, applies SGD and publishes the next
// parameters (see shard.go). The loss falls to the noise variance, the
// loss of the true weights.
//
// Each step moves n parameters between every worker and the shards in each
// direction, and P·n/K through every shard, so with links of bandwidth β
// a direction takes at least max(n/β, P·n/(K·β)). The program measures β
// on the spot with a large tensor Send over the same data plane and prints
// the model beside the measured step time.
//
// By default the shards and workers are processes (this program
// re-executed, see internal/childproc); -inprocess runs them as
// goroutines, each shard with its own server on loopback.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
)

// Roles of re-executed processes.
const (
	shardRole  = "paramserver-shard"
	workerRole = "paramserver-worker"
)

// connectTimeout bounds starting a process and opening a session.
const connectTimeout = 30 * time.Second

// config is the whole job; it is passed to shard and worker processes as
// JSON.
type config struct {
	Shards, Workers int
	Params          int     // n: float32 parameters
	SamplesPerParam int     // N = SamplesPerParam·n samples in all
	NonZeros        int     // features per sample
	Steps           int     // synchronous SGD steps
	LearningRate    float64 // 0: autoLearningRate
	Noise           float64 // standard deviation of ε
	Seed            uint64
	Transports      []string // data planes the sessions may use
	BetaBytes       int      // size of the tensor β is measured with
	LogEvery        int      // print the loss every this many steps
	InProcess       bool
}

func (c *config) samples() int { return c.SamplesPerParam * c.Params }

func (c *config) learningRate() float64 {
	if c.LearningRate > 0 {
		return c.LearningRate
	}
	return autoLearningRate(c)
}

func (c *config) check() error {
	switch {
	case c.Shards < 1 || c.Workers < 1:
		return fmt.Errorf("need at least one shard and one worker")
	case c.Params < c.Shards:
		return fmt.Errorf("-params %d is fewer than -shards %d", c.Params, c.Shards)
	case c.NonZeros < 1 || c.NonZeros > c.Params:
		return fmt.Errorf("-nonzeros must be between 1 and -params")
	case c.samples() < c.Workers:
		return fmt.Errorf("fewer samples than workers")
	case c.Steps < 2:
		return fmt.Errorf("-steps must be at least 2")
	case c.BetaBytes < 4:
		return fmt.Errorf("-beta-bytes too small")
	}
	return nil
}

func defaultConfig() config {
	return config{
		Shards: 2, Workers: 4, Params: 1 << 17, SamplesPerParam: 16, NonZeros: 4, Steps: 30,
		Noise: 0.1, Seed: 1, Transports: []string{"ibv", "shm", "tcp", "grpc"}, BetaBytes: 32 << 20, LogEvery: 5,
	}
}

func main() {
	switch childproc.Role() {
	case shardRole, workerRole:
		os.Exit(child(childproc.Role(), os.Args[1:]))
	}
	cfg := defaultConfig()
	var transports string
	timeout := flag.Duration("timeout", 5*time.Minute, "give up after this long")
	flag.IntVar(&cfg.Shards, "shards", cfg.Shards, "parameter-server shards (K)")
	flag.IntVar(&cfg.Workers, "workers", cfg.Workers, "workers (P)")
	flag.IntVar(&cfg.Params, "params", cfg.Params, "float32 parameters of the model (n)")
	flag.IntVar(&cfg.SamplesPerParam, "samples-per-param", cfg.SamplesPerParam, "samples per parameter (N/n)")
	flag.IntVar(&cfg.NonZeros, "nonzeros", cfg.NonZeros, "features per sample")
	flag.IntVar(&cfg.Steps, "steps", cfg.Steps, "synchronous SGD steps")
	flag.Float64Var(&cfg.LearningRate, "lr", 0, "learning rate (default: 1/λmax estimated from the data's shape)")
	flag.Float64Var(&cfg.Noise, "noise", cfg.Noise, "standard deviation of the label noise")
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "random seed of the data")
	flag.StringVar(&transports, "transports", strings.Join(cfg.Transports, ","), "data planes the sessions may use, comma-separated")
	flag.IntVar(&cfg.BetaBytes, "beta-bytes", cfg.BetaBytes, "bytes of the tensor the bandwidth β is measured with")
	flag.IntVar(&cfg.LogEvery, "log-every", cfg.LogEvery, "print the loss every this many steps")
	flag.BoolVar(&cfg.InProcess, "inprocess", false, "run shards and workers as goroutines instead of processes")
	flag.Parse()
	if flag.NArg() > 0 {
		usage("unexpected arguments: %s", strings.Join(flag.Args(), " "))
	}
	cfg.Transports = strings.Split(transports, ",")
	if err := cfg.check(); err != nil {
		usage("%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if _, err := run(ctx, &cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "paramserver:", err)
		os.Exit(1)
	}
}

func usage(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "paramserver: "+format+"\n", args...)
	flag.Usage()
	os.Exit(2)
}

// child runs a shard or worker process. Its arguments are the job's JSON
// config, its index and, for a worker, the shards' addresses.
func child(role string, args []string) int {
	fs := flag.NewFlagSet(role, flag.ContinueOnError)
	cfgJSON := fs.String("config", "", "the job, as JSON")
	index := fs.Int("index", 0, "shard or worker index")
	addrs := fs.String("shards", "", "shard addresses, comma-separated")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	var cfg config
	if err := json.Unmarshal([]byte(*cfgJSON), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "%s: -config: %v\n", role, err)
		return 2
	}
	var err error
	switch role {
	case shardRole:
		err = serveShard(&cfg, *index)
	case workerRole:
		// The worker ends with its last step, or early when told to stop.
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			childproc.WaitForStop()
			cancel()
		}()
		err = runWorker(ctx, &cfg, *index, strings.Split(*addrs, ","))
		cancel()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s %d: %v\n", role, *index, err)
		return 1
	}
	return 0
}

// serveShard is a shard process: it prints its address and serves until
// its stdin closes.
func serveShard(cfg *config, k int) error {
	s, addr, err := startShard(cfg, k)
	if err != nil {
		return err
	}
	fmt.Println(addr)
	childproc.WaitForStop()
	return s.close()
}
