package fallback

import (
	"context"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/mempool"
)

// ChunkRefs counts the buffer references a stream handed to gRPC inside
// zero-copy chunks. gRPC frees a chunk once it has written it; but when a
// connection is torn down with frames queued or half written, grpc-go
// frees only some of them, and the rest would pin pool memory for good.
// The stream's owner (a server handler, or a client call) therefore owns
// the references: Settle waits for gRPC to free them and takes back those
// it never will.
type ChunkRefs struct {
	mu    sync.Mutex
	live  map[*chunkRef]struct{}
	empty chan struct{} // closed when live becomes empty, replaced on add
}

type chunkRef struct {
	once sync.Once
	buf  *mempool.Buffer
}

// settleGrace is how long Settle waits, once the stream is dead, for gRPC
// to finish a frame it may be writing before it takes the references back.
const settleGrace = 200 * time.Millisecond

// NewChunkRefs returns an empty count, for one stream.
func NewChunkRefs() *ChunkRefs {
	e := make(chan struct{})
	close(e)
	return &ChunkRefs{live: map[*chunkRef]struct{}{}, empty: e}
}

// add counts one reference to buf and returns the function that drops it,
// once, whoever calls it first: gRPC or Settle.
func (r *ChunkRefs) add(buf *mempool.Buffer) func() {
	ref := &chunkRef{buf: buf}
	r.mu.Lock()
	if len(r.live) == 0 {
		r.empty = make(chan struct{})
	}
	r.live[ref] = struct{}{}
	r.mu.Unlock()
	return func() { r.drop(ref) }
}

func (r *ChunkRefs) drop(ref *chunkRef) {
	ref.once.Do(func() {
		r.mu.Lock()
		delete(r.live, ref)
		if len(r.live) == 0 {
			close(r.empty)
		}
		r.mu.Unlock()
		ref.buf.Release()
	})
}

// Settle returns once gRPC has freed every chunk (it has written them), or
// the stream is dead (ctx done) and a grace period has passed; then it
// drops the references gRPC still holds, since a dead stream's queued
// frames are never written.
func (r *ChunkRefs) Settle(ctx context.Context) {
	r.mu.Lock()
	empty := r.empty
	r.mu.Unlock()
	select {
	case <-empty:
		return
	case <-ctx.Done():
	}
	select {
	case <-empty:
		return
	case <-time.After(settleGrace):
	}
	r.mu.Lock()
	left := make([]*chunkRef, 0, len(r.live))
	for ref := range r.live {
		left = append(left, ref)
	}
	r.mu.Unlock()
	for _, ref := range left {
		r.drop(ref)
	}
}
