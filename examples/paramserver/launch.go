package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/examples/internal/peerwatch"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The launched mode: the user, or a launcher (mpirun, a job scheduler,
// ssh), starts every shard and worker, each with the job's flags and
//
//	-role shard  -index k -shards HOST:PORT,...   listens on the k-th address
//	-role worker -index i -shards HOST:PORT,...
//
// The shards' addresses are all a process needs: the workers dial the
// shards, and the shards dial nobody, so unlike allreduce's ranks no
// process has to learn an address at run time and no store is needed.
// Shards and workers may start in any order: a worker waits until every
// shard accepts connections. Through the shards' rendezvous:
//
//	config   every shard publishes the job; each worker checks it against
//	         its own flags
//	start    worker 0 sends it to shard 0 once it has measured β; the other
//	         workers wait for it, so that β is measured on a quiet link
//
// Worker 0 plays the parent's coordinator: it measures β, prints the loss
// as the steps complete and the summary, and at the end calls every
// shard's "stop" method, on which the shard exits. Every worker says
// hello to every shard over its launch session; a shard whose worker's
// session then ends before the worker is done fails and exits
// (workerWatch), which ends the others' sessions with it.

// launch is how a launched shard or worker finds the others.
type launch struct {
	role   string // "shard" or "worker"
	index  int
	shards []string // the shards' addresses, shard k's at k
	listen string   // a shard's listening address; "" for shards[index]
}

func (l *launch) check(cfg *config) error {
	switch {
	case cfg.InProcess:
		return errors.New("-inprocess and -role exclude each other")
	case l.shards == nil:
		return errors.New("a launched process needs -shards HOST:PORT,...: the shards' addresses")
	case l.role == "shard" && (l.index < 0 || l.index >= cfg.Shards):
		return fmt.Errorf("-index %d: there are %d shards", l.index, cfg.Shards)
	case l.role == "worker" && (l.index < 0 || l.index >= cfg.Workers):
		return fmt.Errorf("-index %d: there are %d workers (-workers)", l.index, cfg.Workers)
	}
	return nil
}

// jobOf is what every process of a job must agree on, as JSON.
func jobOf(cfg *config) []byte {
	b, _ := json.Marshal(struct {
		Shards, Workers, Params, SamplesPerParam, NonZeros, Steps int
		LearningRate, Noise                                       float64
		Seed                                                      uint64
	}{cfg.Shards, cfg.Workers, cfg.Params, cfg.SamplesPerParam, cfg.NonZeros, cfg.Steps, cfg.LearningRate, cfg.Noise, cfg.Seed})
	return b
}

func runLaunched(ctx context.Context, cfg *config, l *launch, out io.Writer) error {
	if l.role == "shard" {
		return runLaunchedShard(ctx, cfg, l, out)
	}
	return runLaunchedWorker(ctx, cfg, l, out)
}

// runLaunchedShard serves shard l.index until worker 0 stops it.
func runLaunchedShard(ctx context.Context, cfg *config, l *launch, out io.Writer) (err error) {
	s, err := newShard(cfg, l.index)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, s.close()) }()
	job, _ := zerocopy.FromSlice(jobOf(cfg))
	if err := s.srv.Publish(ctx, "config", rpc.WrapTensor(job)); err != nil {
		return err
	}
	stopped := make(chan struct{})
	var once sync.Once
	s.srv.Handle("stop", func(context.Context, *rpc.Message) (*rpc.Message, error) {
		once.Do(func() { close(stopped) })
		return nil, nil
	})
	w := &workerWatch{shard: s, steps: cfg.Steps, stopped: stopped, out: out, joined: map[int]bool{}}
	s.srv.Handle("hello", w.hello)
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	go w.watch(ctx, 250*time.Millisecond, fail)
	listen := l.listen
	if listen == "" {
		listen = l.shards[l.index]
	}
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "paramserver shard %d: parameters [%d, %d) on %s\n", l.index, s.lo, s.hi, lis.Addr())
	go s.srv.Serve(lis) // returns when the shard closes
	select {
	case <-stopped:
		return nil
	case <-ctx.Done():
		if cause := context.Cause(ctx); cause != ctx.Err() {
			return cause // a worker left
		}
		return fmt.Errorf("not stopped by worker 0: %w", ctx.Err())
	}
}

// workerWatch finds, in a launched shard, a worker that died without a
// word (killed, crashed), whose session with the shard ends as the kernel
// closes its connections. Without it the shard, and through it every
// other process, would wait for that worker's pushes, or worker 0's stop,
// until -timeout. A worker says hello over its launch session; a worker
// that did and then has had no launch session for peerwatch.Grace fails the
// shard, unless it has pushed its last step (worker 0: and stopped the
// shard).
// The shard's exit ends the other processes' sessions with it, and so
// the job. A host cut off from the network, whose connections are not
// closed, is still found only by -timeout.
type workerWatch struct {
	shard   *shard
	steps   int
	stopped <-chan struct{}

	mu     sync.Mutex
	out    io.Writer // hello says who joined (the shard's only writer once it serves)
	joined map[int]bool
}

