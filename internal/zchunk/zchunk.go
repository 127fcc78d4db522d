// Package zchunk frames a tensor's bytes as a stream of compressed chunks,
// for the data planes that compress on slow links (tcp, the gRPC
// fallback), and decides from a sample of the bytes and the link's speed
// whether compressing pays.
//
// # Basics
//
// A stream carries n raw bytes as chunks of at most MaxChunk raw bytes,
// each a 12-byte header (the codec, three zero bytes, the chunk's raw
// length and its data's length, both little-endian uint32) and its data:
// the raw bytes compressed with the codec, or stored as they are (Stored)
// when compressing did not make them smaller. WriteStream writes one;
// ReadStream reads one into its destination, chunk by chunk, decompressing
// each straight into place.
//
// A reader bounds what a stream can make it do: a chunk declares at most
// MaxChunk raw bytes, no more than the stream has left, and at most
// MaxEncoded(raw) data bytes; its data must decode to exactly the raw
// length it declared, into the destination and nowhere else. A chunk that
// breaks one of these fails with ErrCorrupt, a header that breaks them
// with ErrBadHeader; either way the stream is lost (a sender that lied
// once cannot be trusted with the lengths that follow).
//
// Decide predicts, for a transfer of n bytes over a link of a given speed,
// whether a codec wins by a margin, from a Sample of the bytes (a few
// slices compressed with each codec, timed).
//
// # Caveats
//
// The codecs' speed is measured on the sample's core; a busy machine
// measures slow and compresses less.
package zchunk

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/huff0"
	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
)

// Codec names how a chunk's data is encoded.
type Codec uint8

// The codecs.
const (
	Stored Codec = 0 // the raw bytes as they are
	S2     Codec = 1 // klauspost/compress s2, default level
	Zstd   Codec = 2 // zstd, fastest level
	// Huff is order-0 entropy coding alone (klauspost/compress huff0, 4
	// streams) over blocks of HuffBlock bytes: no matches, but 2:1 on
	// low-entropy floats at several times zstd's speed.
	Huff Codec = 3
)

// Named returns the codec of a name String gives ("s2", "zstd",
// "huff0"), the names the handshake and package verbs use too, or false.
func Named(name string) (Codec, bool) {
	for _, c := range []Codec{S2, Zstd, Huff} {
		if c.String() == name {
			return c, true
		}
	}
	return Stored, false
}

// HuffBlock is the raw bytes of one huff0 block of a Huff chunk.
const HuffBlock = 64 << 10

func (c Codec) String() string {
	switch c {
	case Stored:
		return "stored"
	case S2:
		return "s2"
	case Zstd:
		return "zstd"
	case Huff:
		return "huff0"
	}
	return fmt.Sprintf("Codec(%d)", uint8(c))
}

const (
	// HeaderLen is the bytes of a chunk's header.
	HeaderLen = 12
	// MaxChunk is the most raw bytes one chunk carries.
	MaxChunk = 1 << 20
)

var (
	// ErrBadHeader: a chunk header that cannot be right (an unknown codec,
	// a raw length of zero, past MaxChunk or past what the stream has
	// left, data longer than its raw length could encode to). The stream
	// cannot be followed past it.
	ErrBadHeader = errors.New("zchunk: a bad chunk header")
	// ErrCorrupt: a chunk whose data does not decode to the raw length it
	// declared. Its data has been read: the stream is still in step.
	ErrCorrupt = errors.New("zchunk: a chunk's data does not decode to its raw length")
)

// MaxEncoded is the most data bytes a chunk of raw bytes may carry: the
// larger of what s2, zstd and huff0 may make of incompressible bytes.
func MaxEncoded(raw int) int {
	return max(s2.MaxEncodedLen(raw), raw+raw/128+1024)
}

var (
	zstdEnc = sync.OnceValue(func() *zstd.Encoder {
		e, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest),
			zstd.WithEncoderConcurrency(runtime.GOMAXPROCS(0)), zstd.WithZeroFrames(true),
			zstd.WithEncoderCRC(false), zstd.WithWindowSize(MaxChunk))
		if err != nil {
			panic(err)
		}
		return e
	})
	zstdDec = sync.OnceValue(func() *zstd.Decoder {
		d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(runtime.GOMAXPROCS(0)),
			zstd.WithDecoderMaxMemory(MaxChunk), zstd.WithDecoderMaxWindow(MaxChunk))
		if err != nil {
			panic(err)
		}
		return d
	})
)

