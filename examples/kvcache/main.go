// Command kvcache moves the blocks of a paged KV cache between a prefill
// process and a decode process, the way disaggregated LLM serving does,
// with tensorrpc's rows of a published tensor: Fetch with rpc.Rows and
// rpc.Into, and Client.SendRows.
//
//	go run ./examples/kvcache                          # 4096 blocks of 64 KiB, 256 per request
//	go run ./examples/kvcache -blocks 1024 -block-bytes 16KiB -requests 64
//	go run ./examples/kvcache -transports tcp,grpc
//
// The prefill owns the cache, one tensor [blocks, block bytes] of uint8
// from its server's pool (Server.NewTensor), filled with a pattern per
// block, and publishes it with rpc.Writable(): a tensor from NewTensor
// is published without a copy, so the prefill sees the rows clients
// write. The decode serves requests, each of -request-blocks distinct
// blocks drawn at random (a fixed -seed). For each it fetches the
// request's blocks in one call,
//
//	c.Fetch(ctx, "kv", rpc.Rows(ids...), rpc.Into(cache))
//
// into its own preallocated decode cache, a tensor [request blocks, block
// bytes] from its client's pool: the blocks land contiguously, block
// ids[j] at row j, in the order of the request (a Rows fetch is
// [len(ids), ...], and Into takes the whole of it), which is the gathered
// layout a decode step reads. It then writes a new version of every block
// back to its place on the prefill, c.SendRows(ctx, "kv", ids, cache).
//
// For each data plane (-transports: tcp, shm, grpc; ibv with an RDMA NIC
// and -tags rdma) the decode opens a session restricted to it and prints
// blocks/s and GB/s of the Rows fetch and of the write-back, beside two
// baselines measured in the same run on the same session, request by
// request alternating with it: one Fetch per block (as many Fetches as
// the request has blocks, of one-block tensors the prefill publishes),
// and one Fetch of a tensor of as many blocks back to back (the ceiling
// of a scattered read: the same bytes, contiguous). On tcp and shm the
// Rows fetch is one request and then one batch of Reads of the prefill's
// memory (consecutive rows merge into one Read), where one Fetch per
// block is a round trip per block; on grpc the prefill gathers the rows
// into one tensor (a copy) and streams it.
//
// Every block fetched is checked against its pattern, which names the
// block and its version (see blocks.go): a wrong row, a stale version or a
// write-back that did not land fails the run. At the end the prefill
// checks its own cache tensor against every version the decode wrote.
//
// By default this process is the decode, and it starts the prefill as a
// child process (this program re-executed, see internal/childproc) on
// loopback.
//
// # Launched prefill and decode
//
// The two can also be started separately, by hand or by a launcher, on
// one host or two; give both the same -blocks, -block-bytes and
// -request-blocks (the decode checks):
//
//	go build -o kvcache ./examples/kvcache
//	10.0.0.1$ ./kvcache -role prefill -listen 10.0.0.1:29700
//	10.0.0.2$ ./kvcache -role decode -prefill 10.0.0.1:29700 -transports tcp,grpc
//
// The decode waits for the prefill until -timeout, and stops it when
// done; both exit 0 when the run succeeded. A prefill whose decode dies
// without a word (killed, crashed) sees its session end and fails about
// 2 s later. Between hosts shm does not connect (it is listed with the
// reason), and the tcp data plane uses the address the decode reached
// the prefill's gRPC port on (see package rpc for other networks).
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
	"strings"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// prefillRole is the role of the re-executed prefill process.
const prefillRole = "kvcache-prefill"

// connectTimeout bounds starting the prefill and opening a session.
const connectTimeout = 30 * time.Second

// config is the run; the prefill child receives it as JSON.
type config struct {
	Blocks        int // blocks of the prefill's cache
	BlockBytes    int // bytes of a block
	RequestBlocks int // distinct blocks a request fetches
	Requests      int // timed requests per operation and data plane
	Seed          uint64
	Transports    []string // data planes the decode measures, in order
}

func defaultConfig() config {
	return config{Blocks: 4096, BlockBytes: 64 << 10, RequestBlocks: 256, Requests: 32, Seed: 1,
		Transports: []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC}}
}

func (c *config) check() error {
	switch {
	case c.Blocks < 1 || c.Blocks >= 1<<31:
		return fmt.Errorf("-blocks %d: want 1 to 2³¹−1", c.Blocks)
	case c.BlockBytes < 8 || c.BlockBytes%8 != 0:
		return fmt.Errorf("-block-bytes %d: want a positive multiple of 8 bytes (the pattern is 8-byte words)", c.BlockBytes)
	case c.RequestBlocks < 1 || c.RequestBlocks > c.Blocks:
		return fmt.Errorf("-request-blocks %d: want 1 to -blocks (%d): a request's blocks are distinct", c.RequestBlocks, c.Blocks)
	case c.RequestBlocks > rpc.MaxRows:
		return fmt.Errorf("-request-blocks %d: more than rpc.MaxRows (%d)", c.RequestBlocks, rpc.MaxRows)
	case c.Requests < 1:
		return fmt.Errorf("-requests %d: want at least 1", c.Requests)
	case len(c.Transports) == 0:
		return errors.New("-transports: no data plane")
	}
	for _, p := range c.Transports {
		switch p {
		case rpc.TransportIBV, rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC:
		default:
			return fmt.Errorf("-transports: unknown data plane %q (ibv, shm, tcp, grpc)", p)
		}
	}
	return nil
}

