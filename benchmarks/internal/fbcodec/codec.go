// Package fbcodec is a gRPC codec (encoding.CodecV2) for FlatBuffers
// messages and raw bytes: the best a team can do with FlatBuffers on gRPC.
// A message is encoded once, by the application into a flatbuffers.Builder;
// the codec hands the builder's bytes to gRPC without copying them, and on
// receive gives the application the message's bytes in one buffer, to read
// in place.
//
// # Basics
//
// Send a *Builder (its builder goes back to its pool when gRPC has written
// it), a *flatbuffers.Builder or a []byte; receive into a *Frame, read
// Frame.Bytes with the generated accessors, then Free the frame.
//
// # Caveats
//
// A Frame's bytes are valid until Free. A builder handed to gRPC inside a
// *Builder must not be used again by the caller.
package fbcodec

import (
	"fmt"
	"sync"

	flatbuffers "github.com/google/flatbuffers/go"
	"google.golang.org/grpc/mem"
)

// Name is the codec's name, the content subtype gRPC puts in the
// content-type header ("application/grpc+tensorbench-fb").
const Name = "tensorbench-fb"

// Codec implements encoding.CodecV2 for FlatBuffers messages.
type Codec struct{}

// Name returns Name.
func (Codec) Name() string { return Name }

// Marshal returns v's bytes without copying them. v is a *Builder, a
// finished *flatbuffers.Builder or a []byte.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	switch v := v.(type) {
	case *Builder:
		b := v.Builder.FinishedBytes()
		return mem.BufferSlice{mem.NewBuffer(&b, releaser{v})}, nil
	case *flatbuffers.Builder:
		return mem.BufferSlice{mem.SliceBuffer(v.FinishedBytes())}, nil
	case []byte:
		return mem.BufferSlice{mem.SliceBuffer(v)}, nil
	}
	return nil, fmt.Errorf("fbcodec: cannot marshal %T", v)
}

// Unmarshal keeps the received message in one buffer: a reference to
// gRPC's buffer when the message arrived in one piece, else one copy into a
// pooled buffer. v must be a *Frame.
func (Codec) Unmarshal(data mem.BufferSlice, v any) error {
	f, ok := v.(*Frame)
	if !ok {
		return fmt.Errorf("fbcodec: cannot unmarshal into %T", v)
	}
	f.Free()
	f.buf = data.MaterializeToBuffer(mem.DefaultBufferPool())
	return nil
}

// Frame is a received message, in one buffer.
type Frame struct {
	buf mem.Buffer
}

// Bytes returns the message. They are valid until Free.
func (f *Frame) Bytes() []byte {
	if f.buf == nil {
		return nil
	}
	return f.buf.ReadOnlyData()
}

// Free gives the frame's buffer back to gRPC's pool.
func (f *Frame) Free() {
	if f.buf != nil {
		f.buf.Free()
		f.buf = nil
	}
}

// Builder is a flatbuffers.Builder from a BuilderPool. Marshal hands its
// finished bytes to gRPC and puts it back in the pool when gRPC is done
// with them, so a server encodes every reply into a warm builder instead of
// growing a new one.
type Builder struct {
	*flatbuffers.Builder
	pool *BuilderPool
}

// BuilderPool recycles Builders. The zero value is ready to use.
type BuilderPool struct {
	pool sync.Pool
}

// Get returns a reset Builder with room for at least size bytes.
//
// Sizing the builder up front matters beyond speed: a Builder grows by
// doubling, and FlatBuffers cannot exceed 2 GiB, so a builder that grows
// its way past 1 GiB panics where one made large enough does not.
func (p *BuilderPool) Get(size int) *Builder {
	b, _ := p.pool.Get().(*Builder)
	if b == nil || cap(b.Bytes) < size {
		return &Builder{Builder: flatbuffers.NewBuilder(max(size, 1024)), pool: p}
	}
	b.Reset()
	return b
}

// Put returns b to its pool.
func (p *BuilderPool) Put(b *Builder) { p.pool.Put(b) }

// releaser is the mem.BufferPool of one marshalled Builder: gRPC "returns"
// the bytes to it when it has written them, which returns the builder.
type releaser struct{ b *Builder }

func (r releaser) Get(length int) *[]byte {
	b := make([]byte, length)
	return &b
}

func (r releaser) Put(*[]byte) {
	if r.b.pool != nil {
		r.b.pool.Put(r.b)
	}
}
