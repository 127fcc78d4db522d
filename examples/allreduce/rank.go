package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// A rank runs the same ring however it was started; a coordinator tells
// it its right neighbour's address and when to run each all-reduce, and
// takes its results. Started by this program's parent (the default mode),
// a rank talks with the parent in lines (parentCoordinator):
//
//	rank → parent: "<address>"             its server is listening
//	parent → rank: "<address>"             its right neighbour's server
//	rank → parent: "ready <data plane>"    its session with it is open
//	parent → rank: "go"                    run one all-reduce
//	rank → parent: {result as JSON}        after each all-reduce
//
// and ends when the parent closes its stdin. Started by the user or a
// launcher (launch.go), the ranks coordinate through rank 0's server
// instead (storeCoordinator).
type coordinator interface {
	// connect is called once the rank's server srv listens on addr; it
	// returns the right neighbour's address.
	connect(ctx context.Context, srv *rpc.Server, addr string) (right string, err error)
	// begin waits until all-reduce iter may start: every rank is ready
	// for it. plane is this rank's data plane to its right neighbour. It
	// returns false when there are no more all-reduces.
	begin(ctx context.Context, iter int, plane string) (bool, error)
	// report hands on the rank's result of one all-reduce.
	report(ctx context.Context, res iterResult) error
	// end is called after the last all-reduce, before the rank closes its
	// server and session.
	end(ctx context.Context) error
}

// iterResult is what a rank reports after one all-reduce.
type iterResult struct {
	Rank, Iter int
	Time       time.Duration // from "go" to the last chunk in place
	// Sent and Received are the tensor bytes this rank's client sent and
	// its server received from the left neighbour during the all-reduce
	// (rpc.Stats), and Copies the CPU copies of tensor bytes its client
	// made.
	Sent, Received, Copies int64
	Exact                  bool
	Mismatch               string `json:",omitempty"`
}

func rankMain(args []string) int {
	fs := flag.NewFlagSet(rankRole, flag.ContinueOnError)
	var cfg config
	rank := fs.Int("rank", 0, "this process's rank")
	fs.IntVar(&cfg.Ranks, "p", 0, "processes in the ring")
	fs.IntVar(&cfg.Elements, "n", 0, "float32 elements")
	transports := fs.String("transports", "", "data planes")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cfg.Transports = strings.Split(*transports, ",")
	if err := runRank(context.Background(), &cfg, *rank, "127.0.0.1:0", parentCoordinator{}); err != nil {
		fmt.Fprintf(os.Stderr, "allreduce rank %d: %v\n", *rank, err)
		return 1
	}
	return 0
}

// parentCoordinator is a rank's side of the line protocol with the parent.
type parentCoordinator struct{}

func (parentCoordinator) connect(_ context.Context, _ *rpc.Server, addr string) (string, error) {
	fmt.Println(addr)
	right, err := childproc.ReadParent()
	if err != nil {
		return "", fmt.Errorf("waiting for the right neighbour's address: %w", err)
	}
	return right, nil
}

func (parentCoordinator) begin(_ context.Context, iter int, plane string) (bool, error) {
	if iter == 0 {
		fmt.Println("ready", plane)
	}
	_, err := childproc.ReadParent()
	return err == nil, nil // the end of stdin: told to stop
}

func (parentCoordinator) report(_ context.Context, res iterResult) error {
	line, err := json.Marshal(res)
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(line))
	return err
}

func (parentCoordinator) end(context.Context) error { return nil }

// ring is one rank's side of the ring: its server, which its left
// neighbour sends to, and its client of its right neighbour's server.
type ring struct {
	cfg    *config
	rank   int
	pool   *mempool.Pool
	srv    *rpc.Server
	client *rpc.Client
	chunks []*rpc.Tensor // the vector, chunk by chunk, in pool memory
}

// clientName is how rank r names its ring client in its right
// neighbour's server.
func clientName(r int) string { return fmt.Sprintf("rank-%d", r) }