// compress appends src compressed with codec to dst.
func compress(codec Codec, dst, src []byte) []byte {
	switch codec {
	case S2:
		n := len(dst)
		dst = append(dst, make([]byte, s2.MaxEncodedLen(len(src)))...)
		return dst[:n+len(s2.Encode(dst[n:], src))]
	case Zstd:
		return zstdEnc().EncodeAll(src, dst)
	case Huff:
		return huffEncode(dst, src)
	}
	return append(dst, src...)
}

// Blocks of a Huff chunk: a type byte, then for huffStored the block's
// raw bytes, for huffRLE the one byte it repeats, for huffCoded a
// little-endian uint32 length and that many bytes of huff0 (its table and
// four streams).
const (
	huffStored = 0
	huffCoded  = 1
	huffRLE    = 2
)

var huffScratch = sync.Pool{New: func() any { return new(huff0.Scratch) }}

// huffEncode appends src, block by block, as a Huff chunk's data.
func huffEncode(dst, src []byte) []byte {
	sc := huffScratch.Get().(*huff0.Scratch)
	defer huffScratch.Put(sc)
	for len(src) > 0 {
		b := src[:min(HuffBlock, len(src))]
		src = src[len(b):]
		sc.Reuse = huff0.ReusePolicyNone // each block carries its table
		out, _, err := huff0.Compress4X(b, sc)
		switch {
		case err == huff0.ErrUseRLE:
			dst = append(dst, huffRLE, b[0])
		case err != nil || len(out)+5 >= len(b):
			dst = append(append(dst, huffStored), b...)
		default:
			dst = binary.LittleEndian.AppendUint32(append(dst, huffCoded), uint32(len(out)))
			dst = append(dst, out...)
		}
	}
	return dst
}

// huffDecode decodes a Huff chunk's data into dst, whose length is the
// chunk's raw length.
func huffDecode(dst, data []byte) error {
	sc := huffScratch.Get().(*huff0.Scratch)
	defer huffScratch.Put(sc)
	for len(dst) > 0 {
		n := min(HuffBlock, len(dst))
		if len(data) == 0 {
			return fmt.Errorf("%w: huff0 data ends %d bytes short", ErrCorrupt, len(dst))
		}
		typ := data[0]
		data = data[1:]
		switch typ {
		case huffStored:
			if len(data) < n {
				return fmt.Errorf("%w: a stored huff0 block of %d bytes, %d there", ErrCorrupt, n, len(data))
			}
			copy(dst, data[:n])
			data = data[n:]
		case huffRLE:
			if len(data) < 1 {
				return fmt.Errorf("%w: an RLE huff0 block without its byte", ErrCorrupt)
			}
			v := data[0]
			for i := range dst[:n] {
				dst[i] = v
			}
			data = data[1:]
		case huffCoded:
			if len(data) < 4 {
				return fmt.Errorf("%w: a huff0 block without its length", ErrCorrupt)
			}
			k := int(binary.LittleEndian.Uint32(data))
			data = data[4:]
			if k > len(data) {
				return fmt.Errorf("%w: a huff0 block of %d bytes, %d there", ErrCorrupt, k, len(data))
			}
			tsc, rem, err := huff0.ReadTable(data[:k], sc)
			if err != nil {
				return fmt.Errorf("%w: huff0 table: %v", ErrCorrupt, err)
			}
			tsc.MaxDecodedSize = n
			out, err := tsc.Decompress4X(rem, n)
			if err != nil || len(out) != n {
				return fmt.Errorf("%w: huff0 block decodes to %d bytes, want %d (%v)", ErrCorrupt, len(out), n, err)
			}
			copy(dst, out)
			data = data[k:]
		default:
			return fmt.Errorf("%w: huff0 block type %d", ErrCorrupt, typ)
		}
		dst = dst[n:]
	}
	if len(data) != 0 {
		return fmt.Errorf("%w: %d bytes past a huff0 chunk's blocks", ErrCorrupt, len(data))
	}
	return nil
}

// AppendChunk appends one chunk of src (at most MaxChunk bytes) to dst:
// its header and src compressed with codec, or stored when that is not
// smaller.
func AppendChunk(dst []byte, codec Codec, src []byte) []byte {
	if len(src) == 0 || len(src) > MaxChunk {
		panic(fmt.Sprintf("zchunk: a chunk of %d bytes", len(src)))
	}
	h := len(dst)
	dst = append(dst, make([]byte, HeaderLen)...)
	if codec != Stored {
		dst = compress(codec, dst, src)
		if len(dst)-h-HeaderLen >= len(src) {
			dst, codec = dst[:h+HeaderLen], Stored
		}
	}
	if codec == Stored {
		dst = append(dst, src...)
	}
	putHeader(dst[h:], codec, len(src), len(dst)-h-HeaderLen)
	if f := tamper.Load(); f != nil {
		(*f)(dst[h:])
	}
	return dst
}

