package gpudirect

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
)

// TestStagePipelined moves sizes around the chunk size through a small
// ring, on a host-fake device whose copies run late, and checks the
// bytes, the chunk boundaries and that pinning registered each arena once.
func TestStagePipelined(t *testing.T) {
	defer leakcheck.Check(t)
	pool, err := mempool.NewPool(mempool.WithPinning(false), mempool.WithArenaSize(256<<10), mempool.WithLimit(8<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	a := NewHostAllocator(HostCopyDelay(time.Millisecond))
	pin := NewPinner(pool)
	ring := StageRing{Chunk: 4096, Slots: 3}
	for _, n := range []int{0, 1, 4095, 4096, 4097, 3*4096 + 5, 40000} {
		src := mustAlloc(t, a, n+7).(AsyncBuffer)
		dst := mustAlloc(t, a, n+3).(AsyncBuffer)
		if err := pin.Pin(src.HostRegistrar()); err != nil {
			t.Fatal(err)
		}
		want := make([]byte, n)
		for i := range want {
			want[i] = byte(i*7 + i>>12)
		}
		src.CopyFromHost(want, 7)
		var wire []byte
		var next int
		err := StageOutPipelined(context.Background(), pool, src, 7, n, ring, func(_ context.Context, c StageChunk) error {
			if c.Pos != next || c.Len > 4096 || c.Len == 0 || c.Index != c.Pos/4096 {
				t.Fatalf("n=%d: chunk %+v after %d", n, c, next)
			}
			next += c.Len
			wire = append(wire, c.Bytes()...)
			return nil
		})
		if err != nil || next != n || !bytes.Equal(wire, want) {
			t.Fatalf("n=%d: staged out %d bytes, equal %v, %v", n, next, bytes.Equal(wire, want), err)
		}
		err = StageInPipelined(context.Background(), pool, dst, 3, n, ring, func(_ context.Context, c StageChunk) error {
			copy(c.Bytes(), wire[c.Pos:])
			return nil
		})
		got := make([]byte, n)
		dst.CopyToHost(got, 3)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("n=%d: staged in, equal %v, %v", n, bytes.Equal(got, want), err)
		}
		src.Free()
		dst.Free()
	}
	hs, ps := a.Stats(), pin.Stats()
	if hs.Registered != len(pool.Arenas()) || int64(hs.Registered) != hs.Registrations || ps.Arenas != hs.Registered || ps.Failed != 0 {
		t.Fatalf("registrations %+v, pins %+v, %d arenas", hs, ps, len(pool.Arenas()))
	}
	// A second Pinner of the pool shares the registrations.
	pin2 := NewPinner(pool)
	b := mustAlloc(t, a, 1).(AsyncBuffer)
	pin2.Pin(b.HostRegistrar())
	pin.Close()
	if s := a.Stats(); s.Registered != hs.Registered || s.Unregistrations != 0 {
		t.Fatalf("one of two pinners closed: %+v", s)
	}
	pin2.Close()
	if s := a.Stats(); s.Registered != 0 || s.Unregistrations != hs.Registrations {
		t.Fatalf("after Close: %+v", s)
	}
	if err := pin2.Pin(b.HostRegistrar()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Pin after Close: %v", err)
	}
	b.Free()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if ps := pool.Stats(); ps.Allocs != 0 {
		t.Fatalf("pool: %+v", ps)
	}
}

// TestStagePipelinedCancel: a transfer cancelled while copies are in
// flight returns ctx's error after they completed, leaving no stream and
// no pool buffer.
func TestStagePipelinedCancel(t *testing.T) {
	defer leakcheck.Check(t)
	pool, err := mempool.NewPool(mempool.WithPinning(false), mempool.WithLimit(8<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	a := NewHostAllocator(HostCopyDelay(5 * time.Millisecond))
	buf := mustAlloc(t, a, 1<<20).(AsyncBuffer)
	ctx, cancel := context.WithCancel(context.Background())
	err = StageOutPipelined(ctx, pool, buf, 0, 1<<20, StageRing{Chunk: 64 << 10}, func(_ context.Context, c StageChunk) error {
		if c.Index == 2 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled StageOutPipelined: %v", err)
	}
	ctx, cancel = context.WithCancel(context.Background())
	err = StageInPipelined(ctx, pool, buf, 0, 1<<20, StageRing{Chunk: 64 << 10}, func(ctx context.Context, c StageChunk) error {
		if c.Index == 3 {
			cancel()
			return ctx.Err()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled StageInPipelined: %v", err)
	}
	if s := a.Stats(); s.Streams != 0 {
		t.Fatalf("streams left: %+v", s)
	}
	if ps := pool.Stats(); ps.Allocs != 0 {
		t.Fatalf("pool: %+v", ps)
	}
	buf.Free()
	cancel()
}

// TestPinNilRegistrar: a device with no registrar (nothing to pin host
// memory with) pins nothing and is no error.
func TestPinNilRegistrar(t *testing.T) {
	pool, err := mempool.NewPool(mempool.WithPinning(false), mempool.WithLimit(8<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	b, err := pool.Alloc(context.Background(), 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Release()
	pin := NewPinner(pool)
	defer pin.Close()
	if err := pin.Pin(nil); err != nil {
		t.Fatalf("Pin(nil) = %v", err)
	}
	if pin.Pinned(nil, b.Arena()) || pin.Stats().Arenas != 0 {
		t.Errorf("Pin(nil) pinned something: %+v", pin.Stats())
	}
}
