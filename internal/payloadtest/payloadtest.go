// Package payloadtest makes tensor bytes of the kinds the compression
// tests move: how compressible they are is what those tests are about.
package payloadtest

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
)

// Kinds are the payloads Fill makes, from most to least compressible.
var Kinds = []string{"zeros", "sparse-f32", "lowent-f16", "random"}

// Fill fills b with payload kind from a random source seeded with seed:
//
//   - zeros: all zero
//   - sparse-f32: float32, 90% zeros, 10% N(0, 0.02²), like top-k
//     gradients (about 4.8:1 with s2)
//   - lowent-f16: float16 bit patterns with |x| in [0.25, 2) and 3
//     mantissa bits, 48 distinct values (about 2:1 with huff0)
//   - random: uniformly random bytes (incompressible)
//
// It panics on an unknown kind.
func Fill(kind string, b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 0x9a7))
	switch kind {
	case "zeros":
		clear(b)
	case "sparse-f32":
		clear(b)
		for i := 0; i+4 <= len(b); i += 4 {
			if r.IntN(10) == 0 {
				binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
			}
		}
	case "lowent-f16":
		for i := 0; i+2 <= len(b); i += 2 {
			binary.LittleEndian.PutUint16(b[i:], uint16(r.IntN(2))<<15|uint16(13+r.IntN(3))<<10|uint16(r.IntN(8))<<7)
		}
	case "random":
		for i := range b {
			b[i] = byte(r.Uint32())
		}
	default:
		panic(fmt.Sprintf("payloadtest: unknown payload %q", kind))
	}
}