// jobOf is what the prefill and the decode must agree on, as JSON.
func jobOf(c *config) []byte {
	b, _ := json.Marshal(struct{ Blocks, BlockBytes, RequestBlocks int }{c.Blocks, c.BlockBytes, c.RequestBlocks})
	return b
}

func main() {
	if childproc.Role() == prefillRole {
		os.Exit(prefillChild(os.Args[1:]))
	}
	os.Exit(command(os.Args[1:], os.Stdout))
}

// command is the program the user runs, with its arguments; it returns
// the exit status.
func command(args []string, stdout io.Writer) int {
	fs := flag.NewFlagSet("kvcache", flag.ContinueOnError)
	cfg := defaultConfig()
	blockBytes := bytesize.Format(int64(cfg.BlockBytes))
	var transports string
	fs.IntVar(&cfg.Blocks, "blocks", cfg.Blocks, "blocks of the prefill's paged cache")
	fs.StringVar(&blockBytes, "block-bytes", blockBytes, "bytes of a block (B, KiB, MiB suffixes; a multiple of 8)")
	fs.IntVar(&cfg.RequestBlocks, "request-blocks", cfg.RequestBlocks, "distinct random blocks per request")
	fs.IntVar(&cfg.Requests, "requests", cfg.Requests, "timed requests per operation and data plane")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the requests' block ids")
	fs.StringVar(&transports, "transports", strings.Join(cfg.Transports, ","), "data planes to measure, in order, comma-separated (ibv, shm, tcp, grpc)")
	timeout := fs.Duration("timeout", 5*time.Minute, "give up after this long")
	role := fs.String("role", "", "run one launched process: prefill (with -listen) or decode (with -prefill)")
	listen := fs.String("listen", "", "HOST:PORT a launched prefill listens on")
	prefillAddr := fs.String("prefill", "", "HOST:PORT of the launched prefill a launched decode uses")
	usage := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "kvcache: "+format+"\n", args...)
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
	n, err := bytesize.Parse(blockBytes)
	if err == nil && n > 1<<30 {
		err = fmt.Errorf("%s is over the 1 GiB this example allows", blockBytes)
	}
	if err != nil {
		return usage("-block-bytes: %v", err)
	}
	cfg.BlockBytes = int(n)
	cfg.Transports = nil
	for _, p := range strings.Split(transports, ",") {
		if p = strings.TrimSpace(p); p != "" {
			cfg.Transports = append(cfg.Transports, p)
		}
	}
	if err := cfg.check(); err != nil {
		return usage("%v", err)
	}
	switch *role {
	case "":
		if *listen != "" || *prefillAddr != "" {
			return usage("-listen and -prefill are for launched processes: give -role prefill or -role decode")
		}
	case "prefill":
		if _, _, err := net.SplitHostPort(*listen); err != nil {
			return usage("-role prefill needs -listen HOST:PORT: %v", err)
		}
	case "decode":
		if _, _, err := net.SplitHostPort(*prefillAddr); err != nil {
			return usage("-role decode needs -prefill HOST:PORT: %v", err)
		}
	default:
		return usage("-role is prefill or decode, not %q", *role)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	switch *role {
	case "prefill":
		err = runPrefill(ctx, &cfg, *listen, nil, func(addr string) { describeCache(stdout, &cfg, addr) })
	case "decode":
		_, err = runDecode(ctx, &cfg, *prefillAddr, stdout)
	default:
		_, err = run(ctx, &cfg, stdout)
	}
	if err != nil {
		name := "kvcache"
		if *role != "" {
			name += " " + *role
		}
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return 1
	}
	return 0
}

// run starts the prefill as a child process on loopback and decodes
// against it.
func run(ctx context.Context, cfg *config, out io.Writer) (*report, error) {
	job, _ := json.Marshal(cfg)
	p, err := childproc.Start(prefillRole, "-config", string(job))
	if err != nil {
		return nil, err
	}
	defer p.Kill() // on early returns; Stop below is the normal end
	sctx, cancel := context.WithTimeout(ctx, connectTimeout)
	addr, err := p.ReadLine(sctx)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("waiting for the prefill's address: %w", err)
	}
	fmt.Fprintf(out, "kvcache: prefill process %d on %s\n", p.PID(), addr)
	rep, err := runDecode(ctx, cfg, addr, out)
	if serr := p.Stop(10 * time.Second); serr != nil {
		err = errors.Join(err, fmt.Errorf("prefill: %w", serr))
	}
	return rep, err
}

// prefillChild is the re-executed prefill: it prints its address and
// serves until the decode stops it or its stdin closes.
func prefillChild(args []string) int {
	fs := flag.NewFlagSet(prefillRole, flag.ContinueOnError)
	cfgJSON := fs.String("config", "", "the run, as JSON")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	var cfg config
	if err := json.Unmarshal([]byte(*cfgJSON), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "%s: -config: %v\n", prefillRole, err)
		return 2
	}
	stop := make(chan struct{})
	go func() {
		childproc.WaitForStop()
		close(stop)
	}()
	err := runPrefill(context.Background(), &cfg, "127.0.0.1:0", stop, func(addr string) { fmt.Println(addr) })
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", prefillRole, err)
		return 1
	}
	return 0
}
