package gpudirect

import (
	"context"
	"fmt"

	"github.com/tensorrpc/tensorrpc/mempool"
)

// Pipelined staging: a device tensor moves through a ring of a few pool
// slots, a chunk at a time, its device copies asynchronous on a stream
// the transfer owns. Sending, the device-to-host copy of the next chunks
// runs while the data plane moves the current one; receiving, the data
// plane fills the next slot while the host-to-device copy of the current
// one runs. A transfer then takes about the time of its slowest stage,
// not the sum of both.

// DefaultStageChunk is the size of one chunk of a pipelined staged
// transfer, 8 MiB: large enough that a chunk's data-plane transfer and
// device copy cost far more than their set-up (a few µs each), small
// enough that the first and last chunks, which do not overlap, are a
// small part of a tensor of hundreds of MiB.
const DefaultStageChunk = 8 << 20

// DefaultStageSlots is the number of chunks a ring holds, 3: one being
// copied, one moving on the data plane, one of slack between them.
const DefaultStageSlots = 3

// StageRing sizes the ring of a pipelined staged transfer; zero fields
// take the defaults.
type StageRing struct {
	Chunk int // bytes per chunk; DefaultStageChunk when 0
	Slots int // chunks in the ring; DefaultStageSlots when 0
}

func (r StageRing) sized(n int) (chunk, slots, chunks, ring int) {
	chunk, slots = r.Chunk, r.Slots
	if chunk <= 0 {
		chunk = DefaultStageChunk
	}
	if slots <= 0 {
		slots = DefaultStageSlots
	}
	chunks = (n + chunk - 1) / chunk
	slots = min(slots, chunks)
	return chunk, slots, chunks, min(n, slots*chunk)
}

// StageChunk is one chunk of a pipelined staged transfer: bytes [Pos,
// Pos+Len) of the tensor, held in Ring from At on. Ring is the whole
// ring's pool buffer: a data-plane operation that may outlive the
// callback it was started in (one abandoned on cancellation) Retains it,
// and Releases it when the operation completes.
type StageChunk struct {
	Index, Pos, Len int
	Ring            *mempool.Buffer
	At              int
}

// Bytes returns the chunk's slot.
func (c StageChunk) Bytes() []byte { return c.Ring.Bytes()[c.At : c.At+c.Len] }

func chunkOf(ring *mempool.Buffer, i, chunk, slots, n int) StageChunk {
	pos := i * chunk
	return StageChunk{Index: i, Pos: pos, Len: min(chunk, n-pos), Ring: ring, At: (i % slots) * chunk}
}

// pipeline is what both directions of a pipelined staging hold: the ring
// of pool slots, the stream its copies run on, the event of each slot's
// copy, and the chunking.
type pipeline struct {
	ring                 *mempool.Buffer
	stream               Stream
	events               []Event
	chunk, slots, chunks int
}

// openPipeline checks the range and opens the ring and its stream; it
// returns a nil pipeline, and nil or the error, when there is nothing to
// move or it cannot.
func openPipeline(ctx context.Context, pool *mempool.Pool, buf AsyncBuffer, offset, n int, ring StageRing) (*pipeline, error) {
	if err := checkRange(buf.Device(), buf.Len(), offset, n); err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, nil
	}
	chunk, slots, chunks, size := ring.sized(n)
	r, st, err := openRing(ctx, pool, buf, size)
	if err != nil {
		return nil, err
	}
	return &pipeline{ring: r, stream: st, events: make([]Event, slots), chunk: chunk, slots: slots, chunks: chunks}, nil
}

// close waits for the copies' events and gives the ring back.
func (p *pipeline) close() {
	closeEvents(p.events)
	closeRing(p.ring, p.stream)
}

// StageOutPipelined sends n bytes of buf from offset through a ring of
// pool slots: it copies chunks to the host asynchronously, a ring ahead,
// and calls send with each chunk, in order, once its copy has completed.
// When send returns nil the chunk's slot is reused. It returns send's
// first error, the copies' first, or ctx's; it returns only when no copy
// into the ring is under way any more, having released the ring (a
// send's operation that Retained it keeps it).
func StageOutPipelined(ctx context.Context, pool *mempool.Pool, buf AsyncBuffer, offset, n int, ring StageRing, send func(context.Context, StageChunk) error) error {
	p, err := openPipeline(ctx, pool, buf, offset, n, ring)
	if p == nil {
		return err
	}
	defer p.close()
	r, st, events := p.ring, p.stream, p.events
	chunk, slots, chunks := p.chunk, p.slots, p.chunks
	enqueue := func(i int) error {
		c := chunkOf(r, i, chunk, slots, n)
		if err := st.CopyToHost(c.Bytes(), buf, offset+c.Pos); err != nil {
			return err
		}
		ev, err := st.Record()
		events[i%slots] = ev
		return err
	}
	for i := range slots {
		if err := enqueue(i); err != nil {
			return stageErr("staging", n, buf, err)
		}
	}
	for i := range chunks {
		ev := events[i%slots]
		if err := ev.Wait(ctx); err != nil {
			return stageErr("staging", n, buf, err)
		}
		ev.Close()
		events[i%slots] = nil
		if err := send(ctx, chunkOf(r, i, chunk, slots, n)); err != nil {
			return err
		}
		if next := i + slots; next < chunks {
			if err := enqueue(next); err != nil {
				return stageErr("staging", n, buf, err)
			}
		}
	}
	return nil
}

