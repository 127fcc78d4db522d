// Package compressors implements grpc encoding.Compressor for the codecs
// of github.com/klauspost/compress that the benchmark suite measures: zstd
// at its fastest and default levels, s2, snappy and gzip.
//
// Every compressor is single-threaded (one core per gRPC message; the suite
// gets parallelism from concurrent streams) and pools its encoders and
// decoders, as a production compressor would.
//
// # Caveats
//
// The names are this suite's own ("tb-zstd-fastest", ...), so they never
// collide with a compressor another package registers; a peer must register
// the same names to talk to a process that uses them.
package compressors

import (
	"io"
	"sync"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/snappy"
	"github.com/klauspost/compress/zstd"
	"google.golang.org/grpc/encoding"
)

// Codec names, as gRPC sees them in the grpc-encoding header.
const (
	ZstdFastest = "tb-zstd-fastest"
	ZstdDefault = "tb-zstd-default"
	S2          = "tb-s2"
	Snappy      = "tb-snappy"
	Gzip        = "tb-gzip"
)

// All lists every compressor of this package, fastest family first.
func All() []encoding.Compressor {
	once.Do(func() {
		all = []encoding.Compressor{
			newZstd(ZstdFastest, zstd.SpeedFastest),
			newZstd(ZstdDefault, zstd.SpeedDefault),
			newS2(S2, false),
			newS2(Snappy, true),
			newGzip(Gzip, gzip.DefaultCompression),
		}
	})
	return all
}

var (
	once     sync.Once
	all      []encoding.Compressor
	register sync.Once
)

// Register registers every compressor of this package with gRPC. It is
// safe to call more than once. gRPC requires registration before a server
// or connection that uses them is created.
func Register() {
	register.Do(func() {
		for _, c := range All() {
			encoding.RegisterCompressor(c)
		}
	})
}

// Get returns the compressor of this package named name, or nil.
func Get(name string) encoding.Compressor {
	for _, c := range All() {
		if c.Name() == name {
			return c
		}
	}
	return nil
}

// pooledWriter returns its encoder to a pool on Close.
type pooledWriter struct {
	io.WriteCloser
	put func()
}

func (w *pooledWriter) Close() error {
	err := w.WriteCloser.Close()
	w.put()
	return err
}

// pooledReader returns its decoder to a pool at EOF or on Close, whichever
// comes first (gRPC calls Close when the Reader implements it).
type pooledReader struct {
	r    io.Reader
	put  func()
	done bool
}

func (r *pooledReader) Read(p []byte) (int, error) {
	if r.done {
		return 0, io.EOF
	}
	n, err := r.r.Read(p)
	if err == io.EOF {
		r.Close()
	}
	return n, err
}

func (r *pooledReader) Close() error {
	if !r.done {
		r.done = true
		r.put()
	}
	return nil
}

type zstdCompressor struct {
	name     string
	encoders sync.Pool
	decoders sync.Pool
	level    zstd.EncoderLevel
}

func newZstd(name string, level zstd.EncoderLevel) *zstdCompressor {
	return &zstdCompressor{name: name, level: level}
}

func (c *zstdCompressor) Name() string { return c.name }

func (c *zstdCompressor) Compress(w io.Writer) (io.WriteCloser, error) {
	enc, _ := c.encoders.Get().(*zstd.Encoder)
	if enc == nil {
		var err error
		enc, err = zstd.NewWriter(w, zstd.WithEncoderLevel(c.level), zstd.WithEncoderConcurrency(1))
		if err != nil {
			return nil, err
		}
	} else {
		enc.Reset(w)
	}
	return &pooledWriter{WriteCloser: enc, put: func() { c.encoders.Put(enc) }}, nil
}

func (c *zstdCompressor) Decompress(r io.Reader) (io.Reader, error) {
	dec, _ := c.decoders.Get().(*zstd.Decoder)
	if dec == nil {
		var err error
		// Concurrency 1 decodes synchronously, without goroutines that
		// would outlive the message; the window limit bounds memory
		// against a hostile peer.
		dec, err = zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(64<<20))
		if err != nil {
			return nil, err
		}
	} else if err := dec.Reset(r); err != nil {
		return nil, err
	}
	return &pooledReader{r: dec, put: func() {
		dec.Reset(nil)
		c.decoders.Put(dec)
	}}, nil
}

// s2Compressor is s2, or snappy's framing format when snappy is set: the
// s2 encoder in snappy-compatible mode with better compression, which is
// what klauspost/compress/snappy.NewBufferedWriter makes (here with one
// goroutine).
type s2Compressor struct {
	name     string
	snappy   bool
	encoders sync.Pool
	decoders sync.Pool
}

func newS2(name string, snappyCompat bool) *s2Compressor {
	return &s2Compressor{name: name, snappy: snappyCompat}
}

func (c *s2Compressor) Name() string { return c.name }

func (c *s2Compressor) Compress(w io.Writer) (io.WriteCloser, error) {
	enc, _ := c.encoders.Get().(*s2.Writer)
	if enc == nil {
		opts := []s2.WriterOption{s2.WriterConcurrency(1)}
		if c.snappy {
			opts = append(opts, s2.WriterSnappyCompat(), s2.WriterBetterCompression())
		}
		enc = s2.NewWriter(w, opts...)
	} else {
		enc.Reset(w)
	}
	return &pooledWriter{WriteCloser: enc, put: func() { c.encoders.Put(enc) }}, nil
}

func (c *s2Compressor) Decompress(r io.Reader) (io.Reader, error) {
	if c.snappy {
		dec, _ := c.decoders.Get().(*snappy.Reader)
		if dec == nil {
			dec = snappy.NewReader(r)
		} else {
			dec.Reset(r)
		}
		return &pooledReader{r: dec, put: func() { dec.Reset(nil); c.decoders.Put(dec) }}, nil
	}
	dec, _ := c.decoders.Get().(*s2.Reader)
	if dec == nil {
		dec = s2.NewReader(r)
	} else {
		dec.Reset(r)
	}
	return &pooledReader{r: dec, put: func() { dec.Reset(nil); c.decoders.Put(dec) }}, nil
}

type gzipCompressor struct {
	name     string
	level    int
	encoders sync.Pool
	decoders sync.Pool
}

func newGzip(name string, level int) *gzipCompressor {
	return &gzipCompressor{name: name, level: level}
}

func (c *gzipCompressor) Name() string { return c.name }

func (c *gzipCompressor) Compress(w io.Writer) (io.WriteCloser, error) {
	enc, _ := c.encoders.Get().(*gzip.Writer)
	if enc == nil {
		var err error
		if enc, err = gzip.NewWriterLevel(w, c.level); err != nil {
			return nil, err
		}
	} else {
		enc.Reset(w)
	}
	return &pooledWriter{WriteCloser: enc, put: func() { c.encoders.Put(enc) }}, nil
}

func (c *gzipCompressor) Decompress(r io.Reader) (io.Reader, error) {
	dec, _ := c.decoders.Get().(*gzip.Reader)
	if dec == nil {
		var err error
		if dec, err = gzip.NewReader(r); err != nil {
			return nil, err
		}
	} else if err := dec.Reset(r); err != nil {
		return nil, err
	}
	return &pooledReader{r: dec, put: func() { c.decoders.Put(dec) }}, nil
}
