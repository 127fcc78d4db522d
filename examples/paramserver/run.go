package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/tensorrpc/tensorrpc/examples/internal/units"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// plaintext is the credentials of every session: the shards and workers
// talk over loopback, in plaintext.
var plaintext = rpc.WithTransportCredentials(insecure.NewCredentials())

// summary is what a run measured.
type summary struct {
	Plane         string
	Losses        []float64 // L(w_t) for every step t
	LossAtOptimum float64   // L(w*)
	StepTime      time.Duration
	Compute       time.Duration // the slowest worker's gradient, per step
	Beta          float64       // bytes per second of one large Send
	Model         time.Duration // 2·max(n/β, P·n/(K·β)): a pull and a push
}

// startShard starts shard k serving on loopback and returns it and its
// address.
func startShard(cfg *config, k int) (*shard, string, error) {
	s, err := newShard(cfg, k)
	if err != nil {
		return nil, "", err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.close()
		return nil, "", err
	}
	go s.srv.Serve(lis) // returns when the shard closes
	return s, lis.Addr().String(), nil
}

// run trains the model: it starts the shards, measures β, starts the
// workers, prints the loss as the steps complete and the timing at the
// end.
func run(ctx context.Context, cfg *config, out io.Writer) (_ *summary, err error) {
	mode := "processes"
	if cfg.InProcess {
		mode = "goroutines in one process"
	}
	header(out, cfg, mode)
	addrs, stopShards, err := startShards(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, stopShards()) }()
	return coordinate(ctx, cfg, addrs, out, func(ctx context.Context, fail context.CancelCauseFunc) <-chan struct{} {
		return startWorkers(ctx, cfg, addrs, fail)
	})
}

// header prints what the job is.
func header(out io.Writer, cfg *config, mode string) {
	fmt.Fprintf(out, "paramserver: %d shards, %d workers (%s); n = %d float32 parameters (%s), %d samples with %d features each\n",
		cfg.Shards, cfg.Workers, mode, cfg.Params, bytesize.Format(int64(4*cfg.Params)), cfg.samples(), cfg.NonZeros)
}

// coordinate measures β against the shard at addrs[0], starts the workers
// (startWorkers returns a channel closed when they have ended; a worker
// that fails calls fail), prints the loss as the steps complete and the
// timing at the end: the part of a run that is the same whoever started
// the shards and workers.
func coordinate(ctx context.Context, cfg *config, addrs []string, out io.Writer,
	startWorkers func(context.Context, context.CancelCauseFunc) <-chan struct{}) (_ *summary, err error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	// The coordinator's own session with shard 0: β, then the records.
	dctx, dcancel := context.WithTimeout(ctx, connectTimeout)
	c, err := rpc.Dial(dctx, addrs[0], plaintext, rpc.WithTransports(cfg.Transports...), rpc.WithName("coordinator"))
	dcancel()
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	sum := &summary{Plane: c.Transport()}
	if sum.Beta, err = measureBeta(ctx, c, cfg.BetaBytes); err != nil {
		return nil, fmt.Errorf("measuring β: %w", err)
	}
	fmt.Fprintf(out, "data plane %s; β = %.2f GB/s (Send of a %s tensor to shard 0)\n", sum.Plane, sum.Beta/1e9, bytesize.Format(int64(cfg.BetaBytes)))
	fmt.Fprintf(out, "learning rate %.4g; noise variance %.4g\n", cfg.learningRate(), cfg.Noise*cfg.Noise)

	workersDone := startWorkers(ctx, cancel)

	fmt.Fprintf(out, "%6s  %12s\n", "step", "loss")
	var records []stepRecord
	for step := range cfg.Steps {
		rec, err := fetchRecord(ctx, c, step)
		if err != nil {
			cancel(err)
			<-workersDone
			return nil, fmt.Errorf("step %d: %w", step, context.Cause(ctx))
		}
		records = append(records, rec)
		sum.Losses = append(sum.Losses, rec.Loss)
		if step%cfg.LogEvery == 0 || step == cfg.Steps-1 {
			fmt.Fprintf(out, "%6d  %12.6g\n", step, rec.Loss)
		}
	}
	<-workersDone
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}

	sum.LossAtOptimum = records[0].LossAtOptimum
	last := records[len(records)-1]
	// Step 0 also waits for the slowest worker to generate its data: time
	// the steps after it.
	sum.StepTime = (last.Done - records[0].Done) / time.Duration(len(records)-1)
	for _, r := range records[1:] {
		sum.Compute += r.Compute
	}
	sum.Compute /= time.Duration(len(records) - 1)
	bytes := 4 * float64(cfg.Params)
	perWorker := bytes / sum.Beta
	perShard := float64(cfg.Workers) * bytes / (float64(cfg.Shards) * sum.Beta)
	direction := time.Duration(max(perWorker, perShard) * 1e9)
	sum.Model = 2 * direction

	fmt.Fprintf(out, "final loss %.6g after %d steps = %.3f × L(w*); L(w*) = %.6g, the mean squared noise of the samples\n",
		last.Loss, cfg.Steps, last.Loss/sum.LossAtOptimum, sum.LossAtOptimum)
	fmt.Fprintf(out, "step time %s (mean of steps 1–%d): slowest worker's gradient %s, the rest (pull, push, waiting) %s\n",
		units.Duration(sum.StepTime), cfg.Steps-1, units.Duration(sum.Compute), units.Duration(sum.StepTime-sum.Compute))
	fmt.Fprintf(out, "cost model max(n/β, p·n/(k·β)) = max(%s, %s) = %s per direction; pull + push = %s per step\n",
		units.Duration(time.Duration(perWorker*1e9)), units.Duration(time.Duration(perShard*1e9)), units.Duration(direction), units.Duration(sum.Model))
	return sum, nil
}