// StageInPipelined receives n bytes into buf at offset through a ring of
// pool slots: recv fills each chunk's slot, in order, and the slot is
// copied to the device asynchronously while recv fills the next ones; a
// slot is refilled only after its copy has completed. It returns recv's
// first error, the copies' first, or ctx's, and returns only when every
// copy it enqueued has completed (so buf holds the bytes when it returns
// nil), having released the ring (a recv's operation that Retained it
// keeps it).
func StageInPipelined(ctx context.Context, pool *mempool.Pool, buf AsyncBuffer, offset, n int, ring StageRing, recv func(context.Context, StageChunk) error) error {
	p, err := openPipeline(ctx, pool, buf, offset, n, ring)
	if p == nil {
		return err
	}
	defer p.close()
	r, st, events := p.ring, p.stream, p.events
	chunk, slots, chunks := p.chunk, p.slots, p.chunks
	for i := range chunks {
		if ev := events[i%slots]; ev != nil {
			if err := ev.Wait(ctx); err != nil {
				return stageErr("unstaging", n, buf, err)
			}
			ev.Close()
			events[i%slots] = nil
		}
		c := chunkOf(r, i, chunk, slots, n)
		if err := recv(ctx, c); err != nil {
			return err
		}
		if err := st.CopyFromHost(buf, offset+c.Pos, c.Bytes()); err != nil {
			return stageErr("unstaging", n, buf, err)
		}
		ev, err := st.Record()
		if err != nil {
			return stageErr("unstaging", n, buf, err)
		}
		events[i%slots] = ev
	}
	for i, ev := range events {
		if ev == nil {
			continue
		}
		if err := ev.Wait(ctx); err != nil {
			return stageErr("unstaging", n, buf, err)
		}
		ev.Close()
		events[i] = nil
	}
	return nil
}

func openRing(ctx context.Context, pool *mempool.Pool, buf AsyncBuffer, size int) (*mempool.Buffer, Stream, error) {
	st, err := buf.NewStream()
	if err != nil {
		return nil, nil, fmt.Errorf("gpudirect: a stream of %s: %w", buf.Device(), err)
	}
	r, err := pool.Alloc(ctx, size)
	if err != nil {
		st.Close()
		return nil, nil, err
	}
	return r, st, nil
}

// closeRing closes the stream, which waits for every copy enqueued on it
// (also those a cancelled transfer left behind), and only then gives the
// ring back.
func closeRing(r *mempool.Buffer, st Stream) {
	st.Close()
	r.Release()
}

func closeEvents(events []Event) {
	for _, ev := range events {
		if ev != nil {
			ev.Close()
		}
	}
}

func stageErr(what string, n int, buf DeviceBuffer, err error) error {
	if err == context.Canceled || err == context.DeadlineExceeded {
		return err
	}
	return fmt.Errorf("gpudirect: %s %d bytes of %s: %w", what, n, buf.Device(), err)
}

// StageOutAsync is StageOut through a stream of buf's device: the copy
// into the pool buffer is asynchronous (DMA when the pool is pinned), and
// waited for. When ctx ends first it still waits for the copy, then
// releases the pool buffer and returns ctx's error.
func StageOutAsync(ctx context.Context, pool *mempool.Pool, buf AsyncBuffer, offset, length int) (*mempool.Buffer, error) {
	if err := checkRange(buf.Device(), buf.Len(), offset, length); err != nil {
		return nil, err
	}
	host, st, err := openRing(ctx, pool, buf, length)
	if err != nil {
		return nil, fmt.Errorf("gpudirect: staging %d bytes of %s: %w", length, buf.Device(), err)
	}
	err = copyAndWait(ctx, st, func() error { return st.CopyToHost(host.Bytes()[:length], buf, offset) })
	if cerr := st.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		host.Release()
		return nil, stageErr("staging", length, buf, err)
	}
	return host, nil
}

// StageInAsync is StageIn through a stream of buf's device. It returns
// when the copy has completed, also when ctx ended first (with ctx's
// error then): src may be reused when it returns.
func StageInAsync(ctx context.Context, buf AsyncBuffer, offset int, src []byte) error {
	if len(src) == 0 {
		return checkRange(buf.Device(), buf.Len(), offset, 0)
	}
	st, err := buf.NewStream()
	if err != nil {
		return fmt.Errorf("gpudirect: a stream of %s: %w", buf.Device(), err)
	}
	err = copyAndWait(ctx, st, func() error { return st.CopyFromHost(buf, offset, src) })
	if cerr := st.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return stageErr("unstaging", len(src), buf, err)
	}
	return nil
}

func copyAndWait(ctx context.Context, st Stream, enqueue func() error) error {
	if err := enqueue(); err != nil {
		return err
	}
	ev, err := st.Record()
	if err != nil {
		return err
	}
	defer ev.Close()
	return ev.Wait(ctx)
}