// runRank is rank's process: its server listens on listen, co connects it
// to its right neighbour and starts each all-reduce.
func runRank(ctx context.Context, cfg *config, rank int, listen string, co coordinator) (err error) {
	bytes := int64(cfg.Elements) * 4
	pool, err := mempool.NewPool(mempool.WithBacking(mempool.BackingMemfd), mempool.WithName("allreduce"),
		mempool.WithLimit(max(1<<30, 4*bytes)))
	if err != nil {
		return err
	}
	r := &ring{cfg: cfg, rank: rank, pool: pool}
	defer func() { err = errors.Join(err, r.close()) }()
	// The server and the client share the pool: a chunk the server
	// received is sent on by the client without a copy. A chunk may be as
	// large as the pool allows, beyond rpc's default limit.
	shared := []rpc.Option{rpc.WithPool(pool), rpc.WithTransports(cfg.Transports...),
		rpc.WithMaxTensorBytes(max(rpc.DefaultMaxTensorBytes, bytes))}
	var sopts []rpc.ServerOption
	dopts := []rpc.DialOption{
		// The ranks talk in plaintext: a trusted network.
		rpc.WithTransportCredentials(insecure.NewCredentials()),
		rpc.WithName(clientName(rank)),
	}
	for _, o := range shared {
		sopts = append(sopts, o)
		dopts = append(dopts, o)
	}
	if r.srv, err = rpc.NewServer(sopts...); err != nil {
		return err
	}
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	go r.srv.Serve(lis) // returns when the server stops

	right, err := co.connect(ctx, r.srv, lis.Addr().String())
	if err != nil {
		return err
	}
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	r.client, err = rpc.Dial(dctx, right, dopts...)
	cancel()
	if err != nil {
		return fmt.Errorf("dialing the right neighbour %s: %w", right, err)
	}
	for c := range cfg.Ranks {
		lo, hi := chunkRange(cfg, c)
		t, err := r.srv.NewTensor(ctx, zerocopy.Float32, []int64{int64(hi - lo)})
		if err != nil {
			return err
		}
		r.chunks = append(r.chunks, t)
	}
	r.fill(0)
	// The counters are read between all-reduces, when no rank is sending:
	// before this rank says it is ready (the first all-reduce starts once
	// every rank is), and after each all-reduce, before it reports (the
	// next starts once every rank has reported).
	sent0, recv0 := r.client.Stats(), r.received()
	for iter := 0; ; iter++ {
		if more, err := co.begin(ctx, iter, r.client.Transport()); err != nil || !more {
			if err != nil {
				return fmt.Errorf("waiting to start all-reduce %d: %w", iter, err)
			}
			break
		}
		start := time.Now()
		if err := r.allReduce(ctx, iter); err != nil {
			return fmt.Errorf("all-reduce %d: %w", iter, err)
		}
		res := iterResult{Rank: rank, Iter: iter, Time: time.Since(start)}
		sent1, recv1 := r.client.Stats(), r.received()
		res.Sent = tensorBytes(sent1) - tensorBytes(sent0)
		res.Received = tensorBytes(recv1) - tensorBytes(recv0)
		res.Copies = sent1.Copies - sent0.Copies
		sent0, recv0 = sent1, recv1
		res.Mismatch = r.verify(iter)
		res.Exact = res.Mismatch == ""
		r.fill(iter + 1)
		if err := co.report(ctx, res); err != nil {
			return fmt.Errorf("reporting all-reduce %d: %w", iter, err)
		}
	}
	return co.end(ctx)
}

// received is what this rank's server received from its left neighbour's
// client: the session named after it. Other sessions (other ranks' store
// sessions with rank 0, see launch.go) do not count.
func (r *ring) received() rpc.Stats {
	left := clientName((r.rank + r.cfg.Ranks - 1) % r.cfg.Ranks)
	var total rpc.Stats
	for _, s := range r.srv.Sessions() {
		if s.Client == left {
			total.DataPlaneBytes += s.Stats.DataPlaneBytes
			total.InlineBytes += s.Stats.InlineBytes
			total.StreamBytes += s.Stats.StreamBytes
		}
	}
	return total
}

func tensorBytes(s rpc.Stats) int64 { return s.DataPlaneBytes + s.InlineBytes + s.StreamBytes }

// chunkRange is the part of the vector chunk c holds.
func chunkRange(cfg *config, c int) (lo, hi int) {
	return c * cfg.Elements / cfg.Ranks, (c + 1) * cfg.Elements / cfg.Ranks
}