// startShards starts the shards as processes or in this process and
// returns their addresses and a function that stops them.
func startShards(ctx context.Context, cfg *config) ([]string, func() error, error) {
	addrs := make([]string, cfg.Shards)
	if cfg.InProcess {
		var shards []*shard
		stop := func() error {
			var err error
			for _, s := range shards {
				err = errors.Join(err, s.close())
			}
			return err
		}
		for k := range cfg.Shards {
			s, addr, err := startShard(cfg, k)
			if err != nil {
				return nil, nil, errors.Join(err, stop())
			}
			shards = append(shards, s)
			addrs[k] = addr
		}
		return addrs, stop, nil
	}
	cfgJSON, _ := json.Marshal(cfg)
	var group childproc.Group
	stop := func() error { return group.Stop(10 * time.Second) }
	for k := range cfg.Shards {
		p, err := childproc.Start(shardRole, "-config", string(cfgJSON), "-index", strconv.Itoa(k))
		if err != nil {
			return nil, nil, errors.Join(err, stop())
		}
		group = append(group, p)
		lctx, cancel := context.WithTimeout(ctx, connectTimeout)
		addrs[k], err = p.ReadLine(lctx)
		cancel()
		if err != nil {
			return nil, nil, errors.Join(fmt.Errorf("shard %d: %w", k, err), stop())
		}
	}
	return addrs, stop, nil
}

// startWorkers starts the workers and returns a channel closed when all
// have ended. A worker that fails cancels ctx with its error.
func startWorkers(ctx context.Context, cfg *config, addrs []string, fail context.CancelCauseFunc) <-chan struct{} {
	done := make(chan struct{})
	var wg sync.WaitGroup
	if cfg.InProcess {
		for i := range cfg.Workers {
			wg.Go(func() {
				if err := runWorker(ctx, cfg, i, addrs); err != nil {
					fail(err)
				}
			})
		}
	} else {
		cfgJSON, _ := json.Marshal(cfg)
		for i := range cfg.Workers {
			p, err := childproc.Start(workerRole, "-config", string(cfgJSON), "-index", strconv.Itoa(i), "-shards", strings.Join(addrs, ","))
			if err != nil {
				fail(err)
				break
			}
			wg.Go(func() {
				select {
				case <-p.Exited():
				case <-ctx.Done():
				}
				// A worker ends by itself after its last step; Stop also
				// tells one to end early when the run failed.
				if err := p.Stop(10 * time.Second); err != nil {
					fail(fmt.Errorf("worker %d: %w", i, err))
				}
			})
		}
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// measureBeta measures the bandwidth of one Send of size bytes over c's
// data plane: the mean of 5 Sends after 2 untimed ones (which grow the
// pools).
func measureBeta(ctx context.Context, c *rpc.Client, size int) (float64, error) {
	t, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
	if err != nil {
		return 0, err
	}
	defer t.Release()
	clear(t.Bytes())
	const warmups, timed = 2, 5
	var total time.Duration
	for i := range warmups + timed {
		start := time.Now()
		if err := c.Send(ctx, "beta", t); err != nil {
			return 0, err
		}
		if i >= warmups {
			total += time.Since(start)
		}
	}
	reply, err := c.Call(ctx, "drop", &rpc.Message{Metadata: []byte("beta")})
	reply.Release()
	if err != nil {
		return 0, err
	}
	return float64(timed*size) / total.Seconds(), nil
}

func fetchRecord(ctx context.Context, c *rpc.Client, step int) (stepRecord, error) {
	meta, _ := json.Marshal(step)
	reply, err := c.Call(ctx, "record", &rpc.Message{Metadata: meta})
	if err != nil {
		return stepRecord{}, err
	}
	defer reply.Release()
	var rec stepRecord
	return rec, json.Unmarshal(reply.Metadata, &rec)
}
