package tcp

import (
	"math"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// minPacked is the smallest Read response CodecAuto compresses: below it a
// sample costs more than compressing could save.
const minPacked = 256 << 10

// codecCeiling is the fastest a codec has compressed a compressible
// sample here (bytes a second, float64 bits): a link faster than it, with
// zchunk.Margin, cannot gain from compressing, and CodecAuto does not
// even sample. It starts at 1.5 GB/s (s2 on sparse data runs at 0.4-0.9
// GB/s a core on the machines we measured).
var codecCeiling atomic.Uint64

func init() { codecCeiling.Store(math.Float64bits(1.5e9)) }

// packFor decides how a Read response of payload goes: with the codec the
// request named, or for CodecAuto the one zchunk.Decide picks from a
// sample of payload and the requester's goodput (one core compressing on
// each side: each lane's response is compressed by its own writer);
// zchunk.Stored for as it is.
func packFor(c verbs.Compression, payload []byte) zchunk.Codec {
	switch c.Codec {
	case verbs.CodecS2:
		return zchunk.S2
	case verbs.CodecZstd:
		return zchunk.Zstd
	case verbs.CodecAuto:
	default:
		return zchunk.Stored
	}
	if len(payload) < minPacked || c.Goodput <= 0 || c.Goodput*(1+zchunk.Margin) > math.Float64frombits(codecCeiling.Load()) {
		return zchunk.Stored
	}
	ests := zchunk.Sample(zchunk.Segments{payload}, len(payload), zchunk.S2, zchunk.Zstd)
	fastest := 0.0
	for _, e := range ests {
		if e.Ratio >= zchunk.MinRatio {
			fastest = max(fastest, e.Speed)
		}
	}
	if fastest > 0 {
		// Halfway to the newest measure: a slow sample (a busy core)
		// lowers the ceiling only so far.
		old := math.Float64frombits(codecCeiling.Load())
		codecCeiling.Store(math.Float64bits((old + max(fastest, 0.2e9)) / 2))
	}
	return zchunk.Decide(len(payload), c.Goodput, 1, ests).Codec
}
