// Command allreduce sums a vector across P processes with a ring
// all-reduce over tensorrpc, checks that the sum is exact and that each
// process sent the 2(P−1)/P·n bytes the algorithm needs, and reports its
// bandwidth.
//
//	go run ./examples/allreduce                    # 4 processes, 16 Mi float32
//	go run ./examples/allreduce -p 8 -n 1000000 -iters 10
//
// Every rank runs an rpc.Server and dials its right neighbour's. The vector
// is cut into P chunks. In the reduce-scatter phase, at step s, rank r
// sends chunk (r−s) mod P to its right neighbour (Client.Send into the
// neighbour's rendezvous under "<iter>/rs/<s>") and takes chunk (r−s−1)
// mod P from its own (Server.Take of the same key from its left
// neighbour, with rpc.WaitForKey, since the neighbour may not have sent it
// yet), adding it to its copy; after P−1 steps rank r holds the full
// sum of chunk (r+1) mod P. The all-gather phase passes the summed chunks
// around the ring the same way, P−1 more steps, replacing instead of
// adding.
//
// Each rank's Server and Client share one pool (rpc.WithPool), so a chunk
// received by the server can be sent on by the client without a copy.
//
// The data are integers stored as float32, small enough that every partial
// sum is exact, so the result is compared for equality. The program prints
// the algorithm bandwidth (n·4 bytes / time) and the bus bandwidth
// (algbw · 2(P−1)/P), as NCCL's tests do.
//
// # Launched ranks: one process each, as torchrun starts them
//
// By default the command starts the P ranks itself, as processes on this
// host, and tells them each other's addresses. Ranks can instead be
// started one by one, by hand or by a launcher (torchrun --no-python,
// mpirun, a job scheduler, ssh), on one host or several. Each is told its
// rank, the number of ranks and rank 0's address, by flags or by the
// environment torchrun sets; a flag wins over its variable:
//
//	-rank R             RANK
//	-world P            WORLD_SIZE
//	-master HOST:PORT   MASTER_ADDR and MASTER_PORT
//
// Every rank must be given the same -n and -iters (rank 0 checks) and
// started within -timeout of the others, in any order. One host, three
// ranks, from the environment:
//
//	go build -o allreduce ./examples/allreduce
//	export WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
//	RANK=1 ./allreduce -n 1000000 & RANK=2 ./allreduce -n 1000000 &
//	RANK=0 ./allreduce -n 1000000
//
// Two hosts, 10.0.0.1 with ranks 0 and 1 and 10.0.0.2 with ranks 2 and 3,
// with flags:
//
//	10.0.0.1$ ./allreduce -rank 0 -world 4 -master 10.0.0.1:29500 & ./allreduce -rank 1 -world 4 -master 10.0.0.1:29500
//	10.0.0.2$ ./allreduce -rank 2 -world 4 -master 10.0.0.1:29500 & ./allreduce -rank 3 -world 4 -master 10.0.0.1:29500
//
// MASTER_ADDR must be an address of rank 0's host that every rank reaches:
// 127.0.0.1 on one host, the host's address on the network between them
// otherwise. Rank 0's ring server listens on MASTER_ADDR:MASTER_PORT
// (-listen overrides where it listens; the others still dial the master
// address). Every other rank listens on a free port of the address its
// host reaches MASTER_ADDR from (the local address of a TCP connection to
// it, the rule tensorrpc's tcp data plane uses; -listen HOST:PORT
// overrides). So MASTER_PORT and those ports, and the data planes' (see
// package rpc), must be open between the hosts.
//
// Under torchrun, MASTER_PORT may be torchrun's own store (it says so
// with TORCHELASTIC_USE_AGENT_STORE=True, and then the command refuses
// it): give every rank rank 0's address and a port of its own, as in
// `torchrun --no-python --nproc_per_node 4 ./allreduce -master 127.0.0.1:29501`.
//
// Rank 0's server doubles as the job's store (a tensorrpc rendezvous, see
// launch.go): the ranks publish their addresses there, meet at a barrier
// before each all-reduce and send it their results; rank 0 prints the
// summary the default mode prints and exits 1 when a result is wrong or a
// rank's traffic is off, and the other ranks exit 0 once it has. A rank
// that fails tells rank 0, which then fails at once. A rank that dies
// without a word (killed, crashed) ends its session with rank 0's store,
// and rank 0 fails about 2 s later; only a rank whose host drops off the
// network, leaving its connections open, leaves the others waiting until
// -timeout.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
)

