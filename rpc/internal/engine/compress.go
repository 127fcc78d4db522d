package engine

import (
	"context"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Compression is what one side of a session does about compressing the
// tensors it reads over a slow data plane (tcp): its mode, and the
// plane's goodput measured from its own reads. The session's lanes share
// it (Link.Squeeze); nil on a session that does not compress.
type Compression struct {
	// Mode is the side's default for its reads: verbs.CodecAuto, CodecS2
	// or CodecZstd (a side whose mode is off has no Compression).
	Mode verbs.Codec
	// Report, when not nil, is told of every read of at least
	// MinCompressed bytes: how it went and what was decided from.
	Report func(ctx context.Context, r ReadReport)

	mu      sync.Mutex
	goodput float64 // bytes a second, all lanes together; 0: not measured
	since   int     // reads planned since the last probe
	// whole: a read of a whole tensor as it is measured the goodput (not
	// only a probe); packed: a read came compressed. A probe's MiB, on
	// one lane and often into memory not touched yet, can show a fast
	// plane several times slower than it is (0.5 against 4-5 GB/s on
	// the 2-core VM's loopback), and auto then compresses what crosses
	// faster as it is: so the first read after one that came compressed
	// on a probe's word goes whole as it is (check), and the plane's
	// goodput is what it measured.
	whole, packed bool
	// recheck: a read came compressed slower than the goodput says the
	// plane moves it as it is (a slow moment took the estimate down, or
	// the codec is slower than its sample said): the next read goes as
	// it is and measures (check). On a slow plane, where compressing
	// pays, compressed reads beat the estimate and nothing is rechecked.
	recheck bool
	// skip and backoff: after a compressed read that lost to the plane as
	// it is (recheck), or a responder's sample that found the tensor
	// compressible at least declineRatio but sent it as it is (declined:
	// at that ratio only the codec's speed can lose to the plane), the
	// next skip reads ask for nothing, as it is, measured (check), and
	// transfers as they are that Observe measures (landings) count too;
	// each such loss doubles backoff, the next skip, up to maxBackoff, and
	// a compressed read at least as fast as the plane as it is resets it.
	// Without it auto tried again two reads after a loss: on the 2-core
	// VM's loopback, 12 of 65 sequential 16 MiB Fetches of a patterned
	// tensor came s2-compressed in 8.9 ms on average, against 5.2 as
	// they were (its 32 KiB sample decoded faster than 8 MiB do), and 6
	// more paid for a sample that declined.
	skip, backoff int
}

// ReadReport is how one read of a tensor went (Compression.Report).
type ReadReport struct {
	Bytes int // the tensor's
	// Asked is what the reader asked for, Packed what the responder did
	// on the lanes that compressed (CodecNone: none did), Wire the bytes
	// that crossed the wire for the tensor.
	Asked, Packed verbs.Codec
	Wire          int64
	// Goodput is the estimate the reader asked with (bytes a second, the
	// plane's: each lane was told its share), Sampled the best ratio the
	// responder's samples showed (0: none sampled), Probed whether the
	// read began with a probe that measured the goodput, Checked whether
	// it went as it is to check auto's choice (Compression.whole,
	// Compression.recheck).
	Goodput float64
	Sampled float64
	Probed  bool
	Checked bool
	Took    time.Duration
}

const (
	// MinCompressed is the smallest tensor whose read may ask for
	// compression: below it the bytes cost less than deciding.
	MinCompressed = 1 << 20
	// probeBytes is the part of a read that goes first, as it is, on one
	// lane, to measure the plane when nothing measured it yet, and every
	// reprobeEvery reads after that (so that an estimate made from
	// compressed reads, which only bound the wire from below, does not
	// keep a fast plane compressing).
	probeBytes   = 1 << 20
	reprobeEvery = 32
	// measureMin: reads shorter than this, as they are, do not update the
	// goodput (their time is mostly latency).
	measureMin = 256 << 10
	// trustMin: a read this long, as it is, slower than the goodput
	// lowers it by half the difference, a shorter one by a quarter (a
	// probe's MiB can ride a burst that a long read averages away).
	trustMin = 8 << 20
	// recheckBelow: a compressed read that moved its tensor at less than
	// this share of the goodput, as it is, makes the next read go as it
	// is (Compression.recheck); the margin keeps a codec about as fast as
	// the plane from taking turns with it.
	recheckBelow = 0.9
	// declineRatio: a responder's sample at least this compressible that
	// it sent as it is lost to the plane's speed, not to its ratio
	// (Compression.declined).
	declineRatio = 2
	// maxBackoff bounds Compression.backoff: after repeated losses auto
	// still tries compressing once every this many reads, should the
	// plane or the tensors have changed.
	maxBackoff = 64
)

// codecKey carries a call's own compression mode (WithCodec).
type codecKey struct{}

// WithCodec returns ctx with the compression mode of the reads made under
// it: verbs.CodecNone turns it off for them, CodecAuto, CodecS2 or
// CodecZstd replace the session's mode (where the session compresses at
// all).
func WithCodec(ctx context.Context, c verbs.Codec) context.Context {
	return context.WithValue(ctx, codecKey{}, c)
}

// CodecOf is ctx's mode (WithCodec), or mode.
func CodecOf(ctx context.Context, mode verbs.Codec) verbs.Codec {
	if c, ok := ctx.Value(codecKey{}).(verbs.Codec); ok {
		return c
	}
	return mode
}

// plan says what a read of n bytes under ctx asks for, whether it
// probes first, and whether it checks auto's choice: a read that auto
// would have made that goes as it is (CodecNone), to be measured.
func (c *Compression) plan(ctx context.Context, n int) (codec verbs.Codec, goodput float64, probe, check bool) {
	codec, goodput, probe, check, _ = c.planned(ctx, n, true)
	return codec, goodput, probe, check
}

// planNoProbe is plan for a read that cannot probe first (ReadPlanned):
// ok false, and nothing planned, where plan would have it probe.
func (c *Compression) planNoProbe(ctx context.Context, n int) (codec verbs.Codec, goodput float64, check, ok bool) {
	codec, goodput, _, check, ok = c.planned(ctx, n, false)
	return codec, goodput, check, ok
}

// planned is plan; without mayProbe, a read that would probe is not
// planned at all (ok false).
func (c *Compression) planned(ctx context.Context, n int, mayProbe bool) (codec verbs.Codec, goodput float64, probe, check, ok bool) {
	if c == nil || n < MinCompressed {
		return verbs.CodecNone, 0, false, false, true
	}
	codec = CodecOf(ctx, c.Mode)
	if codec != verbs.CodecAuto {
		return codec, 0, false, false, true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.packed && !c.whole || c.recheck {
		c.recheck = false
		return verbs.CodecNone, c.goodput, false, true, true
	}
	if c.skip > 0 {
		c.skip--
		return verbs.CodecNone, c.goodput, false, true, true
	}
	probe = n >= 2*probeBytes && (c.goodput == 0 || c.since+1 >= reprobeEvery)
	if probe && !mayProbe {
		return verbs.CodecNone, 0, false, false, false
	}
	c.since++
	if probe {
		c.since = 0
	}
	return codec, c.goodput, probe, false, true
}

// observe updates the goodput from a read of n bytes that took took: as
// it was (wire 0), or compressed into wire bytes, which bounds the wire's
// speed from below only. whole says that the read was a tensor's, or
// all of it but a probe, not a probe.
func (c *Compression) observe(n int, wire int64, took time.Duration, whole bool) {
	if c == nil || took <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if wire > 0 {
		c.packed = true
		switch rate := float64(n) / took.Seconds(); {
		case whole && rate < c.goodput*recheckBelow:
			c.recheck = true
			c.backOffLocked()
		case whole && rate >= c.goodput:
			c.backoff = 0 // it won; within recheckBelow of the plane it neither lost nor won
		}
		c.goodput = max(c.goodput, float64(wire)/took.Seconds())
		return
	}
	if n < measureMin {
		return
	}
	if whole {
		c.whole = true
	}
	// A read faster than the estimate shows what the plane can do, and
	// replaces it; a slower one lowers it by a quarter of the difference
	// (half, from a read of trustMin or more): a busy moment (a noisy
	// host, a read that met the page faults of fresh memory) must not
	// leave auto compressing what crosses faster as it is. Compressing
	// when it does not pay costs more than not compressing when it would:
	// a codec bound by the CPU is slower than a fast wire several times
	// over, and compressed reads do not measure the wire again.
	g := float64(n) / took.Seconds()
	switch {
	case c.goodput == 0 || g > c.goodput:
		c.goodput = g
	case n >= trustMin:
		c.goodput = (c.goodput + g) / 2
	default:
		c.goodput -= (c.goodput - g) / 4
	}
}

// backOffLocked doubles backoff (up to maxBackoff) and skips that many
// reads' asking (Compression.skip).
func (c *Compression) backOffLocked() {
	c.backoff = min(max(1, 2*c.backoff), maxBackoff)
	c.skip = c.backoff
}

// declined notes a read that asked auto to compress and whose responder
// found the tensor compressible at least declineRatio but sent it as it
// is: at that ratio the wire takes at most half the time as it is, so
// the codec's speed lost to the plane, and asking again would cost the
// next reads a sample each for the same answer; auto backs off
// (Compression.skip). A tensor that compresses less says nothing of the
// plane (zchunk.Decide also declines a ratio just above MinRatio on a slow
// link, for its margin), and the next may compress well: no backoff.
func (c *Compression) declined() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.backOffLocked()
}

// noteSampled calls declined for a read report that says so.
func (c *Compression) noteSampled(rep *ReadReport) {
	if rep.Asked == verbs.CodecAuto && rep.Sampled >= declineRatio && rep.Packed == verbs.CodecNone {
		c.declined()
	}
}

// Observe updates the goodput from a transfer of n bytes this side sent
// or read that took took, wire bytes of it compressed (0: none); for
// planes whose reads ReadLanes does not make (the gRPC fallback's
// streams).
//
// Such a transfer of at least MinCompressed bytes as it is counts as one
// of the reads auto skips while it backs off (Compression.skip): a
// Fetch that lands while the plane counts as plain (Plain) is one, and
// without counting them a session whose Fetches all land would stay
// plain after one loss, whatever its goodput said later.
func (c *Compression) Observe(n int, wire int64, took time.Duration) {
	if c != nil && wire == 0 && n >= MinCompressed {
		c.mu.Lock()
		if c.skip > 0 {
			c.skip--
		}
		c.mu.Unlock()
	}
	c.observe(n, wire, took, true)
}

// Plain reports whether a transfer of n bytes under ctx goes as it is on
// a plane of this compression: c is nil (the session does not
// compress), n is below MinCompressed, ctx's mode is off, or in auto mode
// the plane was measured faster than any codec here compresses
// (zchunk.Pays) or is backing off after compressing lost (skip). A
// transfer that cannot be compressed (a Fetch's landing, Written by the
// server) is made only where Plain, so that a slow link's tensors still
// go compressed.
func (c *Compression) Plain(ctx context.Context, n int) bool {
	if c == nil || n < MinCompressed {
		return true
	}
	switch CodecOf(ctx, c.Mode) {
	case verbs.CodecNone:
		return true
	case verbs.CodecAuto:
		c.mu.Lock()
		g, skip := c.goodput, c.skip
		c.mu.Unlock()
		return g > 0 && (skip > 0 || !zchunk.Pays(g))
	}
	return false
}

// Goodput is the plane's measured goodput, bytes a second (0: none yet).
func (c *Compression) Goodput() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.goodput
}
