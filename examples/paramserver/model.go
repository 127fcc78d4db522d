package main

import (
	"math"
	"math/rand/v2"
	"slices"
)

// The model is sparse linear regression: each sample x has NonZeros
// entries of ±1 at distinct random features, and y = x·w* + ε with w*
// drawn from N(0, 1) and ε from N(0, Noise²). The loss is the mean squared
// error over all samples, L(w) = (1/N) Σ (x·w − y)², whose value at w* is
// the mean of ε² (about Noise²). With N samples for n parameters the least-
// squares optimum lies a little below it, at about Noise²·(1 − n/N), so
// gradient descent that converges ends within a few percent of L(w*).
//
// Sparse samples keep the data small (a dense N×n design would not fit in
// memory for n = 10⁵) while still coupling every parameter to others.

// dataset is one worker's share of the samples: rows of NonZeros entries.
type dataset struct {
	nonZeros int
	index    []int32   // feature of each entry, row after row
	value    []float32 // its value, ±1
	y        []float32 // one per row
	noise    float64   // Σ ε² over the rows: this share of N·L(w*)
}

// trueWeights returns w*, the same in every process for a seed.
func trueWeights(cfg *config) []float32 {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0))
	w := make([]float32, cfg.Params)
	for i := range w {
		w[i] = float32(rng.NormFloat64())
	}
	return w
}

// rowsOf returns the rows worker i holds: the samples are split evenly.
func rowsOf(cfg *config, worker int) int {
	total := cfg.samples()
	return (worker+1)*total/cfg.Workers - worker*total/cfg.Workers
}

// newDataset generates worker i's samples. Each worker draws its own with
// its own random stream, so no sample data ever crosses the network.
func newDataset(cfg *config, worker int, wStar []float32) *dataset {
	rng := rand.New(rand.NewPCG(cfg.Seed, uint64(worker)+1))
	rows := rowsOf(cfg, worker)
	s := cfg.NonZeros
	d := &dataset{nonZeros: s, index: make([]int32, rows*s), value: make([]float32, rows*s), y: make([]float32, rows)}
	for r := range rows {
		idx := d.index[r*s : (r+1)*s]
		val := d.value[r*s : (r+1)*s]
		var dot float64
		for k := range s {
			j := int32(rng.IntN(cfg.Params))
			for slices.Contains(idx[:k], j) { // features of a sample are distinct
				j = int32(rng.IntN(cfg.Params))
			}
			idx[k] = j
			val[k] = float32(1 - 2*int(rng.Uint32()&1))
			dot += float64(val[k]) * float64(wStar[j])
		}
		eps := cfg.Noise * rng.NormFloat64()
		d.y[r] = float32(dot + eps)
		d.noise += eps * eps
	}
	return d
}

// gradient adds this worker's share of ∇L at w to grad, which must be
// zero on entry, and returns its share of L(w): Σ r² / total over its rows,
// where r = x·w − y and total is the number of samples of all workers.
// Summing the shares of all workers gives L(w) and ∇L(w).
func (d *dataset) gradient(w, grad []float32, total int) float64 {
	s := d.nonZeros
	scale := float32(2 / float64(total))
	var loss float64
	for r, y := range d.y {
		idx := d.index[r*s : (r+1)*s]
		val := d.value[r*s : (r+1)*s]
		res := -y
		for k, j := range idx {
			res += val[k] * w[j]
		}
		loss += float64(res) * float64(res)
		g := scale * res
		for k, j := range idx {
			grad[j] += g * val[k]
		}
	}
	return loss / float64(total)
}

// autoLearningRate is 1/λmax for the Hessian (2/N)·XᵀX, whose spectrum for
// these random sparse samples lies around (2s/n)·(1 ± √(n/N))²: fast,
// and safely below the 2/λmax where gradient descent diverges.
func autoLearningRate(cfg *config) float64 {
	n, N, s := float64(cfg.Params), float64(cfg.samples()), float64(cfg.NonZeros)
	edge := 1 + math.Sqrt(n/N)
	return n / (2 * s * edge * edge)
}