func putHeader(b []byte, codec Codec, raw, data int) {
	b[0], b[1], b[2], b[3] = byte(codec), 0, 0, 0
	binary.LittleEndian.PutUint32(b[4:], uint32(raw))
	binary.LittleEndian.PutUint32(b[8:], uint32(data))
}

// parseHeader checks a chunk header against the raw bytes the stream has
// left.
func parseHeader(b []byte, left int) (codec Codec, raw, data int, err error) {
	codec = Codec(b[0])
	raw = int(binary.LittleEndian.Uint32(b[4:]))
	data = int(binary.LittleEndian.Uint32(b[8:]))
	switch {
	case codec > Huff || b[1]|b[2]|b[3] != 0:
		return 0, 0, 0, fmt.Errorf("%w: codec %d", ErrBadHeader, b[0])
	case raw == 0 || raw > MaxChunk || raw > left:
		return 0, 0, 0, fmt.Errorf("%w: %d raw bytes with %d left (at most %d a chunk)", ErrBadHeader, raw, left, MaxChunk)
	case codec == Stored && data != raw, data > MaxEncoded(raw):
		return 0, 0, 0, fmt.Errorf("%w: %d data bytes for %d raw as %v", ErrBadHeader, data, raw, codec)
	}
	return codec, raw, data, nil
}

// decode decodes a chunk's data into dst, whose length is the chunk's raw
// length, and nowhere else.
func decode(codec Codec, dst, data []byte) error {
	switch codec {
	case Stored:
		memcopy.Copy(dst, data)
		return nil
	case S2:
		n, err := s2.DecodedLen(data)
		if err != nil || n != len(dst) {
			return fmt.Errorf("%w: s2 data of %d bytes (%v)", ErrCorrupt, n, err)
		}
		out, err := s2.Decode(dst, data)
		if err != nil || len(out) != len(dst) || &out[0] != &dst[0] {
			return fmt.Errorf("%w: s2: %v", ErrCorrupt, err)
		}
		return nil
	case Zstd:
		var h zstd.Header
		if err := h.Decode(data); err != nil || (h.HasFCS && h.FrameContentSize != uint64(len(dst))) {
			return fmt.Errorf("%w: a zstd frame declaring %d bytes (%v)", ErrCorrupt, h.FrameContentSize, err)
		}
		// Output past dst's capacity goes to a new array (at most
		// MaxChunk, the decoder's bound), never past dst.
		out, err := zstdDec().DecodeAll(data, dst[:0:len(dst)])
		if err != nil || len(out) != len(dst) || &out[0] != &dst[0] {
			return fmt.Errorf("%w: zstd: %d bytes (%v)", ErrCorrupt, len(out), err)
		}
		return nil
	case Huff:
		return huffDecode(dst, data)
	}
	return fmt.Errorf("%w: codec %d", ErrCorrupt, codec)
}

// Segments are where a stream's raw bytes go, or come from, in order.
type Segments [][]byte

// WriteStream writes src's first n bytes (its segments in order) to w as
// a stream of chunks compressed with codec, compressing each chunk while
// the one before it is written. It returns the bytes written.
func WriteStream(w io.Writer, codec Codec, src Segments, n int) (int64, error) {
	chunks := make(chan []byte, 1) // compressed ahead: one
	stop := make(chan struct{})
	var short error
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(chunks)
		var raw []byte // a chunk that straddles segments is gathered here
		var seg []byte
		si := 0
		for left := n; left > 0; {
			k := min(MaxChunk, left)
			for len(seg) == 0 && si < len(src) {
				seg, si = src[si], si+1
			}
			var piece []byte
			if len(seg) >= k {
				piece, seg = seg[:k], seg[k:]
			} else {
				raw = raw[:0]
				for len(raw) < k {
					for len(seg) == 0 {
						if si == len(src) {
							short = fmt.Errorf("zchunk: segments of %d bytes for a stream of %d", n-left+len(raw), n)
							return
						}
						seg, si = src[si], si+1
					}
					m := min(len(seg), k-len(raw))
					raw, seg = append(raw, seg[:m]...), seg[m:]
				}
				piece = raw
			}
			b := AppendChunk(getBuf(), codec, piece)
			left -= k
			select {
			case chunks <- b:
			case <-stop:
				putBuf(b)
				return
			}
		}
	})
	var wrote int64
	var err error
	for b := range chunks {
		if err == nil {
			var k int
			k, err = w.Write(b)
			wrote += int64(k)
			if err != nil {
				close(stop)
			}
		}
		putBuf(b)
	}
	wg.Wait()
	if err == nil {
		err = short
	}
	return wrote, err
}

