package main

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
)

// Every block carries a pattern that names it: 8-byte words, word k of
// block id at version v being base(id, v) + k·stride. A block fetched
// from the wrong row has the wrong base, a block the decode wrote back
// and that did not land (or landed elsewhere) has the wrong version, and
// bytes shifted within a block break the progression, so checkBlock
// catches each of them. Generating and checking cost one multiply-add per
// word, far less than moving the bytes.

// stride is odd, so that the words of a block are distinct.
const stride = 0x9e3779b97f4a7c15

// base is the first word of block id at version v (splitmix64's finalizer
// of the pair).
func base(id int64, v uint32) uint64 {
	x := uint64(id)<<32 ^ uint64(v) ^ 0x6b76636163686531 // "kvcache1"
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// fillBlock writes the pattern of block id at version v into b.
func fillBlock(b []byte, id int64, v uint32) {
	w := base(id, v)
	for k := 0; k+8 <= len(b); k += 8 {
		binary.LittleEndian.PutUint64(b[k:], w)
		w += stride
	}
}

// checkBlock checks that b holds the pattern of block id at version v.
func checkBlock(b []byte, id int64, v uint32) error {
	w := base(id, v)
	for k := 0; k+8 <= len(b); k += 8 {
		if got := binary.LittleEndian.Uint64(b[k:]); got != w {
			return fmt.Errorf("block %d (version %d): word at byte %d is %#x, want %#x", id, v, k, got, w)
		}
		w += stride
	}
	return nil
}

// requests draws the block ids of each request: n distinct blocks of the
// cache, uniformly at random and in random order, from a fixed seed, so
// two runs with the same flags ask for the same blocks. It keeps a
// permutation of the block ids and runs n steps of a Fisher–Yates shuffle
// over it per request, which draws a uniform n-subset in random order from
// any starting permutation.
type requests struct {
	rng  *rand.Rand
	perm []int64
	n    int
}

func newRequests(seed uint64, blocks, n int) *requests {
	r := &requests{rng: rand.New(rand.NewPCG(seed, 0x6b76)), perm: make([]int64, blocks), n: n}
	for i := range r.perm {
		r.perm[i] = int64(i)
	}
	return r
}

// next returns the next request's block ids, a slice of its own.
func (r *requests) next() []int64 {
	for i := range r.n {
		j := i + r.rng.IntN(len(r.perm)-i)
		r.perm[i], r.perm[j] = r.perm[j], r.perm[i]
	}
	return append([]int64(nil), r.perm[:r.n]...)
}
