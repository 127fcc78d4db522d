package rpc

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Compression modes (WithCompression, UseCompression).
const (
	// CompressionOff never compresses: the default on shm and ibv, where
	// the bytes move at memory speed.
	CompressionOff = "off"
	// CompressionAuto compresses a tensor only when it pays: the default
	// on tcp and the gRPC fallback. Per transfer of at least 1 MiB, the
	// side that holds the bytes compresses a few slices of them with s2,
	// zstd and huff0, times it, and compresses (with the codec predicted
	// fastest) only when compressing on one core per lane, pipelined with
	// the wire and with decompressing on the other side (as fast as the
	// sample decoded), is predicted to beat sending the bytes as they are
	// by a quarter, at the goodput the reading side measured on the plane
	// (from its own transfers, and a probe of the first MiB when it has
	// none; a probe can show a fast plane several times slower than it
	// is, so after a read that came compressed on a probe's word the next
	// one crosses whole as it is, once a session, to measure the plane).
	// Above the fastest a codec was seen to compress, it does not even
	// sample.
	CompressionAuto = "auto"
	// CompressionS2 and CompressionZstd compress every tensor of at least
	// 1 MiB with that codec (klauspost/compress s2; zstd at its fastest
	// level), chunk by chunk, storing chunks that do not shrink.
	CompressionS2   = "s2"
	CompressionZstd = "zstd"
	// CompressionHuff is huff0 entropy coding alone (klauspost/compress
	// huff0), which auto picks for low-entropy floats (2:1 on float16
	// with few distinct values, several times faster than zstd); it can
	// be asked for by name too.
	CompressionHuff = "huff0"
)

// EnvCompression sets the compression mode (WithCompression).
const EnvCompression = "TENSORRPC_COMPRESSION"

// codecsOffered are the codecs a side that compresses offers
// (HandshakeRequest.compression).
var codecsOffered = []string{CompressionS2, CompressionZstd, CompressionHuff}

// parseCompression reads a compression mode.
func parseCompression(mode string) (verbs.Codec, error) {
	switch strings.ToLower(strings.TrimSpace(mode)) {
	case CompressionOff:
		return verbs.CodecNone, nil
	case CompressionAuto:
		return verbs.CodecAuto, nil
	case CompressionS2:
		return verbs.CodecS2, nil
	case CompressionZstd:
		return verbs.CodecZstd, nil
	case CompressionHuff:
		return verbs.CodecHuff, nil
	}
	return 0, fmt.Errorf("tensorrpc: compression mode %q: want off, auto, s2, zstd or huff0", mode)
}

// WithCompression sets how this side compresses the tensors it reads over
// tcp and the gRPC fallback, and whether it compresses those its peer
// reads: CompressionOff, CompressionAuto (the default), CompressionS2,
// CompressionZstd or CompressionHuff. A session compresses only when both sides allow it
// (neither is off); each side then asks for the tensors it reads (a
// client's Fetches and Call replies, a server's Sends and Call requests)
// as its own mode says, and UseCompression overrides that per call. shm
// and ibv never compress. An unknown mode makes NewServer or Dial fail
// with InvalidArgument. Stats counts compressed transfers and the bytes
// they saved; CallInfo and the debug log (TENSORRPC_LOG=debug) say what
// each call did and from what.
func WithCompression(mode string) Option {
	return sharedOption(func(o *options) { o.compression = mode })
}

// compressionKey is the call metadata that carries UseCompression's mode
// to a server, for the tensors it reads of the call (a Send's, a Call's
// request).
const compressionKey = "tensorrpc-compression"

// UseCompression returns ctx with the compression mode of the calls made
// under it (CompressionOff, CompressionAuto, CompressionS2,
// CompressionZstd or CompressionHuff), replacing the side's WithCompression for them: for
// the tensors the client reads (a Fetch, a Call's reply) and, carried in
// the call's metadata, those the server reads (a Send, a Call's request
// tensors). It changes nothing on a session that does not compress (a
// side is off, or the plane is shm or ibv). A call with an unknown mode
// fails with InvalidArgument.
func UseCompression(ctx context.Context, mode string) context.Context {
	ctx = context.WithValue(ctx, useCompressionKey{}, mode)
	return metadata.AppendToOutgoingContext(ctx, compressionKey, mode)
}

type useCompressionKey struct{}

// clientCodec returns ctx for the reads of a call the client makes
// under it: with the call's own mode (UseCompression), or as it is.
func clientCodec(ctx context.Context) (context.Context, error) {
	mode, ok := ctx.Value(useCompressionKey{}).(string)
	if !ok {
		return ctx, nil
	}
	return withMode(ctx, mode)
}

// serverCodec returns ctx for the reads of a call the server serves under
// it: with the mode the client's call carried (UseCompression), or as it
// is.
func serverCodec(ctx context.Context) (context.Context, error) {
	v := metadata.ValueFromIncomingContext(ctx, compressionKey)
	if len(v) == 0 {
		return ctx, nil
	}
	return withMode(ctx, v[len(v)-1])
}

func withMode(ctx context.Context, mode string) (context.Context, error) {
	c, err := parseCompression(mode)
	if err != nil {
		return ctx, status.Error(codes.InvalidArgument, err.Error())
	}
	return engine.WithCodec(ctx, c), nil
}

// compressionMode is o's mode (WithCompression, else the environment, else
// auto). It is checked by NewServer and Dial.
func (o *options) compressionMode() (verbs.Codec, error) {
	if o.compression == "" {
		return verbs.CodecAuto, nil
	}
	return parseCompression(o.compression)
}

