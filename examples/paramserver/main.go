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
//
// # Launched shards and workers
//
// The shards and workers can also be started one by one, by hand or by a
// launcher (mpirun, a job scheduler, ssh), on one host or several. Each is
// given the job's flags (the same for all: the workers check that the
// shards run their job), its role and index, and the shards' addresses:
//
//	-role shard  -index K -shards HOST:PORT,...   shard K listens on the K-th address
//	-role worker -index I -shards HOST:PORT,...
//
// -workers says how many workers there are; -shards, given addresses,
// says how many shards. The addresses are all a process needs, so there is
// no environment to read and no store: workers dial the shards, which
// dial nobody. Each shard address must be one its host listens on and
// every worker reaches (127.0.0.1 on one host; a shard may listen
// elsewhere with -listen, as on 0.0.0.0:PORT). Processes may start in any
// order: workers wait for the shards until -timeout. Worker 0 measures β,
// prints the losses and the summary, and then stops the shards; every
// process exits 0 when the job succeeded. Two hosts, shards on 10.0.0.1,
// workers on both:
//
//	go build -o paramserver ./examples/paramserver
//	job="-shards 10.0.0.1:29600,10.0.0.1:29601 -workers 2"
//	10.0.0.1$ ./paramserver -role shard -index 0 $job & ./paramserver -role shard -index 1 $job &
//	10.0.0.1$ ./paramserver -role worker -index 0 $job
//	10.0.0.2$ ./paramserver -role worker -index 1 $job
//
// When worker 0 fails, it stops the shards, which ends the other workers.
// When another worker fails, or any worker dies without a word (killed,
// crashed), its sessions with the shards end: each shard notices within
// about 2 s, fails ("worker i left") and exits, which ends the others.
// Only a process whose host drops off the network, leaving its
// connections open, leaves the others waiting until -timeout.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
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
	os.Exit(command(os.Args[1:], os.Stdout))
}

// shardsFlag is -shards: a number of shards, which this program starts, or
// the addresses of shards started with -role shard.
type shardsFlag struct {
	count *int
	addrs []string
}

func (f *shardsFlag) String() string {
	if f.count == nil {
		return ""
	}
	if f.addrs != nil {
		return strings.Join(f.addrs, ",")
	}
	return strconv.Itoa(*f.count)
}

func (f *shardsFlag) Set(v string) error {
	if n, err := strconv.Atoi(v); err == nil {
		*f.count, f.addrs = n, nil
		return nil
	}
	f.addrs = strings.Split(v, ",")
	for _, a := range f.addrs {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return fmt.Errorf("neither a number of shards nor HOST:PORT,...: %v", err)
		}
	}
	*f.count = len(f.addrs)
	return nil
}

// command is the program the user runs, with its arguments; it returns
// the exit status.
func command(args []string, stdout io.Writer) int {
	fs := flag.NewFlagSet("paramserver", flag.ContinueOnError)
	cfg := defaultConfig()
	var transports string
	shards := &shardsFlag{count: &cfg.Shards}
	timeout := fs.Duration("timeout", 5*time.Minute, "give up after this long")
	fs.Var(shards, "shards", "parameter-server shards (K) to start, or the HOST:PORT,... list of shards started with -role (default 2)")
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "workers (P)")
	fs.IntVar(&cfg.Params, "params", cfg.Params, "float32 parameters of the model (n)")
	fs.IntVar(&cfg.SamplesPerParam, "samples-per-param", cfg.SamplesPerParam, "samples per parameter (N/n)")
	fs.IntVar(&cfg.NonZeros, "nonzeros", cfg.NonZeros, "features per sample")
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "synchronous SGD steps")
	fs.Float64Var(&cfg.LearningRate, "lr", 0, "learning rate (default: 1/λmax estimated from the data's shape)")
	fs.Float64Var(&cfg.Noise, "noise", cfg.Noise, "standard deviation of the label noise")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "random seed of the data")
	fs.StringVar(&transports, "transports", strings.Join(cfg.Transports, ","), "data planes the sessions may use, comma-separated")
	fs.IntVar(&cfg.BetaBytes, "beta-bytes", cfg.BetaBytes, "bytes of the tensor the bandwidth β is measured with")
	fs.IntVar(&cfg.LogEvery, "log-every", cfg.LogEvery, "print the loss every this many steps")
	fs.BoolVar(&cfg.InProcess, "inprocess", false, "run shards and workers as goroutines instead of processes")
	role := fs.String("role", "", "run one launched process: shard or worker (with -index and -shards HOST:PORT,...)")
	index := fs.Int("index", 0, "the launched shard's or worker's index")
	listen := fs.String("listen", "", "HOST:PORT a launched shard listens on (default: its address in -shards)")
	usage := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "paramserver: "+format+"\n", args...)
		fs.Usage()
		return 2
	}
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return 0
	} else if err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		return usage("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	cfg.Transports = strings.Split(transports, ",")
	if err := cfg.check(); err != nil {
		return usage("%v", err)
	}
	var l *launch
	switch *role {
	case "":
		if shards.addrs != nil {
			return usage("-shards HOST:PORT,... is for launched processes: give -role shard or -role worker")
		}
	case "shard", "worker":
		l = &launch{role: *role, index: *index, shards: shards.addrs, listen: *listen}
		if err := l.check(&cfg); err != nil {
			return usage("%v", err)
		}
	default:
		return usage("-role is shard or worker, not %q", *role)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	var err error
	if l != nil {
		err = runLaunched(ctx, &cfg, l, stdout)
	} else {
		_, err = run(ctx, &cfg, stdout)
	}
	if err != nil {
		name := "paramserver"
		if l != nil {
			name = fmt.Sprintf("paramserver %s %d", l.role, l.index)
		}
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return 1
	}
	return 0
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
