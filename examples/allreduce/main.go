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
package main

import (
	"context"
	"flag"
	"fmt"
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
	cfg := config{Ranks: 4, Elements: 1 << 24, Iters: 5}
	transports := flag.String("transports", "ibv,shm,tcp,grpc", "data planes the sessions may use, comma-separated")
	timeout := flag.Duration("timeout", 5*time.Minute, "give up after this long")
	flag.IntVar(&cfg.Ranks, "p", cfg.Ranks, "processes in the ring")
	flag.IntVar(&cfg.Elements, "n", cfg.Elements, "float32 elements to all-reduce")
	flag.IntVar(&cfg.Iters, "iters", cfg.Iters, "timed all-reduces (after one warm-up)")
	flag.Parse()
	if flag.NArg() > 0 {
		usage("unexpected arguments: %s", strings.Join(flag.Args(), " "))
	}
	cfg.Transports = strings.Split(*transports, ",")
	if err := cfg.check(); err != nil {
		usage("%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if _, err := run(ctx, &cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "allreduce:", err)
		os.Exit(1)
	}
}

func usage(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "allreduce: "+format+"\n", args...)
	flag.Usage()
	os.Exit(2)
}