// tamper, when set (SetTamper), sees every chunk AppendChunk makes.
var tamper atomic.Pointer[func([]byte)]

// SetTamper makes AppendChunk (and so WriteStream) pass every chunk it
// makes, header and data, to f, until SetTamper(nil): tests of readers
// use it to play a sender that lies. Not for production use.
func SetTamper(f func(chunk []byte)) {
	if f == nil {
		tamper.Store(nil)
		return
	}
	tamper.Store(&f)
}

var bufs = sync.Pool{New: func() any { return make([]byte, 0, HeaderLen+MaxEncoded(MaxChunk)) }}

func getBuf() []byte  { return bufs.Get().([]byte)[:0] }
func putBuf(b []byte) { bufs.Put(b[:0]) }

// ReadStream reads a stream of n raw bytes from r into dst's segments,
// decoding each chunk in place (a chunk that straddles segments is decoded
// aside and copied). It returns the bytes read from r. A chunk that does
// not decode fails with ErrCorrupt, a header that cannot be right with
// ErrBadHeader, a short read with r's error (io.ErrUnexpectedEOF for a
// stream cut short): a sender that lied once cannot be trusted with the
// lengths that follow, so the stream cannot be followed past any of them.
func ReadStream(r io.Reader, dst Segments, n int) (int64, error) {
	var read int64
	var hb [HeaderLen]byte
	data := getBuf()
	defer func() { putBuf(data) }()
	var aside []byte
	seg, si := []byte(nil), 0
	for left := n; left > 0; {
		if _, err := io.ReadFull(r, hb[:]); err != nil {
			return read, eof(err)
		}
		read += HeaderLen
		codec, raw, dlen, err := parseHeader(hb[:], left)
		if err != nil {
			return read, err
		}
		data = data[:dlen]
		if _, err := io.ReadFull(r, data); err != nil {
			return read, eof(err)
		}
		read += int64(dlen)
		for len(seg) == 0 && si < len(dst) {
			seg, si = dst[si], si+1
		}
		if len(seg) >= raw {
			if err := decode(codec, seg[:raw], data); err != nil {
				return read, err
			}
			seg = seg[raw:]
		} else {
			if cap(aside) < raw {
				aside = make([]byte, raw)
			}
			a := aside[:raw]
			if err := decode(codec, a, data); err != nil {
				return read, err
			}
			for len(a) > 0 {
				for len(seg) == 0 {
					if si == len(dst) {
						return read, fmt.Errorf("zchunk: %d destination bytes for a stream of %d", n-left+raw-len(a), n)
					}
					seg, si = dst[si], si+1
				}
				k := copy(seg, a)
				seg, a = seg[k:], a[k:]
			}
		}
		left -= raw
	}
	return read, nil
}

// discard reads and drops a stream of left raw bytes, chunk by chunk,
// adding what it read to *read.
func discard(r io.Reader, left int, read *int64) error {
	var hb [HeaderLen]byte
	for left > 0 {
		if _, err := io.ReadFull(r, hb[:]); err != nil {
			return eof(err)
		}
		*read += HeaderLen
		_, raw, dlen, err := parseHeader(hb[:], left)
		if err != nil {
			return err
		}
		k, err := io.CopyN(io.Discard, r, int64(dlen))
		*read += k
		if err != nil {
			return eof(err)
		}
		left -= raw
	}
	return nil
}

// DecodeChunk decodes one whole chunk (header and data, nothing after)
// into the front of dst, and returns its raw length; it fails as
// ReadStream does on a chunk that declares more than dst holds.
func DecodeChunk(dst, chunk []byte) (int, error) {
	if len(chunk) < HeaderLen {
		return 0, fmt.Errorf("%w: a chunk of %d bytes", ErrBadHeader, len(chunk))
	}
	codec, raw, dlen, err := parseHeader(chunk, len(dst))
	if err != nil {
		return 0, err
	}
	if dlen != len(chunk)-HeaderLen {
		return 0, fmt.Errorf("%w: %d data bytes declared, %d there", ErrBadHeader, dlen, len(chunk)-HeaderLen)
	}
	return raw, decode(codec, dst[:raw], chunk[HeaderLen:])
}

// Skip reads and drops a stream of n raw bytes, as ReadStream reads one,
// without decoding it. It returns the bytes read from r.
func Skip(r io.Reader, n int) (int64, error) {
	var read int64
	err := discard(r, n, &read)
	return read, err
}

func eof(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
