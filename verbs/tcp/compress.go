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

// ceilings are, per codec (s2, zstd), the fastest it has compressed a
// compressible sample here (bytes a second, float64 bits): a link faster
// than that, with zchunk.Margin, cannot gain from it, and CodecAuto does
// not even sample it. They start at 1.5 GB/s for s2, 0.4 GB/s for zstd and
// 1 GB/s for huff0 (on sparse and low-entropy data s2 runs at 0.4-0.9 GB/s
// a core, zstd at 0.1-0.2 and huff0 at 0.2-0.4 on the machines we
// measured).
var ceilings = [4]atomic.Uint64{}

func init() {
	ceilings[zchunk.S2].Store(math.Float64bits(1.5e9))
	ceilings[zchunk.Zstd].Store(math.Float64bits(0.4e9))
	ceilings[zchunk.Huff].Store(math.Float64bits(1e9))
}

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
	case verbs.CodecHuff:
		return zchunk.Huff
	case verbs.CodecAuto:
	default:
		return zchunk.Stored
	}
	if len(payload) < minPacked || c.Goodput <= 0 {
		return zchunk.Stored
	}
	var codecs []zchunk.Codec
	for _, z := range []zchunk.Codec{zchunk.S2, zchunk.Zstd, zchunk.Huff} {
		if c.Goodput*(1+zchunk.Margin) < math.Float64frombits(ceilings[z].Load()) {
			codecs = append(codecs, z)
		}
	}
	if len(codecs) == 0 {
		return zchunk.Stored
	}
	ests := zchunk.Sample(zchunk.Segments{payload}, len(payload), codecs...)
	for _, e := range ests {
		if e.Ratio >= zchunk.MinRatio {
			// Halfway to the newest measure: a slow sample (a busy core)
			// lowers a ceiling only so far.
			old := math.Float64frombits(ceilings[e.Codec].Load())
			ceilings[e.Codec].Store(math.Float64bits((old + max(e.Speed, 0.05e9)) / 2))
		}
	}
	return zchunk.Decide(len(payload), c.Goodput, 1, ests).Codec
}
