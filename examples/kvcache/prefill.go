package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/examples/internal/peerwatch"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// What the prefill publishes.
const (
	// cacheKey is the paged cache: [Blocks, BlockBytes] uint8, writable.
	cacheKey = "kv"
	// blockKeyPrefix and a number j < RequestBlocks name the sources of
	// the per-block baseline: tensors of one block, [1, BlockBytes].
	blockKeyPrefix = "kv/block/"
	// contiguousKey is the source of the contiguous baseline: as many
	// blocks as a request, back to back, [RequestBlocks, BlockBytes].
	contiguousKey = "kv/contiguous"
	// configKey is the job, as JSON (jobOf), for the decode to check.
	configKey = "kv/config"
)

func blockKey(j int) string { return blockKeyPrefix + strconv.Itoa(j) }

// The baselines' sources carry the pattern of ids past the cache's, so
// that none of them can pass for a cache block or for each other.
func blockSourceID(cfg *config, j int) int64 { return int64(cfg.Blocks + j) }
func contiguousSourceID(cfg *config, j int) int64 {
	return int64(cfg.Blocks + cfg.RequestBlocks + j)
}

// Methods of the prefill's server.
const (
	// helloMethod: the decode's control session is up; from then on the
	// prefill fails if that session ends before the decode stops it.
	helloMethod = "hello"
	// checkMethod: the request's tensor is the version of every block as
	// the decode last wrote it ([Blocks] uint32); the prefill checks its
	// own cache tensor against it and answers how many blocks it checked
	// and how many of them were written.
	checkMethod = "check"
	// stopMethod ends the prefill (exit status 0).
	stopMethod = "stop"
)

// decodeName is the client name of the decode's control session, which
// the prefill watches.
const decodeName = "kvcache-decode"

// prefill owns the paged cache and serves it.
type prefill struct {
	cfg   *config
	srv   *rpc.Server
	cache *rpc.Tensor // the prefill's own reference: it sees the decode's writes

	stopOnce sync.Once
	stopped  chan struct{}
	mu       sync.Mutex
	joined   bool // the decode said hello
}

// newPrefill makes the server, fills the cache and the baselines' sources
// with their patterns and publishes them.
func newPrefill(ctx context.Context, cfg *config) (_ *prefill, err error) {
	cacheBytes := int64(cfg.Blocks) * int64(cfg.BlockBytes)
	requestBytes := int64(cfg.RequestBlocks) * int64(cfg.BlockBytes)
	srv, err := rpc.NewServer(
		rpc.WithMaxTensorBytes(max(rpc.DefaultMaxTensorBytes, cacheBytes)),
		rpc.WithPoolOptions(mempool.WithLimit(max(rpc.DefaultPoolLimit, 2*(cacheBytes+2*requestBytes)))))
	if err != nil {
		return nil, err
	}
	p := &prefill{cfg: cfg, srv: srv, stopped: make(chan struct{})}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	// The cache comes from the server's pool, so Publish shares it rather
	// than copying it: rows the decode writes land in p.cache.
	if p.cache, err = srv.NewTensor(ctx, zerocopy.Uint8, []int64{int64(cfg.Blocks), int64(cfg.BlockBytes)}); err != nil {
		return nil, err
	}
	for id := range cfg.Blocks {
		fillBlock(p.block(id), int64(id), 0)
	}
	if err := srv.Publish(ctx, cacheKey, p.cache, rpc.Writable()); err != nil {
		return nil, err
	}
	for j := range cfg.RequestBlocks {
		t, err := srv.NewTensor(ctx, zerocopy.Uint8, []int64{1, int64(cfg.BlockBytes)})
		if err != nil {
			return nil, err
		}
		fillBlock(t.Bytes(), blockSourceID(cfg, j), 0)
		err = srv.Publish(ctx, blockKey(j), t)
		t.Release()
		if err != nil {
			return nil, err
		}
	}
	t, err := srv.NewTensor(ctx, zerocopy.Uint8, []int64{int64(cfg.RequestBlocks), int64(cfg.BlockBytes)})
	if err != nil {
		return nil, err
	}
	for j := range cfg.RequestBlocks {
		fillBlock(t.Bytes()[j*cfg.BlockBytes:(j+1)*cfg.BlockBytes], contiguousSourceID(cfg, j), 0)
	}
	err = srv.Publish(ctx, contiguousKey, t)
	t.Release()
	if err != nil {
		return nil, err
	}
	job, _ := zerocopy.FromSlice(jobOf(cfg))
	if err := srv.Publish(ctx, configKey, rpc.WrapTensor(job)); err != nil {
		return nil, err
	}
	srv.Handle(helloMethod, p.hello)
	srv.Handle(checkMethod, p.check)
	srv.Handle(stopMethod, func(context.Context, *rpc.Message) (*rpc.Message, error) {
		p.stopOnce.Do(func() { close(p.stopped) })
		return nil, nil
	})
	return p, nil
}

