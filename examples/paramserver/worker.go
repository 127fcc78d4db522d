package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// runWorker is worker i: it generates its samples, opens a session with
// every shard and runs cfg.Steps synchronous steps.
func runWorker(ctx context.Context, cfg *config, i int, addrs []string) (err error) {
	data := newDataset(cfg, i, trueWeights(cfg))
	clients := make([]*rpc.Client, len(addrs))
	defer func() {
		for _, c := range clients {
			if c != nil {
				// Close reports received tensors that were not released.
				err = errors.Join(err, c.Close())
			}
		}
	}()
	for k, addr := range addrs {
		dctx, cancel := context.WithTimeout(ctx, connectTimeout)
		clients[k], err = rpc.Dial(dctx, addr, plaintext, rpc.WithTransports(cfg.Transports...), rpc.WithName(fmt.Sprintf("worker-%d", i)))
		cancel()
		if err != nil {
			return fmt.Errorf("worker %d: dialing shard %d: %w", i, k, err)
		}
	}

	w := make([]float32, cfg.Params)
	grad := make([]float32, cfg.Params)
	total := cfg.samples()
	for step := range cfg.Steps {
		// Pull w_step from every shard at once. A shard publishes it once
		// every worker has pushed step−1: wait for it.
		err := eachShard(cfg, func(k, lo, hi int) error {
			t, err := clients[k].Fetch(ctx, paramKey(step), rpc.WaitForKey())
			if err != nil {
				return err
			}
			defer t.Release()
			part, err := zerocopy.View[float32](t.Tensor)
			if err != nil || len(part) != hi-lo {
				return fmt.Errorf("shard %d sent %v %v, want float32[%d]", k, t.DType(), t.Shape(), hi-lo)
			}
			// The sample rows index w as a whole: gather the slices into
			// one array (one copy of n floats, small beside the gradient).
			copy(w[lo:hi], part)
			return nil
		})
		if err != nil {
			return fmt.Errorf("worker %d, step %d, pull: %w", i, step, err)
		}

		start := time.Now()
		clear(grad)
		loss := data.gradient(w, grad, total)
		compute := time.Since(start)

		// Push each shard its slice of the gradient. Each Call returns once
		// the shard has added it; the next Fetch waits for the other workers.
		err = eachShard(cfg, func(k, lo, hi int) error {
			m := pushMeta{Step: step, Worker: i, Compute: compute}
			if k == 0 { // the loss is counted once, by shard 0's records
				m.Loss = loss
				if step == 0 {
					m.LossAtOptimum = data.noise / float64(total)
				}
			}
			meta, _ := json.Marshal(m)
			g, err := zerocopy.FromSlice(grad[lo:hi], int64(hi-lo))
			if err != nil {
				return err
			}
			// A wrapped Go slice is copied once into the client's pool
			// (counted in Stats.Copies) before it moves.
			reply, err := clients[k].Call(ctx, "push", &rpc.Message{Metadata: meta, Tensors: []*rpc.Tensor{rpc.WrapTensor(g)}})
			reply.Release()
			return err
		})
		if err != nil {
			return fmt.Errorf("worker %d, step %d, push: %w", i, step, err)
		}
	}
	return nil
}

// eachShard runs f for every shard's parameter range concurrently and
// returns the first error.
func eachShard(cfg *config, f func(k, lo, hi int) error) error {
	errs := make([]error, cfg.Shards)
	var wg sync.WaitGroup
	for k := range cfg.Shards {
		lo, hi := shardRange(cfg, k)
		wg.Go(func() { errs[k] = f(k, lo, hi) })
	}
	wg.Wait()
	return errors.Join(errs...)
}
