package rpc

import (
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Tensor is a tensor whose memory tensorrpc manages: received tensors, and
// tensors allocated with Client.NewTensor or Server.NewTensor. It embeds the
// zerocopy.Tensor that describes it.
//
// A Tensor holds a reference to its memory (a pool buffer or a shared-memory
// lease) until Release. Its bytes are valid until then and must not be used
// after. Release is safe to call more than once; only the first call counts.
type Tensor struct {
	zerocopy.Tensor
	buf      *mempool.Buffer // pool memory, or nil for a lease
	mapping  verbs.Mapping   // a lease's mapping of the peer's memory
	release  func()          // runs once, after buf or mapping is released
	released atomic.Bool
	lease    bool
}

// Release gives the tensor's memory back. It is safe to call on a nil
// Tensor and more than once.
func (t *Tensor) Release() {
	if t == nil || !t.released.CompareAndSwap(false, true) {
		return
	}
	if t.buf != nil {
		t.buf.Release() // cannot fail: t held exactly one reference
	}
	if t.mapping != nil {
		t.mapping.Release() // unmaps it unless another lease shares the pages
	}
	if t.release != nil {
		t.release()
	}
}

// Leased reports whether the tensor is a zero-copy shared-memory lease of
// the peer's memory rather than a copy in the local pool. A leased tensor
// is read-only: writing its bytes faults.
func (t *Tensor) Leased() bool { return t.lease }

// newPoolTensor makes a Tensor over buf, which it takes over (buf's
// reference becomes the tensor's).
func newPoolTensor(dtype zerocopy.DType, shape []int64, buf *mempool.Buffer) (*Tensor, error) {
	zt, err := zerocopy.New(dtype, shape, buf.Bytes())
	if err != nil {
		buf.Release()
		return nil, err
	}
	return &Tensor{Tensor: zt, buf: buf}, nil
}

// Message is what a method handler receives and returns: free-form metadata
// and any number of tensors.
type Message struct {
	Metadata []byte
	Tensors  []*Tensor
}

// Release releases every tensor of the message.
func (m *Message) Release() {
	if m == nil {
		return
	}
	for _, t := range m.Tensors {
		t.Release()
	}
}

// WrapTensor makes a Tensor over memory the caller owns, such as a Go
// slice, so it can be published, sent or returned from a handler. tensorrpc
// copies such a tensor into pool memory once when it uses it (the copy is
// counted in Stats.Copies); tensors allocated with NewTensor avoid that
// copy. The caller keeps the memory valid until the call that uses the
// tensor returns. Release of a wrapped tensor does nothing to its memory.
func WrapTensor(t zerocopy.Tensor) *Tensor { return &Tensor{Tensor: t} }