// compressionOffer is what a side offers in the handshake: the codecs,
// or none when its mode is off.
func (o *options) compressionOffer() []string {
	if m, err := o.compressionMode(); err != nil || m == verbs.CodecNone {
		return nil
	}
	return codecsOffered
}

// compressionAgreed is the server's answer to a client's offer: the codecs
// both take.
func (o *options) compressionAgreed(offer []string) []string {
	var both []string
	for _, c := range o.compressionOffer() {
		if slices.Contains(offer, c) {
			both = append(both, c)
		}
	}
	return both
}

// squeeze sets up compression on a session's lanes when the session
// compresses (agreed names codecs) and its plane is tcp: this side's
// queue pairs compress what the peer reads, and this side's reads ask as
// its mode says. Each read of a tensor is counted in stats, told to the
// call's CallInfo and logged at debug level.
func (o *options) squeeze(lanes []*engine.Link, transport string, agreed []string, stats *counters, log *slog.Logger, session string) {
	mode, err := o.compressionMode()
	if err != nil || mode == verbs.CodecNone || len(agreed) == 0 || transport != TransportTCP {
		return
	}
	z := &engine.Compression{Mode: mode, Report: func(ctx context.Context, r engine.ReadReport) {
		if r.Packed != verbs.CodecNone {
			stats.compressed.Add(1)
			stats.compressedSaved.Add(max(int64(r.Bytes)-r.Wire, 0))
		}
		explainCompression(ctx, r)
		if log.Enabled(ctx, slog.LevelDebug) {
			log.LogAttrs(ctx, slog.LevelDebug, "tensorrpc: read", slog.String("session", session),
				slog.Int("bytes", r.Bytes), slog.String("asked", r.Asked.String()), slog.String("compressed", r.Packed.String()),
				slog.Int64("wire_bytes", r.Wire), slog.Float64("goodput_mbps", r.Goodput*8/1e6), slog.Float64("sampled_ratio", r.Sampled), slog.Bool("probed", r.Probed),
				slog.Bool("checked", r.Checked), slog.Duration("took", r.Took))
		}
	}}
	for _, l := range lanes {
		if c, ok := l.QP.(verbs.Compressor); ok {
			c.AllowCompression(true)
		}
		l.Squeeze = z
	}
}

// explainMu orders explainCompression's writes: a call's tensors may be
// read at once (a Call's request tensors, on the server).
var explainMu sync.Mutex

// explainCompression adds to ctx's CallInfo, if any, how a read of one of
// the call's tensors was compressed: the codec of any that was (else off),
// the bytes that crossed for all of them, the goodput of the last.
func explainCompression(ctx context.Context, r engine.ReadReport) {
	info, _ := ctx.Value(callInfoKey{}).(*CallInfo)
	if info == nil {
		return
	}
	explainMu.Lock()
	defer explainMu.Unlock()
	if r.Packed != verbs.CodecNone {
		info.Compression = r.Packed.String() // CompressionS2, CompressionZstd, CompressionHuff
	} else if info.Compression == "" {
		info.Compression = CompressionOff
	}
	info.WireBytes += r.Wire
	if r.Goodput > 0 {
		info.Goodput = r.Goodput
	}
	info.SampleRatio = max(info.SampleRatio, r.Sampled)
}

// newStreamSqueeze is the compression of a session's fallback streams, as
// this side sends them: nil when the session does not compress (agreed is
// empty, or this side's mode is off).
func (o *options) newStreamSqueeze(agreed []string) *engine.Compression {
	mode, err := o.compressionMode()
	if err != nil || mode == verbs.CodecNone || len(agreed) == 0 {
		return nil
	}
	return &engine.Compression{Mode: mode}
}

// streamCodec is how this side sends bufs down a fallback stream of a
// session that compresses with z (nil: it does not), under ctx (whose
// call may carry its own mode, engine.WithCodec): tensors of at least 1
// MiB in all are compressed with the mode's codec or, in auto, with the
// one zchunk.Choose picks from a sample at the stream's measured goodput
// (none yet: not compressed, and the stream measures it).
func streamCodec(ctx context.Context, z *engine.Compression, bufs []*mempool.Buffer) zchunk.Codec {
	if z == nil {
		return zchunk.Stored
	}
	var segs zchunk.Segments
	n := 0
	for _, b := range bufs {
		segs = append(segs, b.Bytes())
		n += len(b.Bytes())
	}
	if n < engine.MinCompressed {
		return zchunk.Stored
	}
	mode := engine.CodecOf(ctx, z.Mode)
	if c, ok := zchunk.Named(mode.String()); ok {
		return c
	}
	if mode != verbs.CodecAuto {
		return zchunk.Stored
	}
	return zchunk.Choose(segs, n, z.Goodput()).Codec
}

// sendMeasured runs send (a stream's chunks of bufs, compressed with
// codec) and tells z, when not nil, how long the bytes took.
func sendMeasured(z *engine.Compression, bufs []*mempool.Buffer, codec zchunk.Codec, c *counters, send func() error) error {
	before := c.streamBytes.Load()
	t0 := time.Now()
	err := send()
	if err == nil && z != nil {
		n := 0
		for _, b := range bufs {
			n += len(b.Bytes())
		}
		var wire int64
		if codec != zchunk.Stored {
			wire = c.streamBytes.Load() - before
		}
		z.Observe(n, wire, time.Since(t0))
	}
	return err
}