// rankRole is the role of a re-executed rank process.
const rankRole = "allreduce-rank"

// connectTimeout bounds starting a rank and opening its session.
const connectTimeout = 30 * time.Second

// config is the job; ranks receive it as flags.
type config struct {
	Ranks      int      // P
	Elements   int      // n: float32 elements of the vector
	Iters      int      // timed all-reduces, after one warm-up
	Transports []string // data planes the sessions may use
}

func (c *config) check() error {
	switch {
	case c.Ranks < 2:
		return fmt.Errorf("-p must be at least 2")
	case c.Elements < c.Ranks:
		return fmt.Errorf("-n must be at least -p")
	case c.Iters < 1:
		return fmt.Errorf("-iters must be at least 1")
	case float64(c.Ranks)*maxValue >= 1<<24:
		return fmt.Errorf("-p %d is too large for exact float32 sums", c.Ranks)
	}
	return nil
}

func main() {
	if childproc.Role() == rankRole {
		os.Exit(rankMain(os.Args[1:]))
	}
	os.Exit(command(os.Args[1:], os.Getenv, os.Stdout))
}

// command is the program the user runs, with its arguments and
// environment; it returns the exit status.
func command(args []string, getenv func(string) string, stdout io.Writer) int {
	fs := flag.NewFlagSet("allreduce", flag.ContinueOnError)
	cfg := config{Ranks: 4, Elements: 1 << 24, Iters: 5}
	transports := fs.String("transports", "ibv,shm,tcp,grpc", "data planes the sessions may use, comma-separated")
	timeout := fs.Duration("timeout", 5*time.Minute, "give up after this long")
	fs.IntVar(&cfg.Ranks, "p", cfg.Ranks, "processes in the ring, started by this one (not with -rank)")
	fs.IntVar(&cfg.Elements, "n", cfg.Elements, "float32 elements to all-reduce")
	fs.IntVar(&cfg.Iters, "iters", cfg.Iters, "timed all-reduces (after one warm-up)")
	fs.Int("rank", 0, "run as this launched rank (default $RANK); -world and -master say where the others are")
	fs.Int("world", 0, "launched ranks in the ring (default $WORLD_SIZE)")
	fs.String("master", "", "HOST:PORT where rank 0 listens, an address every rank reaches (default $MASTER_ADDR:$MASTER_PORT)")
	fs.String("listen", "", "HOST:PORT this launched rank listens on (default: rank 0 the master address, others their address toward it, port 0)")
	usage := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "allreduce: "+format+"\n", args...)
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
	set := map[string]string{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = f.Value.String() })
	l, err := resolveLaunch(set, getenv)
	if err != nil {
		return usage("%v", err)
	}
	if l == nil {
		for _, name := range []string{"world", "master", "listen"} {
			if _, ok := set[name]; ok {
				return usage("-%s is for launched ranks: give -rank too (or set RANK)", name)
			}
		}
	} else {
		if _, ok := set["p"]; ok && cfg.Ranks != l.world {
			return usage("-p %d and the world size %d differ: a launched rank takes -world (or WORLD_SIZE)", cfg.Ranks, l.world)
		}
		cfg.Ranks = l.world
	}
	cfg.Transports = strings.Split(*transports, ",")
	if err := cfg.check(); err != nil {
		return usage("%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if l != nil {
		err = runLaunched(ctx, &cfg, l, stdout)
	} else {
		_, err = run(ctx, &cfg, stdout)
	}
	if err != nil {
		name := "allreduce"
		if l != nil {
			name = fmt.Sprintf("allreduce rank %d", l.rank)
		}
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return 1
	}
	return 0
}