// allReduce replaces the vector with its sum over all ranks.
func (r *ring) allReduce(ctx context.Context, iter int) error {
	p := r.cfg.Ranks
	mod := func(i int) int { return ((i % p) + p) % p }
	// Reduce-scatter: add the left neighbour's partial sums into ours.
	for s := range p - 1 {
		key := fmt.Sprintf("%d/rs/%d", iter, s)
		if err := r.client.Send(ctx, key, r.chunks[mod(r.rank-s)]); err != nil {
			return err
		}
		// The left neighbour sends key to our server when it gets there:
		// wait for it.
		got, err := r.srv.Take(ctx, key, rpc.WaitForKey())
		if err != nil {
			return err
		}
		err = addInto(r.chunks[mod(r.rank-s-1)], got)
		got.Release()
		if err != nil {
			return err
		}
	}
	// All-gather: pass the complete chunks around; a received chunk simply
	// replaces ours, and is sent on as it is at the next step.
	for s := range p - 1 {
		key := fmt.Sprintf("%d/ag/%d", iter, s)
		if err := r.client.Send(ctx, key, r.chunks[mod(r.rank+1-s)]); err != nil {
			return err
		}
		got, err := r.srv.Take(ctx, key, rpc.WaitForKey())
		if err != nil {
			return err
		}
		c := mod(r.rank - s)
		if got.DType() != zerocopy.Float32 || got.Shape()[0] != r.chunks[c].Shape()[0] {
			got.Release()
			return fmt.Errorf("chunk %d arrived as %v %v", c, got.DType(), got.Shape())
		}
		r.chunks[c].Release()
		r.chunks[c] = got
	}
	return nil
}

// addInto adds src to dst, element by element.
func addInto(dst, src *rpc.Tensor) error {
	d, err := zerocopy.View[float32](dst.Tensor)
	if err != nil {
		return err
	}
	s, err := zerocopy.View[float32](src.Tensor)
	if err != nil || len(s) != len(d) {
		return fmt.Errorf("received %v %v, want float32[%d]", src.DType(), src.Shape(), len(d))
	}
	for i := range d {
		d[i] += s[i]
	}
	return nil
}

// maxValue bounds the magnitude of the elements; a sum of P of them stays
// an integer that float32 represents exactly while P·maxValue < 2²⁴.
const maxValue = 100

// value is element i of rank r's vector in all-reduce iter: an integer in
// [−maxValue, maxValue] that looks random along the vector and differs
// from rank to rank.
func value(r, i, iter int) float32 {
	return float32(int((mix(i, iter)+37*uint32(r))%(2*maxValue+1)) - maxValue)
}

// mix hashes an element's index and the iteration.
func mix(i, iter int) uint32 {
	x := uint32(i)*0x9e3779b1 ^ uint32(iter)*0xc2b2ae3d
	x ^= x >> 15
	x *= 0x2c1b3c6d
	x ^= x >> 12
	x *= 0x297a2d39
	x ^= x >> 15
	return x % (1 << 24) // leaves room for 37·r without overflow
}

// fill sets the vector to this rank's input of iteration iter.
func (r *ring) fill(iter int) {
	for c, t := range r.chunks {
		lo, _ := chunkRange(r.cfg, c)
		v, _ := zerocopy.View[float32](t.Tensor)
		for i := range v {
			v[i] = value(r.rank, lo+i, iter)
		}
	}
}

// verify compares the vector with the exact sum of every rank's input and
// describes the first difference, or returns "".
func (r *ring) verify(iter int) string {
	for c, t := range r.chunks {
		lo, _ := chunkRange(r.cfg, c)
		v, _ := zerocopy.View[float32](t.Tensor)
		for i, got := range v {
			h := mix(lo+i, iter)
			var want float32
			for rank := range r.cfg.Ranks {
				want += float32(int((h+37*uint32(rank))%(2*maxValue+1)) - maxValue)
			}
			if got != want {
				return fmt.Sprintf("element %d is %v, want %v", lo+i, got, want)
			}
		}
	}
	return ""
}

// close releases the vector, closes the session, stops the server and
// closes the pool, which fails if a tensor was not released.
func (r *ring) close() error {
	for _, t := range r.chunks {
		t.Release()
	}
	var err error
	if r.client != nil {
		err = r.client.Close()
	}
	if r.srv != nil {
		r.srv.GracefulStop()
	}
	return errors.Join(err, r.pool.Close())
}
