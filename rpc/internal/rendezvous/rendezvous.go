// Package rendezvous holds a server's published tensors and the fetches
// waiting for them: a key maps to one tensor and one reference to its pool
// buffer, and a fetch of a key not yet published waits until it is, its
// context ends or the server stops. It knows nothing of sessions, planes
// or rpc.Tensor; rpc's Server.send is the one way tensors come in.
package rendezvous

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Entry is a published tensor: its description and one reference to its
// pool buffer, owned by the rendezvous.
type Entry struct {
	Tensor zerocopy.Tensor
	Buf    *mempool.Buffer
	// Seq orders the Sends and Publishes of a key by when the server took
	// them in (0: at publish), so that a Send whose bytes the server pulls
	// and lands after a later inline Send of the same key does not replace
	// it.
	Seq uint64
	// Writable: sessions may write rows of it (Publish with Writable).
	Writable bool
}

// ErrNotPublished is a fetch of a key that is not published, without
// waiting.
var ErrNotPublished = errors.New("not published")

// ErrClosed is a publish or fetch after Close, or a wait ended by Stop.
var ErrClosed = errors.New("tensorrpc: closed")

// Rendezvous maps keys to published tensors. Fetches of a key not yet
// published wait for it until their context ends. It is safe for
// concurrent use.
type Rendezvous struct {
	mu      sync.Mutex
	entries map[string]Entry
	waiters map[string][]chan struct{}
	closed  bool
	// stopping is closed when the server stops: waiting fetches give up.
	stopping chan struct{}
	stopOnce sync.Once
	lastSeq  atomic.Uint64
}

// NextSeq numbers a Send or Publish as the server takes it in.
func (r *Rendezvous) NextSeq() uint64 { return r.lastSeq.Add(1) }

// New returns an empty rendezvous.
func New() *Rendezvous {
	return &Rendezvous{entries: make(map[string]Entry), waiters: make(map[string][]chan struct{}), stopping: make(chan struct{})}
}

// Publish stores e under key, taking over e's buffer reference, and wakes
// the key's waiters. A previous entry under key is released.
func (r *Rendezvous) Publish(key string, e Entry) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		e.Buf.Release()
		return ErrClosed
	}
	if e.Seq == 0 {
		e.Seq = r.NextSeq()
	}
	old, had := r.entries[key]
	if had && old.Seq > e.Seq {
		// A later Send or Publish of the key is already in place.
		r.mu.Unlock()
		e.Buf.Release()
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
		old.Buf.Release()
	}
	return nil
}

// Fetch returns the entry under key with an extra buffer reference for the
// caller. A key that is not
// published fails with ErrNotPublished, unless wait: then fetch waits until
// it is published or ctx ends. With take, the
// entry is removed and the rendezvous's own reference passes to the caller.
func (r *Rendezvous) Fetch(ctx context.Context, key string, take, wait bool) (Entry, error) {
	for {
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			return Entry{}, ErrClosed
		}
		if e, ok := r.entries[key]; ok {
			if take {
				delete(r.entries, key)
			} else {
				e.Buf.Retain()
			}
			r.mu.Unlock()
			return e, nil
		}
		if !wait {
			r.mu.Unlock()
			return Entry{}, ErrNotPublished
		}
		w := make(chan struct{})
		r.waiters[key] = append(r.waiters[key], w)
		r.mu.Unlock()
		select {
		case <-w:
		case <-ctx.Done():
			r.dropWaiter(key, w)
			return Entry{}, ctx.Err()
		case <-r.stopping:
			r.dropWaiter(key, w)
			return Entry{}, ErrClosed
		}
	}
}

// TryFetch is Fetch without waiting, ever: ErrNotPublished, or the entry
// with an extra reference for the caller.
func (r *Rendezvous) TryFetch(key string) (Entry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch e, ok := r.entries[key]; {
	case r.closed:
		return Entry{}, ErrClosed
	case !ok:
		return Entry{}, ErrNotPublished
	default:
		e.Buf.Retain()
		return e, nil
	}
}

// Stop makes waiting and later waits for a key fail with ErrClosed;
// published entries stay fetchable until Close.
func (r *Rendezvous) Stop() { r.stopOnce.Do(func() { close(r.stopping) }) }

func (r *Rendezvous) dropWaiter(key string, w chan struct{}) {
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

// Remove drops key and releases its buffer. It reports whether key was
// published.
func (r *Rendezvous) Remove(key string) bool {
	r.mu.Lock()
	e, ok := r.entries[key]
	delete(r.entries, key)
	r.mu.Unlock()
	if ok {
		e.Buf.Release()
	}
	return ok
}

// Close releases every entry and fails waiting and later fetches.
func (r *Rendezvous) Close() {
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
		e.Buf.Release()
	}
}