// block is cache block id's bytes.
func (p *prefill) block(id int) []byte {
	bb := p.cfg.BlockBytes
	return p.cache.Bytes()[id*bb : (id+1)*bb]
}

func (p *prefill) hello(context.Context, *rpc.Message) (*rpc.Message, error) {
	p.mu.Lock()
	p.joined = true
	p.mu.Unlock()
	return nil, nil
}

// check compares every block of the cache with the pattern of the version
// the decode says it wrote last (0: never written).
func (p *prefill) check(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
	if len(req.Tensors) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "check: %d tensors, want the versions", len(req.Tensors))
	}
	versions, err := zerocopy.View[uint32](req.Tensors[0].Tensor)
	if err != nil || len(versions) != p.cfg.Blocks {
		return nil, status.Errorf(codes.InvalidArgument, "check: want %d uint32 versions (%v)", p.cfg.Blocks, err)
	}
	written := 0
	for id, v := range versions {
		if err := checkBlock(p.block(id), int64(id), v); err != nil {
			return nil, status.Errorf(codes.DataLoss, "the prefill's cache: %v", err)
		}
		if v > 0 {
			written++
		}
	}
	return &rpc.Message{Metadata: fmt.Appendf(nil, "%d %d", len(versions), written)}, nil
}

// watchDecode fails the prefill (through fail) when the decode said hello
// and its control session has then been gone for peerwatch.Grace before
// it stopped the prefill: the decode died without a word.
func (p *prefill) watchDecode(ctx context.Context, fail context.CancelCauseFunc) {
	peerwatch.Watch(ctx, p.srv, 250*time.Millisecond, peerwatch.Peers{
		IDs: func() []int {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.joined {
				return []int{0}
			}
			return nil
		},
		Name: func(int) string { return decodeName },
		Needed: func(int) bool {
			select {
			case <-p.stopped:
				return false
			default:
				return true
			}
		},
	}, func(_ int, gone time.Duration) {
		fail(fmt.Errorf("the decode left: it has had no session for %v and did not stop the prefill (the process died, or lost the prefill)", gone))
	})
}

// close releases the prefill's cache and stops its server, letting calls
// under way (the decode's stop) finish.
func (p *prefill) close() error {
	p.cache.Release() // the rendezvous keeps its own reference until the stop
	p.srv.GracefulStop()
	if st := p.srv.Pool().Stats(); st.InUse != 0 {
		return fmt.Errorf("%d bytes of the prefill's pool still in use", st.InUse)
	}
	return nil
}

// runPrefill serves the cache on listen until the decode stops it, stop is
// closed, or ctx ends (an error). ready receives the address it listens
// on, once it serves.
func runPrefill(ctx context.Context, cfg *config, listen string, stop <-chan struct{}, ready func(addr string)) (err error) {
	p, err := newPrefill(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.close()) }()
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	go p.srv.Serve(lis) // returns when the server stops
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	go p.watchDecode(ctx, fail)
	ready(lis.Addr().String())
	select {
	case <-p.stopped:
		p.awaitDecodeGone(ctx)
		return nil
	case <-stop:
		return nil
	case <-ctx.Done():
		if cause := context.Cause(ctx); cause != ctx.Err() {
			return cause
		}
		return fmt.Errorf("not stopped by the decode: %w", ctx.Err())
	}
}

// awaitDecodeGone waits, at most stopLinger, until the decode has closed
// its control session after its stop call returned: stopping the server
// while the stop's answer is on its way would fail the call.
func (p *prefill) awaitDecodeGone(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, stopLinger)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if !slices.ContainsFunc(p.srv.Sessions(), func(si rpc.SessionInfo) bool { return si.Client == decodeName }) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// stopLinger bounds how long a stopped prefill waits for the decode to go.
const stopLinger = 5 * time.Second

// describeCache is the prefill's line about what it serves.
func describeCache(w io.Writer, cfg *config, addr string) {
	fmt.Fprintf(w, "kvcache prefill: cache [%d, %d] uint8 (%s) published writable as %q on %s, with the baselines' sources (%d one-block tensors, one [%d, %d])\n",
		cfg.Blocks, cfg.BlockBytes, bytesize.Format(int64(cfg.Blocks)*int64(cfg.BlockBytes)), cacheKey, addr,
		cfg.RequestBlocks, cfg.RequestBlocks, cfg.BlockBytes)
}
