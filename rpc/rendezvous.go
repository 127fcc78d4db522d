package rpc

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// entry is a published tensor: its description and one reference to its
// pool buffer, owned by the rendezvous.
type entry struct {
	tensor zerocopy.Tensor
	buf    *mempool.Buffer
	// seq orders the Sends and Publishes of a key by when the server took
	// them in (0: at publish), so that a Send whose bytes the server pulls
	// and lands after a later inline Send of the same key does not replace
	// it.
	seq uint64
}

// errNotPublished is a fetch of a key that is not published, without
// waiting.
var errNotPublished = errors.New("not published")

// rendezvous maps keys to published tensors. Fetches of a key not yet
// published wait for it until their context ends.
type rendezvous struct {
	mu      sync.Mutex
	entries map[string]entry
	waiters map[string][]chan struct{}
	closed  bool
	// stopping is closed when the server stops: waiting fetches give up.
	stopping chan struct{}
	stopOnce sync.Once
	lastSeq  atomic.Uint64
}

// nextSeq numbers a Send or Publish as the server takes it in.
func (r *rendezvous) nextSeq() uint64 { return r.lastSeq.Add(1) }

func newRendezvous() *rendezvous {
	return &rendezvous{entries: make(map[string]entry), waiters: make(map[string][]chan struct{}), stopping: make(chan struct{})}
}

// publish stores e under key, taking over e's buffer reference, and wakes
// the key's waiters. A previous entry under key is released.
func (r *rendezvous) publish(key string, e entry) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		e.buf.Release()
		return errClosed
	}
	if e.seq == 0 {
		e.seq = r.nextSeq()
	}
	old, had := r.entries[key]
	if had && old.seq > e.seq {
		// A later Send or Publish of the key is already in place.
		r.mu.Unlock()
		e.buf.Release()
		return nil
	}
	r.entries[key] = e
	ws := r.waiters[key]
	delete(r.waiters, key)
	r.mu.Unlock()
	for _, w := range ws {
		close(w)
	}
	if had {
		old.buf.Release()
	}
	return nil
}

// fetch returns the entry under key with an extra buffer reference for the
// caller. A key that is not
// published fails with errNotPublished, unless wait: then fetch waits until
// it is published or ctx ends. With take, the
// entry is removed and the rendezvous's own reference passes to the caller.
func (r *rendezvous) fetch(ctx context.Context, key string, take, wait bool) (entry, error) {
	for {
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			return entry{}, errClosed
		}
		if e, ok := r.entries[key]; ok {
			if take {
				delete(r.entries, key)
			} else {
				e.buf.Retain()
			}
			r.mu.Unlock()
			return e, nil
		}
		if !wait {
			r.mu.Unlock()
			return entry{}, errNotPublished
		}
		w := make(chan struct{})
		r.waiters[key] = append(r.waiters[key], w)
		r.mu.Unlock()
		select {
		case <-w:
		case <-ctx.Done():
			r.dropWaiter(key, w)
			return entry{}, ctx.Err()
		case <-r.stopping:
			r.dropWaiter(key, w)
			return entry{}, errClosed
		}
	}
}

// tryFetch is fetch without waiting, ever: errNotPublished, or the entry
// with an extra reference for the caller.
func (r *rendezvous) tryFetch(key string) (entry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch e, ok := r.entries[key]; {
	case r.closed:
		return entry{}, errClosed
	case !ok:
		return entry{}, errNotPublished
	default:
		e.buf.Retain()
		return e, nil
	}
}

// stop makes waiting and later waits for a key fail with errClosed;
// published entries stay fetchable until close.
func (r *rendezvous) stop() { r.stopOnce.Do(func() { close(r.stopping) }) }

func (r *rendezvous) dropWaiter(key string, w chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ws := r.waiters[key]
	for i, x := range ws {
		if x == w {
			ws = append(ws[:i], ws[i+1:]...)
			break
		}
	}
	if len(ws) == 0 {
		delete(r.waiters, key)
	} else {
		r.waiters[key] = ws
	}
}

// remove drops key and releases its buffer. It reports whether key was
// published.
func (r *rendezvous) remove(key string) bool {
	r.mu.Lock()
	e, ok := r.entries[key]
	delete(r.entries, key)
	r.mu.Unlock()
	if ok {
		e.buf.Release()
	}
	return ok
}

// close releases every entry and fails waiting and later fetches.
func (r *rendezvous) close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	entries := r.entries
	waiters := r.waiters
	r.entries, r.waiters = nil, nil
	r.mu.Unlock()
	for _, ws := range waiters {
		for _, w := range ws {
			close(w)
		}
	}
	for _, e := range entries {
		e.buf.Release()
	}
}
