//go:build linux

package mempool

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"golang.org/x/sys/unix"
)

var benchSizes = []struct {
	name string
	n    int
}{{"256B", 256}, {"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"64MiB", 64 << 20}}

var sink []byte

// BenchmarkAllocFree measures an alloc+free pair from a pinned pool, beside
// make([]byte, n) (which the GC must zero and later collect) and beside a
// fresh mmap+mlock+munmap per buffer, the cost of pinning (registering) per
// message that the pool exists to avoid. Pool set-up, including pinning its
// arena, is outside the timed loop.
func BenchmarkAllocFree(b *testing.B) {
	ctx := context.Background()
	for _, sz := range benchSizes {
		n := sz.n
		newPool := func(b *testing.B) *Pool {
			p, err := NewPool(WithArenaSize(max(4<<20, 4*n)))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				if err := p.Close(); err != nil {
					b.Error(err)
				}
			})
			return p
		}
		b.Run(sz.name+"/pool", func(b *testing.B) {
			p := newPool(b)
			b.SetBytes(int64(n))
			b.ReportAllocs()
			for b.Loop() {
				buf, err := p.Alloc(ctx, n)
				if err != nil {
					b.Fatal(err)
				}
				_ = buf.Release()
			}
		})
		b.Run(sz.name+"/pool-parallel", func(b *testing.B) {
			p := newPool(b)
			b.SetBytes(int64(n))
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					buf, err := p.Alloc(ctx, n)
					if err != nil {
						b.Error(err)
						return
					}
					_ = buf.Release()
				}
			})
		})
		b.Run(sz.name+"/make", func(b *testing.B) {
			b.SetBytes(int64(n))
			b.ReportAllocs()
			for b.Loop() {
				sink = make([]byte, n)
			}
		})
		b.Run(sz.name+"/make-parallel", func(b *testing.B) {
			b.SetBytes(int64(n))
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				var local []byte
				for pb.Next() {
					local = make([]byte, n)
				}
				_ = local
			})
		})
		b.Run(sz.name+"/mmap-mlock", func(b *testing.B) {
			b.SetBytes(int64(n))
			b.ReportAllocs()
			for b.Loop() {
				mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
				if err != nil {
					b.Fatal(err)
				}
				if err := unix.Mlock(mem); err != nil {
					_ = unix.Munmap(mem)
					b.Skipf("mlock %d bytes: %v", n, err)
				}
				if err := unix.Munmap(mem); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkAllocFreeFragmented measures an alloc+free pair in a pool that
// already holds thousands of live buffers and free holes, so the bins are
// deep trees rather than one free chunk.
func BenchmarkAllocFreeFragmented(b *testing.B) {
	p, err := NewPool(WithArenaSize(64<<20), WithPinning(false))
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	var live []*Buffer
	for range 8000 {
		buf, err := p.TryAlloc(256 + rng.IntN(16<<10))
		if err != nil {
			b.Fatal(err)
		}
		live = append(live, buf)
	}
	for i := 0; i < len(live); i += 2 {
		_ = live[i].Release()
	}
	s := p.Stats()
	b.Logf("%d free blocks, fragmentation %.3f", s.FreeBlocks, s.Fragmentation)
	sizes := make([]int, 1024)
	for i := range sizes {
		sizes[i] = 256 + rng.IntN(16<<10)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		buf, err := p.TryAlloc(sizes[i%len(sizes)])
		if err != nil {
			b.Fatal(err)
		}
		_ = buf.Release()
		i++
	}
	b.StopTimer()
	for i := 1; i < len(live); i += 2 {
		_ = live[i].Release()
	}
	if err := p.Close(); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkTrainingTrace replays a training-like trace (see trainingTrace)
// and reports the pool's fragmentation at each step's peak and end.
func BenchmarkTrainingTrace(b *testing.B) {
	p, err := NewPool(WithArenaSize(16<<20), WithLimit(1<<30), WithPinning(false))
	if err != nil {
		b.Fatal(err)
	}
	var r traceReport
	b.ReportAllocs()
	for b.Loop() {
		r = trainingTrace(p, 20, 7)
	}
	b.ReportMetric(float64(r.allocs), "allocs/trace")
	b.ReportMetric(r.maxPeakFrag, "max-frag-at-peak")
	b.ReportMetric(r.endFrag, "frag-at-end")
	b.ReportMetric(float64(r.reserved)/float64(r.peakInUse), "reserved/peak")
	if err := p.Close(); err != nil {
		b.Fatal(err)
	}
}

type traceReport struct {
	allocs                  int
	meanPeakFrag            float64
	maxPeakFrag             float64
	endFrag                 float64
	reserved, peakInUse     int64
	wasteAtPeak             float64 // (Reserved − InUse) / Reserved at the steps' peaks, mean
	largestFreeAtEnd, inUse int64
}

// trainingTrace runs steps of a training-like workload on p: a few
// long-lived parameter and optimizer buffers allocated up front, then per
// step a forward pass that allocates activations of varied sizes, a
// backward pass that frees them mostly in reverse while allocating and
// freeing gradients, and now and then a parameter buffer that is replaced
// (as when a layer is resized or an embedding grows). It leaves only the
// parameters live and then frees them too.
func trainingTrace(p *Pool, steps int, seed uint64) traceReport {
	rng := rand.New(rand.NewPCG(seed, seed))
	must := func(buf *Buffer, err error) *Buffer {
		if err != nil {
			panic(fmt.Sprintf("training trace: %v", err))
		}
		return buf
	}
	release := func(buf *Buffer) {
		if err := buf.Release(); err != nil {
			panic(fmt.Sprintf("training trace: %v", err))
		}
	}
	var r traceReport
	ctx := context.Background()
	var params []*Buffer
	for range 24 {
		params = append(params, must(p.Alloc(ctx, 256<<10+rng.IntN(8<<20))))
		r.allocs++
	}
	var sumFrag, sumWaste float64
	for range steps {
		var acts []*Buffer
		layers := 40 + rng.IntN(40)
		for range layers {
			// Activation sizes vary with the batch and the layer: 4 KiB to 4 MiB.
			n := 4<<10 + int(float64(4<<20)*rng.Float64()*rng.Float64())
			acts = append(acts, must(p.Alloc(ctx, n)))
			r.allocs++
		}
		s := p.Stats()
		sumFrag += s.Fragmentation
		r.maxPeakFrag = max(r.maxPeakFrag, s.Fragmentation)
		sumWaste += float64(s.Reserved-s.InUse) / float64(s.Reserved)
		for i := len(acts) - 1; i >= 0; i-- {
			if acts[i] == nil {
				continue
			}
			grad := must(p.Alloc(ctx, acts[i].Len()/2+1))
			r.allocs++
			release(acts[i])
			acts[i] = nil
			if j := rng.IntN(i + 1); rng.IntN(4) == 0 && acts[j] != nil { // out of order
				release(acts[j])
				acts[j] = nil
			}
			release(grad)
		}
		if rng.IntN(3) == 0 {
			k := rng.IntN(len(params))
			release(params[k])
			params[k] = must(p.Alloc(ctx, 256<<10+rng.IntN(8<<20)))
			r.allocs++
		}
	}
	s := p.Stats()
	r.meanPeakFrag = sumFrag / float64(steps)
	r.wasteAtPeak = sumWaste / float64(steps)
	r.endFrag, r.reserved, r.peakInUse = s.Fragmentation, s.Reserved, s.Peak
	r.largestFreeAtEnd, r.inUse = s.LargestFree, s.InUse
	for _, b := range params {
		release(b)
	}
	return r
}
