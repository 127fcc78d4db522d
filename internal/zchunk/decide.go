package zchunk

import (
	"fmt"
	"math"
	"sync/atomic"
	"time"
)

// Estimate is what a sample says of one codec on some bytes: how many
// times smaller it made them, how fast it compressed them on one core
// (raw bytes a second), and how fast one core decoded them again (raw
// bytes a second; 0: not measured, the sample did not shrink).
type Estimate struct {
	Codec       Codec
	Ratio       float64
	Speed       float64
	DecodeSpeed float64
}

// Sampling: s2 compresses SampleSlices slices of SampleSlice bytes spread
// evenly over the bytes; zstd one slice of ZstdSampleSlice from their
// middle (its fastest level leaves slices of a few KiB of low-entropy
// data uncompressed that it compresses 2:1 in a chunk: it needs the
// larger slice to show what it does to a chunk). Fewer bytes are sampled
// when there are fewer.
const (
	SampleSlice     = 32 << 10
	SampleSlices    = 4
	ZstdSampleSlice = 256 << 10
)

// Sample compresses a few slices spread over the first n bytes of src
// with each of codecs, timing each, and returns an estimate per codec.
// When a codec shrank them, it also times decoding its last slice:
// decoding is usually several times faster than compressing, but not
// always (s2 decodes bytes that repeat with a short period, a pattern or
// a tiled tensor, at a tenth of the speed it compresses them: 1.1 against
// 9 GB/s on the 2-core VM), and a transfer goes only as fast as its
// slowest stage.
func Sample(src Segments, n int, codecs ...Codec) []Estimate {
	buf, dec := getBuf(), getBuf()
	defer func() { putBuf(buf); putBuf(dec) }()
	out := make([]Estimate, 0, len(codecs))
	for _, c := range codecs {
		var slices [][]byte
		if c == Zstd {
			m := min(ZstdSampleSlice, n)
			slices = append(slices, at(src, (n-m)/2, m))
		} else {
			k := min(SampleSlices, max(1, n/SampleSlice))
			for i := range k {
				off := 0
				if k > 1 {
					off = (n - SampleSlice) * i / (k - 1)
				}
				slices = append(slices, at(src, max(0, off), min(SampleSlice, n)))
			}
		}
		var raw, comp int
		t0 := time.Now()
		for _, s := range slices {
			buf = compress(c, buf[:0], s)
			raw += len(s)
			comp += min(len(buf), len(s)) // stored when it does not shrink
		}
		el := max(time.Since(t0), time.Microsecond)
		e := Estimate{Codec: c, Ratio: float64(raw) / float64(max(comp, 1)), Speed: float64(raw) / el.Seconds()}
		if last := slices[len(slices)-1]; e.Ratio >= MinRatio && len(buf) < len(last) {
			dec = slicesGrow(dec[:0], len(last))
			t0 = time.Now()
			if decode(c, dec, buf) == nil {
				e.DecodeSpeed = float64(len(last)) / max(time.Since(t0), time.Microsecond).Seconds()
			}
		}
		out = append(out, e)
	}
	return out
}

// slicesGrow is b with length n, reallocated only when its capacity is
// short.
func slicesGrow(b []byte, n int) []byte {
	if cap(b) < n {
		return make([]byte, n)
	}
	return b[:n]
}

// at returns the n bytes of src at off: a view when one segment holds
// them, else a copy.
func at(src Segments, off, n int) []byte {
	for _, s := range src {
		if off < len(s) {
			if off+n <= len(s) {
				return s[off : off+n]
			}
			out := make([]byte, 0, n)
			for _, t := range src {
				if off >= len(t) {
					off -= len(t)
					continue
				}
				m := min(len(t)-off, n-len(out))
				out = append(out, t[off:off+m]...)
				off = 0
				if len(out) == n {
					break
				}
			}
			return out
		}
		off -= len(s)
	}
	return nil
}

// Prediction rules (Decide).
const (
	// Margin: a codec is chosen only when its predicted time, made this
	// much longer, still beats sending the bytes as they are.
	Margin = 0.15
	// MinRatio: a sample compressed less than this is not compressible.
	MinRatio = 1.15
	// DecodeFactor: where a sample did not time decoding, decompressing
	// is taken to run this many times as fast as compressing (s2 and
	// zstd-fastest usually do, at 2-5×).
	DecodeFactor = 2
)

// Plan is Decide's choice and what it was made from.
type Plan struct {
	Codec Codec // Stored: send the bytes as they are
	// Raw and Packed are the predicted times as they are and with the
	// chosen codec (or the best one, when none won).
	Raw, Packed time.Duration
	Est         Estimate // the estimate of Codec, or of the best codec
	// Sampled is the best ratio of the estimates (0: none).
	Sampled float64
}