// hello is the method a launched worker calls, its index in the metadata,
// once its launch session is open.
func (w *workerWatch) hello(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
	i, err := strconv.Atoi(string(req.Metadata))
	if err != nil || i < 0 || i >= w.shard.workers {
		return nil, status.Errorf(codes.InvalidArgument, "hello: %q is not a worker's index", req.Metadata)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.joined[i] {
		w.joined[i] = true
		fmt.Fprintf(w.out, "paramserver shard %d: worker %d joined\n", w.shard.index, i)
	}
	return nil, nil
}

// done reports whether worker i may go: it has pushed its last step's
// gradient (a worker does not wait for the last update), and worker 0 has
// also stopped the shard.
func (w *workerWatch) done(i int) bool {
	sh := w.shard
	sh.mu.Lock()
	pushedAll := sh.step >= w.steps || sh.step == w.steps-1 && sh.pushed[i]
	sh.mu.Unlock()
	if i != 0 {
		return pushedAll
	}
	select {
	case <-w.stopped:
		return true
	default:
		return false
	}
}

func (w *workerWatch) watch(ctx context.Context, every time.Duration, fail context.CancelCauseFunc) {
	peerwatch.Watch(ctx, w.shard.srv, every, peerwatch.Peers{
		IDs: func() []int {
			w.mu.Lock()
			defer w.mu.Unlock()
			return slices.Collect(maps.Keys(w.joined))
		},
		Name:   launchName,
		Needed: func(i int) bool { return !w.done(i) },
	}, func(i int, gone time.Duration) {
		fail(fmt.Errorf("worker %d left: it has had no session with shard %d for %v and the job is not over (the process died, or lost the shard)",
			i, w.shard.index, gone))
	})
}

// launchName is the name of launched worker i's sessions with the shards.
func launchName(i int) string { return fmt.Sprintf("worker-%d/launch", i) }

// runLaunchedWorker runs worker l.index; worker 0 also coordinates.
func runLaunchedWorker(ctx context.Context, cfg *config, l *launch, out io.Writer) (err error) {
	name := launchName(l.index)
	clients := make([]*rpc.Client, len(l.shards))
	defer func() {
		for _, c := range clients {
			if c != nil {
				err = errors.Join(err, c.Close())
			}
		}
	}()
	for k, addr := range l.shards {
		if clients[k], err = dialShard(ctx, cfg, k, addr, name); err != nil {
			return err
		}
		reply, err := clients[k].Call(ctx, "hello", &rpc.Message{Metadata: []byte(strconv.Itoa(l.index))})
		if err != nil {
			return fmt.Errorf("shard %d: hello: %w", k, err)
		}
		reply.Release()
	}
	if l.index != 0 {
		t, err := clients[0].Fetch(ctx, "start", rpc.WaitForKey())
		if err != nil {
			return fmt.Errorf("waiting for worker 0 to start the job: %w", err)
		}
		t.Release()
		return runWorker(ctx, cfg, l.index, l.shards)
	}

	header(out, cfg, "launched processes")
	_, err = coordinate(ctx, cfg, l.shards, out, func(ctx context.Context, fail context.CancelCauseFunc) <-chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			start, _ := zerocopy.FromSlice([]byte("start"))
			if err := clients[0].Send(ctx, "start", rpc.WrapTensor(start)); err != nil {
				fail(fmt.Errorf("starting the other workers: %w", err))
				return
			}
			if err := runWorker(ctx, cfg, 0, l.shards); err != nil {
				fail(err)
			}
		}()
		return done
	})
	// Stop the shards whether or not the job succeeded: the other workers
	// then end too.
	for k, c := range clients {
		reply, serr := c.Call(context.WithoutCancel(ctx), "stop", &rpc.Message{})
		reply.Release()
		if serr != nil {
			err = errors.Join(err, fmt.Errorf("stopping shard %d: %w", k, serr))
		}
	}
	return err
}

// dialShard waits until shard k at addr accepts connections, opens a
// session with it and checks that it runs the same job as this process.
func dialShard(ctx context.Context, cfg *config, k int, addr, name string) (*rpc.Client, error) {
	for {
		d := net.Dialer{Timeout: 5 * time.Second}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			conn.Close()
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("shard %d at %s: %w (last: %v)", k, addr, ctx.Err(), err)
		case <-time.After(200 * time.Millisecond): // not listening yet
		}
	}
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	c, err := rpc.Dial(dctx, addr, plaintext, rpc.WithTransports(cfg.Transports...), rpc.WithName(name))
	cancel()
	if err != nil {
		return nil, fmt.Errorf("shard %d at %s: %w", k, addr, err)
	}
	t, err := c.Fetch(ctx, "config", rpc.WaitForKey())
	if err != nil {
		return nil, errors.Join(fmt.Errorf("shard %d at %s: %w", k, addr, err), c.Close())
	}
	theirs := slices.Clone(t.Bytes())
	t.Release()
	if ours := jobOf(cfg); string(theirs) != string(ours) {
		return nil, errors.Join(fmt.Errorf("shard %d at %s runs the job %s, this worker %s: give every process the same flags", k, addr, theirs, ours), c.Close())
	}
	return c, nil
}
