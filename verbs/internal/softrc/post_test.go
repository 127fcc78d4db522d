package softrc

import (
	"bytes"
	"testing"
)

// TestParallelCopies: GatherParallel and ScatterParallel copy exactly what
// Gather and Scatter do, across segment boundaries, for sizes around the
// split points.
func TestParallelCopies(t *testing.T) {
	for _, n := range []int{0, 1, ParallelMinBytes - 1, 2 * ParallelMinBytes, 3*ParallelMinBytes + 12345} {
		// Three segments of uneven sizes that together hold n bytes.
		a, b := n/3+7, n/5+1
		a, b = min(a, n), min(b, n-min(a, n))
		segs := [][]byte{make([]byte, a), make([]byte, b), make([]byte, n-a-b)}
		var v Vec
		for i, s := range segs {
			for j := range s {
				s[j] = byte(j*7 + i)
			}
			v = append(v, Seg{B: s})
		}
		for _, workers := range []int{1, 2, 5} {
			want := make([]byte, n)
			v.Gather(want, 0)
			got := make([]byte, n)
			if k := v.GatherParallel(got, workers); k != n || !bytes.Equal(got, want) {
				t.Fatalf("n=%d workers=%d: GatherParallel copied %d bytes, equal=%v", n, workers, k, bytes.Equal(got, want))
			}
			src := make([]byte, n)
			for j := range src {
				src[j] = byte(j * 13)
			}
			if k := v.ScatterParallel(src, workers); k != n {
				t.Fatalf("n=%d workers=%d: ScatterParallel copied %d bytes", n, workers, k)
			}
			back := make([]byte, n)
			v.Gather(back, 0)
			if !bytes.Equal(back, src) {
				t.Fatalf("n=%d workers=%d: ScatterParallel wrote something else", n, workers)
			}
		}
	}
}
