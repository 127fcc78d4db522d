//go:build linux

package mempool

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestConcurrentStress has goroutines allocate (waiting when the pool is
// full), fill, check, hand over and release buffers while others add and
// remove hooks, read stats and locate addresses, and arenas come and go.
// Each buffer is filled with its owner's pattern and checked before it is
// released, which catches two goroutines sharing memory; under -race the
// allocator verifies itself after every operation.
func TestConcurrentStress(t *testing.T) {
	defer leakcheck.Check(t)
	p := newTestPool(t, WithArenaSize(256<<10), WithLimit(4<<20), WithReleaseEmptyArenas(true))
	const workers, ops = 6, 5000
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	var hooked atomic.Int64    // arenas registered by the churning hook
	var exhausted atomic.Int64 // TryAllocs that found the pool full
	handoff := make(chan *Buffer, 16)
	var wg, side sync.WaitGroup
	stop := make(chan struct{})

	// Receives buffers handed over by the workers and releases them.
	side.Add(1)
	go func() {
		defer side.Done()
		for b := range handoff {
			if err := checkPattern(b); err != nil {
				t.Error(err)
			}
			if err := b.Release(); err != nil {
				t.Error(err)
			}
		}
	}()
	// Churns a hook, reads stats and locates addresses.
	side.Add(1)
	go func() {
		defer side.Done()
		h := HookFuncs{
			Added:   func(*Arena) error { hooked.Add(1); return nil },
			Removed: func(*Arena) { hooked.Add(-1) },
		}
		for {
			select {
			case <-stop:
				return
			default:
			}
			remove, err := p.AddHook(h)
			if err != nil {
				t.Error(err)
				return
			}
			for _, a := range p.Arenas() {
				if x, off, ok := p.Locate(a.Addr() + 10); ok && (x != a || off != 10) {
					t.Errorf("Locate in %v: %v %d", a, x, off)
				}
			}
			if s := p.Stats(); s.InUse > s.Reserved || s.Reserved > 4<<20 {
				t.Errorf("Stats %+v", s)
			}
			remove()
			if n := hooked.Load(); n != 0 {
				t.Errorf("after remove, the hook still holds %d arenas", n)
			}
			time.Sleep(100 * time.Microsecond)
		}
	}()

	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			var mine []*Buffer
			for op := range ops {
				if len(mine) > 0 && (len(mine) >= 8 || rng.IntN(2) == 0) {
					i := rng.IntN(len(mine))
					b := mine[i]
					mine = append(mine[:i], mine[i+1:]...)
					if err := checkPattern(b); err != nil {
						t.Error(err)
						return
					}
					if rng.IntN(4) == 0 {
						b.Retain() // two owners: the receiver releases one
						handoff <- b
					}
					if err := b.Release(); err != nil {
						t.Error(err)
						return
					}
					continue
				}
				n := 1 + rng.IntN(64<<10)
				if rng.IntN(20) == 0 {
					n = 1 + rng.IntN(3<<19)
				}
				var b *Buffer
				var err error
				if len(mine) == 0 {
					// Holding nothing, waiting cannot deadlock: others release.
					b, err = p.Alloc(ctx, n)
				} else if b, err = p.TryAlloc(n); errors.Is(err, ErrExhausted) {
					exhausted.Add(1)
					continue
				}
				if err != nil {
					t.Errorf("worker %d op %d: %v", w, op, err)
					return
				}
				fillPattern(b, byte(w*16+op))
				mine = append(mine, b)
			}
			for _, b := range mine {
				if err := b.Release(); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	close(handoff)
	side.Wait()
	s := p.Stats()
	if s.TotalAllocs < workers*ops/4 {
		t.Errorf("only %d allocations", s.TotalAllocs)
	}
	t.Logf("%d allocations, %d found the pool full; peak %d KiB of %d KiB reserved", s.TotalAllocs, exhausted.Load(), s.Peak>>10, s.Reserved>>10)
	closePool(t, p)
}

// fillPattern writes seed+7j into byte j of the buffer's first and last 64
// bytes (all of it when small).
func fillPattern(b *Buffer, seed byte) {
	mem := b.Bytes()
	for i := range min(64, len(mem)) {
		mem[i] = seed + byte(i)*7
		j := len(mem) - 1 - i
		mem[j] = seed + byte(j)*7
	}
}

func checkPattern(b *Buffer) error {
	mem := b.Bytes()
	seed := mem[0]
	for i := range min(64, len(mem)) {
		if j := len(mem) - 1 - i; mem[i] != seed+byte(i)*7 || mem[j] != seed+byte(j)*7 {
			return errors.New("mempool test: buffer contents changed under its owner: " + b.String())
		}
	}
	return nil
}
