package rpc

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// poolBuffer returns a buffer reference that holds t's bytes in pool: t's
// own buffer, retained, when it lives in pool; otherwise a copy of t's bytes
// in a new buffer (counted in c). The caller releases the reference.
func poolBuffer(ctx context.Context, pool *mempool.Pool, t *Tensor, c *counters) (*mempool.Buffer, error) {
	if t == nil || !t.Valid() {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: nil or invalid tensor")
	}
	if t.released.Load() {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: tensor used after Release")
	}
	if t.buf != nil && t.buf.Len() > 0 {
		if a, _, ok := pool.Locate(t.buf.Addr()); ok && a == t.buf.Arena() {
			t.buf.Retain()
			return t.buf, nil
		}
	}
	return copyToPool(ctx, pool, t.Bytes(), c)
}

// copyToPool copies b into a new pool buffer, counting the copy.
func copyToPool(ctx context.Context, pool *mempool.Pool, b []byte, c *counters) (*mempool.Buffer, error) {
	buf, err := allocBuffer(ctx, pool, len(b))
	if err != nil {
		return nil, err
	}
	memcopy.Copy(buf.Bytes(), b)
	if len(b) > 0 {
		c.copied(len(b))
	}
	return buf, nil
}

// allocBuffer allocates from pool, mapping failures to status codes:
// context errors keep their codes, a request over the pool's limit is
// ResourceExhausted.
func allocBuffer(ctx context.Context, pool *mempool.Pool, n int) (*mempool.Buffer, error) {
	var buf *mempool.Buffer
	var err error
	if ctx.Value(noPoolWait{}) != nil {
		buf, err = pool.TryAlloc(n)
	} else {
		buf, err = pool.Alloc(ctx, n)
	}
	if err == nil {
		return buf, nil
	}
	if ctx.Err() != nil {
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if ctx.Value(noPoolWait{}) != nil {
		return nil, status.Errorf(codes.ResourceExhausted, "tensorrpc: allocating %d bytes in an Inline call, which does not wait for pool memory: %v", n, err)
	}
	return nil, status.Errorf(codes.ResourceExhausted, "tensorrpc: allocating %d bytes: %v (rpc.WithPoolOptions(mempool.WithLimit(n)) raises the pool's limit)", n, err)
}

// NewTensor allocates a tensor of the given dtype and shape from pool.
// Sending it costs no copy. Its bytes are not zeroed.
func newTensor(ctx context.Context, pool *mempool.Pool, dtype zerocopy.DType, shape []int64) (*Tensor, error) {
	n, err := zerocopy.ByteSize(dtype, shape)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	buf, err := allocBuffer(ctx, pool, int(n))
	if err != nil {
		return nil, err
	}
	return newPoolTensor(dtype, shape, buf)
}

// trimmer gives back, every interval, the memory of pool arenas that were
// already empty at the previous tick, so a spike of large tensors costs
// memory only for a while. stop ends it and waits.
func trimmer(pool *mempool.Pool, interval time.Duration, log *slog.Logger) (stop func()) {
	if interval <= 0 {
		return func() {}
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(interval)
		defer t.Stop()
		var prev []uint32
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			if n := pool.TrimArenas(prev); n > 0 {
				log.Debug("tensorrpc: released empty pool arenas", "bytes", n)
			}
			prev = pool.EmptyArenas()
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-stopped }) }
}

// noPoolWait marks the context of an Inline call: allocBuffer then takes
// only what the pool has at hand, since the call runs where the lane's
// frames are read, and what frees pool memory may be a frame behind it.
type noPoolWait struct{}