func (p Plan) String() string {
	return fmt.Sprintf("%v (predicted %v raw, %v with %v at ratio %.2f, %.0f MB/s a core, decoding %.0f MB/s)",
		p.Codec, p.Raw.Round(time.Microsecond), p.Packed.Round(time.Microsecond), p.Est.Codec, p.Est.Ratio, p.Est.Speed/1e6, p.Est.DecodeSpeed/1e6)
}

// Decide predicts the time of moving n bytes over a link that moves
// goodput bytes a second, as they are and with each estimated codec,
// compressing on cores cores and decompressing as many on the other side,
// pipelined in chunks (the slowest of compressing, the wire and
// decompressing, plus one chunk's compression to fill the pipeline), and
// picks the fastest codec when it wins by Margin; else Stored.
func Decide(n int, goodput float64, cores int, ests []Estimate) Plan {
	cores = max(cores, 1)
	raw := time.Duration(float64(n) / goodput * 1e9)
	best := Plan{Codec: Stored, Raw: raw, Packed: -1}
	for _, e := range ests {
		best.Sampled = max(best.Sampled, e.Ratio)
	}
	for _, e := range ests {
		if e.Ratio < MinRatio || e.Speed <= 0 {
			continue
		}
		comp := float64(n) / (e.Speed * float64(cores))
		wire := float64(n) / e.Ratio / goodput
		decSpeed := e.DecodeSpeed
		if decSpeed <= 0 {
			decSpeed = e.Speed * DecodeFactor
		}
		dec := float64(n) / (decSpeed * float64(cores))
		fill := float64(min(n, MaxChunk)) / e.Speed
		t := time.Duration((max(comp, wire, dec) + fill) * 1e9)
		if best.Packed < 0 || t < best.Packed {
			best.Packed, best.Est = t, e
		}
	}
	if best.Packed >= 0 && float64(best.Packed)*(1+Margin) < float64(raw) {
		best.Codec = best.Est.Codec
	}
	return best
}

// MinAuto is the fewest bytes Choose compresses: below it a sample costs
// more than compressing could save.
const MinAuto = 256 << 10

// ceilings are, per codec, the fastest it has compressed a compressible
// sample here (bytes a second, float64 bits): a link faster than that,
// with Margin, cannot gain from it, and Choose does not even sample it.
// They start at 1.5 GB/s for s2, 0.4 GB/s for zstd and 1 GB/s for huff0
// (on sparse and low-entropy data s2 runs at 0.4-0.9 GB/s a core, zstd at
// 0.1-0.2 and huff0 at 0.2-0.4 on the machines we measured).
var ceilings [Huff + 1]atomic.Uint64

func init() {
	ceilings[S2].Store(math.Float64bits(1.5e9))
	ceilings[Zstd].Store(math.Float64bits(0.4e9))
	ceilings[Huff].Store(math.Float64bits(1e9))
}

// mayBeat reports whether codec c compresses fast enough here to gain
// on a link of goodput bytes a second (its ceiling, with Margin).
func mayBeat(c Codec, goodput float64) bool {
	return goodput*(1+Margin) < math.Float64frombits(ceilings[c].Load())
}

// Pays reports whether any codec compresses fast enough here to gain on
// a link of goodput bytes a second: where none does, Choose stores
// whatever it is given.
func Pays(goodput float64) bool {
	return mayBeat(S2, goodput) || mayBeat(Zstd, goodput) || mayBeat(Huff, goodput)
}

// Choose is auto's decision for n bytes of src about to cross a link that
// moves goodput bytes a second, compressed on one core and decompressed
// on one: Decide over a Sample of the codecs that could beat the link.
// Under MinAuto bytes, or with no goodput known, it is Stored.
func Choose(src Segments, n int, goodput float64) Plan {
	if n < MinAuto || goodput <= 0 {
		return Plan{Codec: Stored}
	}
	var codecs []Codec
	for _, c := range []Codec{S2, Zstd, Huff} {
		if mayBeat(c, goodput) {
			codecs = append(codecs, c)
		}
	}
	if len(codecs) == 0 {
		return Plan{Codec: Stored}
	}
	ests := Sample(src, n, codecs...)
	for _, e := range ests {
		if e.Ratio >= MinRatio {
			// Halfway to the newest measure: a slow sample (a busy core)
			// lowers a ceiling only so far.
			old := math.Float64frombits(ceilings[e.Codec].Load())
			ceilings[e.Codec].Store(math.Float64bits((old + max(e.Speed, 0.05e9)) / 2))
		}
	}
	return Decide(n, goodput, 1, ests)
}
