package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// A shard owns the parameters [lo, hi). Step t is synchronous:
//
//  1. the shard has published w_t under "w/<t>";
//  2. every worker fetches it (Client.Fetch), computes its gradient and
//     pushes its slice for the shard with the "push" method (Client.Call
//     carrying the gradient tensor);
//  3. the push that completes the set of P gradients applies SGD,
//     w_{t+1} = w_t − lr·Σ gradients, publishes it as "w/<t+1>" and
//     unpublishes "w/<t>".
//
// Workers wait in Fetch (rpc.WaitForKey) for "w/<t+1>", so no worker runs
// ahead; the push handler itself never waits.

// pushMeta is the metadata of a push.
type pushMeta struct {
	Step, Worker int
	// Loss is the worker's share of L(w_t); LossAtOptimum its share of
	// L(w*), sent with step 0.
	Loss, LossAtOptimum float64
	// Compute is how long the worker took to compute the gradient.
	Compute time.Duration
}

// stepRecord is what a shard knows about a completed step.
type stepRecord struct {
	Step          int
	Loss          float64       // L(w_t), summed over workers
	LossAtOptimum float64       // L(w*), summed over workers
	Compute       time.Duration // the slowest worker's gradient computation
	Done          time.Duration // when w_{t+1} was published, since the shard started
}

type shard struct {
	srv     *rpc.Server
	index   int
	lo, hi  int
	workers int
	lr      float32
	start   time.Time

	mu      sync.Mutex
	step    int
	pushed  map[int]bool // workers that pushed for step
	sum     []float32    // Σ gradients of step so far
	rec     stepRecord
	cur     *rpc.Tensor // w_step, our reference to what "w/<step>" holds
	records []stepRecord
	changed chan struct{} // closed and replaced when a step completes
}

// shardRange is the slice of the parameters shard k of K owns.
func shardRange(cfg *config, k int) (lo, hi int) {
	return k * cfg.Params / cfg.Shards, (k + 1) * cfg.Params / cfg.Shards
}

// newShard makes shard k's server and publishes w_0 = 0.
func newShard(cfg *config, k int) (*shard, error) {
	srv, err := rpc.NewServer(rpc.WithTransports(cfg.Transports...))
	if err != nil {
		return nil, err
	}
	lo, hi := shardRange(cfg, k)
	s := &shard{
		srv: srv, index: k, lo: lo, hi: hi, workers: cfg.Workers, lr: float32(cfg.learningRate()), start: time.Now(),
		pushed: map[int]bool{}, sum: make([]float32, hi-lo), changed: make(chan struct{}),
	}
	w0, err := srv.NewTensor(context.Background(), zerocopy.Float32, []int64{int64(hi - lo)})
	if err != nil {
		srv.Stop()
		return nil, err
	}
	clear(w0.Bytes())
	if err := srv.Publish(context.Background(), paramKey(0), w0); err != nil {
		w0.Release()
		srv.Stop()
		return nil, err
	}
	s.cur = w0
	srv.Handle("push", s.push)
	srv.Handle("record", s.record)
	srv.Handle("drop", func(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
		srv.Unpublish(string(req.Metadata))
		return nil, nil
	})
	return s, nil
}

func paramKey(step int) string { return fmt.Sprintf("w/%d", step) }

// push receives one worker's gradient slice for the current step.
func (s *shard) push(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
	var m pushMeta
	if err := json.Unmarshal(req.Metadata, &m); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "push: %v", err)
	}
	if len(req.Tensors) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "push: %d tensors, want the gradient", len(req.Tensors))
	}
	grad, err := zerocopy.View[float32](req.Tensors[0].Tensor)
	if err != nil || len(grad) != len(s.sum) {
		return nil, status.Errorf(codes.InvalidArgument, "push: gradient is %v %v, want float32[%d]", req.Tensors[0].DType(), req.Tensors[0].Shape(), len(s.sum))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case m.Step != s.step:
		return nil, status.Errorf(codes.FailedPrecondition, "push: worker %d pushed for step %d during step %d", m.Worker, m.Step, s.step)
	case m.Worker < 0 || m.Worker >= s.workers || s.pushed[m.Worker]:
		return nil, status.Errorf(codes.InvalidArgument, "push: unexpected push from worker %d at step %d", m.Worker, m.Step)
	}
	s.pushed[m.Worker] = true
	// The request tensor is released when we return: add it up now.
	for i, g := range grad {
		s.sum[i] += g
	}
	s.rec.Loss += m.Loss
	s.rec.LossAtOptimum += m.LossAtOptimum
	s.rec.Compute = max(s.rec.Compute, m.Compute)
	if len(s.pushed) < s.workers {
		return nil, nil
	}
	return nil, s.update(ctx)
}

// update applies SGD with the summed gradients and publishes w_{step+1}.
// It runs with s.mu held.
func (s *shard) update(ctx context.Context) error {
	next, err := s.srv.NewTensor(ctx, zerocopy.Float32, []int64{int64(len(s.sum))})
	if err != nil {
		return err
	}
	cur, _ := zerocopy.View[float32](s.cur.Tensor)
	w, _ := zerocopy.View[float32](next.Tensor)
	for i, g := range s.sum {
		w[i] = cur[i] - s.lr*g
		s.sum[i] = 0
	}
	// A published tensor must not be written again: each step publishes a
	// new one. Every worker has fetched w_step, since it pushed for step.
	if err := s.srv.Publish(ctx, paramKey(s.step+1), next); err != nil {
		next.Release()
		return err
	}
	s.srv.Unpublish(paramKey(s.step))
	s.cur.Release()
	s.cur = next

	s.rec.Step = s.step
	s.rec.Done = time.Since(s.start)
	s.records = append(s.records, s.rec)
	s.rec = stepRecord{}
	clear(s.pushed)
	s.step++
	close(s.changed)
	s.changed = make(chan struct{})
	return nil
}

// record returns the record of the step in the request's metadata, waiting
// until that step completes.
func (s *shard) record(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
	var step int
	if err := json.Unmarshal(req.Metadata, &step); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "record: %v", err)
	}
	for {
		s.mu.Lock()
		if step < len(s.records) {
			b, err := json.Marshal(s.records[step])
			s.mu.Unlock()
			return &rpc.Message{Metadata: b}, err
		}
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
}

// close stops the shard's server and checks that its pool is empty.
func (s *shard) close() error {
	s.mu.Lock()
	s.cur.Release() // the rendezvous keeps its own reference until the stop
	s.mu.Unlock()
	s.srv.GracefulStop()
	if st := s.srv.Pool().Stats(); st.InUse != 0 {
		return fmt.Errorf("shard %d: %d bytes of its pool still in use", s.index, st.InUse)
	}
	return nil
}
