package suite

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// A Payload is a kind of tensor content. Content matters only to the cases
// that compress; every other case moves the bytes without reading them.
type Payload struct {
	Name  string
	DType zerocopy.DType
	// About says what the bytes are, for the report.
	About string
	fill  func(r *rand.Rand, b []byte)
}

// Payloads are the kinds of content every run measures, in report order.
// The first is the one content-blind cases use.
var Payloads = []Payload{
	{Name: "gauss-f32", DType: zerocopy.Float32, About: "float32 ~ N(0, 0.02²), like gradients", fill: fillGaussian},
	{Name: "lowent-f16", DType: zerocopy.Float16, About: "float16 bit patterns, |x| in [0.25, 2), 3 mantissa bits: few distinct values", fill: fillLowEntropyF16},
	{Name: "sparse-f32", DType: zerocopy.Float32, About: "float32, 90% zeros and 10% N(0, 0.02²) at random positions, like top-k", fill: fillSparse},
	{Name: "random", DType: zerocopy.Uint8, About: "uniformly random bytes (incompressible)", fill: fillRandom},
}

// PayloadByName returns the payload named name.
func PayloadByName(name string) (Payload, error) {
	for _, p := range Payloads {
		if p.Name == name {
			return p, nil
		}
	}
	return Payload{}, fmt.Errorf("unknown payload %q", name)
}

// baseBlock is the largest block generated from the random source; larger
// payloads repeat it. Every codec measured here looks back at most a few
// MiB (zstd's window at these levels is ≤ 8 MiB, s2's blocks 4 MiB,
// snappy's 64 KiB, gzip's window 32 KiB), so a repetition 64 MiB away is
// invisible to them and a tiled payload compresses like a random one.
const baseBlock = 64 << 20

// payloadSource holds one generated block per payload kind.
type payloadSource struct {
	blocks map[string][]byte
}

func newPayloadSource(kinds []Payload, maxSize int) *payloadSource {
	n := min(maxSize, baseBlock)
	s := &payloadSource{blocks: map[string][]byte{}}
	for i, p := range kinds {
		b := make([]byte, n)
		p.fill(rand.New(rand.NewPCG(uint64(i)+1, 0x7e5a)), b)
		s.blocks[p.Name] = b
	}
	return s
}

// fill writes the first len(dst) bytes of payload p into dst.
func (s *payloadSource) fill(p Payload, dst []byte) {
	block := s.blocks[p.Name]
	for off := 0; off < len(dst); off += len(block) {
		copy(dst[off:], block)
	}
}

const gradientStdDev = 0.02

func fillGaussian(r *rand.Rand, b []byte) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*gradientStdDev)))
	}
}

func fillSparse(r *rand.Rand, b []byte) {
	clear(b)
	for i := 0; i+4 <= len(b); i += 4 {
		if r.IntN(10) == 0 {
			binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*gradientStdDev)))
		}
	}
}

// fillLowEntropyF16 writes IEEE half-precision bit patterns with a random
// sign, an exponent of 13, 14 or 15 (|x| in [0.25, 2)) and only the top 3
// of 10 mantissa bits set at random: 2·3·8 = 48 distinct values, about
// 5.6 bits of entropy per 16.
func fillLowEntropyF16(r *rand.Rand, b []byte) {
	for i := 0; i+2 <= len(b); i += 2 {
		sign := uint16(r.IntN(2)) << 15
		exp := uint16(13+r.IntN(3)) << 10
		mant := uint16(r.IntN(8)) << 7
		binary.LittleEndian.PutUint16(b[i:], sign|exp|mant)
	}
}

func fillRandom(r *rand.Rand, b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
}

// Fill writes n fresh bytes of the payload into b (no repeated block:
// every byte comes from the random source seeded with seed).
func (p Payload) Fill(b []byte, seed uint64) {
	p.fill(rand.New(rand.NewPCG(seed, 0x51c0)), b)
}
