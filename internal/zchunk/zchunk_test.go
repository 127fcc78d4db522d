package zchunk

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/klauspost/compress/s2"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/payloadtest"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

func fill(kind string, n int, seed uint64) []byte {
	b := make([]byte, n)
	payloadtest.Fill(kind, b, seed)
	return b
}

// split cuts b into segments of the given sizes (the last takes the rest).
func split(b []byte, sizes ...int) Segments {
	var out Segments
	for _, s := range sizes {
		s = min(s, len(b))
		out = append(out, b[:s])
		b = b[s:]
	}
	return append(out, b)
}

// TestRoundTrip: every codec and payload, sizes around the chunk size,
// contiguous and in segments that chunks straddle on both sides, comes
// back exact; incompressible chunks are stored, compressible ones shrink.
func TestRoundTrip(t *testing.T) {
	for _, kind := range payloadtest.Kinds {
		for _, codec := range []Codec{Stored, S2, Zstd, Huff} {
			for _, n := range []int{1, 100, 4 << 10, MaxChunk - 1, MaxChunk, MaxChunk + 1, 3*MaxChunk + 12345} {
				src := fill(kind, n, uint64(n))
				for _, layout := range []struct {
					name     string
					src, dst []int
				}{{"contiguous", nil, nil}, {"segments", []int{7, MaxChunk - 3, 5000}, []int{MaxChunk/2 + 1, 3, MaxChunk}}} {
					var wire bytes.Buffer
					wrote, err := WriteStream(&wire, codec, split(src, layout.src...), n)
					if err != nil || wrote != int64(wire.Len()) {
						t.Fatalf("%s %v %d %s: WriteStream: %d, %v", kind, codec, n, layout.name, wrote, err)
					}
					got := make([]byte, n)
					read, err := ReadStream(&wire, split(got, layout.dst...), n)
					if err != nil || read != wrote || wire.Len() != 0 {
						t.Fatalf("%s %v %d %s: ReadStream: %d of %d, %v (%d left)", kind, codec, n, layout.name, read, wrote, err, wire.Len())
					}
					if !bytes.Equal(got, src) {
						t.Fatalf("%s %v %d %s: wrong bytes", kind, codec, n, layout.name)
					}
					chunks := int64((n + MaxChunk - 1) / MaxChunk)
					switch {
					case codec == Stored || kind == "random":
						if wrote != int64(n)+chunks*HeaderLen {
							t.Errorf("%s %v %d: %d bytes on the wire, want %d (stored)", kind, codec, n, wrote, int64(n)+chunks*HeaderLen)
						}
					case n >= 4<<10 && kind != "lowent-f16" && wrote > int64(n)/2:
						t.Errorf("%s %v %d: %d bytes on the wire", kind, codec, n, wrote)
					}
				}
			}
		}
	}
}

// TestWriteStreamShortSource: segments shorter than the stream fail.
func TestWriteStreamShortSource(t *testing.T) {
	if _, err := WriteStream(io.Discard, S2, Segments{make([]byte, 10), make([]byte, 10)}, 30); err == nil {
		t.Error("a stream of 30 bytes from 20 was written")
	}
}

// failWriter fails after n bytes.
type failWriter struct{ n int }

func (w *failWriter) Write(b []byte) (int, error) {
	if len(b) > w.n {
		k := w.n
		w.n = 0
		return k, errors.New("broken")
	}
	w.n -= len(b)
	return len(b), nil
}

// TestWriteStreamStopsOnError: a failed write ends the stream, and the
// compressing goroutine with it (leakcheck).
func TestWriteStreamStopsOnError(t *testing.T) {
	src := fill("sparse-f32", 8*MaxChunk, 1)
	if _, err := WriteStream(&failWriter{n: 1000}, S2, Segments{src}, len(src)); err == nil {
		t.Fatal("no error")
	}
}

func chunk(codec Codec, raw int, data []byte) []byte {
	b := make([]byte, HeaderLen, HeaderLen+len(data))
	putHeader(b, codec, raw, len(data))
	return append(b, data...)
}

// TestHostileStreams: what a malicious sender can put in a stream fails
// the read with the right error and never writes past the destination.
func TestHostileStreams(t *testing.T) {
	good := s2.Encode(nil, bytes.Repeat([]byte{1}, 4096))
	bomb := s2.Encode(nil, make([]byte, 1<<20)) // 1 MiB of zeros in a few KiB
	zbig := compress(Zstd, nil, make([]byte, 64<<10))
	cases := []struct {
		name   string
		stream []byte
		n      int
		want   error
	}{
		{"inflation bomb: decodes to more than declared", append(chunk(S2, 4096, bomb), chunk(Stored, 4, []byte{1, 2, 3, 4})...), 4100, ErrCorrupt},
		{"zstd bomb", chunk(Zstd, 4096, zbig), 4096, ErrCorrupt},
		{"declares more raw than the stream has", chunk(S2, 8192, good), 4096, ErrBadHeader},
		{"declares less raw than the data decodes to", chunk(S2, 100, good), 100, ErrCorrupt},
		{"raw past MaxChunk", chunk(S2, MaxChunk+1, good), 2 * MaxChunk, ErrBadHeader},
		{"zero raw", chunk(S2, 0, good), 4096, ErrBadHeader},
		{"data longer than any encoding", chunk(S2, 10, make([]byte, 5000)), 4096, ErrBadHeader},
		{"stored with a different length", chunk(Stored, 10, make([]byte, 9)), 10, ErrBadHeader},
		{"unknown codec", chunk(Codec(9), 4096, good), 4096, ErrBadHeader},
		{"garbage data", chunk(S2, 4096, bytes.Repeat([]byte{0xff}, 100)), 4096, ErrCorrupt},
		{"truncated data", chunk(S2, 4096, good)[:HeaderLen+len(good)-3], 4096, io.ErrUnexpectedEOF},
		{"truncated header", chunk(S2, 4096, good)[:5], 4096, io.ErrUnexpectedEOF},
		{"cut after a chunk", chunk(S2, 4096, good), 8192, io.ErrUnexpectedEOF},
		{"huff0: unknown block type", chunk(Huff, 4096, []byte{9, 1, 2, 3}), 4096, ErrCorrupt},
		{"huff0: a stored block cut short", chunk(Huff, 4096, append([]byte{huffStored}, make([]byte, 100)...)), 4096, ErrCorrupt},
		{"huff0: a coded block longer than its data", chunk(Huff, 4096, []byte{huffCoded, 0xff, 0xff, 0, 0, 1}), 4096, ErrCorrupt},
		{"huff0: a garbage table", chunk(Huff, 4096, []byte{huffCoded, 4, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc}), 4096, ErrCorrupt},
		{"huff0: bytes past the blocks", chunk(Huff, 4, []byte{huffRLE, 7, 0}), 4, ErrCorrupt},
		{"huff0: a block decoding to more than its chunk", chunk(Huff, 4000, huffEncode(nil, fill("lowent-f16", 4096, 1))), 4000, ErrCorrupt},
	}
	for _, c := range cases {
		dst := make([]byte, c.n+64) // a guard past the destination
		for i := c.n; i < len(dst); i++ {
			dst[i] = 0xAB
		}
		_, err := ReadStream(bytes.NewReader(c.stream), Segments{dst[:c.n]}, c.n)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
		for i := c.n; i < len(dst); i++ {
			if dst[i] != 0xAB {
				t.Errorf("%s: wrote past the destination at %d", c.name, i)
				break
			}
		}
	}
}

// FuzzReadStream: no input makes ReadStream write past its destination,
// panic, or read past the stream it declares; a stream that reads
// without error fills the destination exactly.
func FuzzReadStream(f *testing.F) {
	var wire bytes.Buffer
	WriteStream(&wire, S2, Segments{fill("sparse-f32", 5000, 1)}, 5000)
	f.Add(wire.Bytes(), uint16(5000), uint16(3000))
	wire.Reset()
	WriteStream(&wire, Zstd, Segments{fill("lowent-f16", 3000, 2)}, 3000)
	f.Add(wire.Bytes(), uint16(3000), uint16(1))
	f.Add(chunk(Stored, 3, []byte{1, 2, 3}), uint16(3), uint16(2))
	wire.Reset()
	WriteStream(&wire, Huff, Segments{fill("lowent-f16", 5000, 3)}, 5000)
	f.Add(wire.Bytes(), uint16(5000), uint16(4000))
	f.Fuzz(func(t *testing.T, stream []byte, n, cut uint16) {
		if n == 0 {
			return
		}
		dst := make([]byte, int(n)+16)
		segs := split(dst[:n], int(cut)%int(n))
		read, err := ReadStream(bytes.NewReader(stream), segs, int(n))
		if read > int64(len(stream)) {
			t.Fatalf("read %d of %d bytes", read, len(stream))
		}
		for _, b := range dst[n:] {
			if b != 0 {
				t.Fatal("wrote past the destination")
			}
		}
		if err == nil && read == 0 {
			t.Fatal("a stream of no bytes filled the destination")
		}
	})
}

// TestSampleAndDecide: sparse data samples compressible with both codecs,
// random data not; Decide compresses sparse data on a slow link, never on
// a fast one, and never random data.
func TestSampleAndDecide(t *testing.T) {
	n := 64 << 20
	sparse := fill("sparse-f32", 1<<20, 3)
	random := fill("random", 1<<20, 4)
	// The samples need only the bytes they look at: a 64 MiB stream of
	// 64 views of the same MiB.
	big := func(b []byte) Segments {
		var s Segments
		for range 64 {
			s = append(s, b)
		}
		return s
	}
	es := Sample(big(sparse), n, S2, Zstd, Huff)
	er := Sample(big(random), n, S2, Zstd, Huff)
	for i, c := range []Codec{S2, Zstd, Huff} {
		if es[i].Codec != c || es[i].Ratio < 3 || es[i].Speed <= 0 {
			t.Errorf("sparse, %v: %+v", c, es[i])
		}
		if er[i].Ratio > 1.01 {
			t.Errorf("random, %v: %+v", c, er[i])
		}
	}
	const gbit = 1e9 / 8
	slow := Decide(n, gbit/10, 2, es) // 100 Mb/s: slower than a codec runs even under the race detector
	if slow.Codec == Stored || slow.Packed >= slow.Raw {
		t.Errorf("sparse at 100 Mb/s: %v", slow)
	}
	if p := Decide(n, 1*gbit, 2, er); p.Codec != Stored {
		t.Errorf("random at 1 Gb/s: %v", p)
	}
	if p := Decide(n, 400*gbit, 2, es); p.Codec != Stored {
		t.Errorf("sparse at 400 Gb/s: %v", p)
	}
	for i, c := range []Codec{S2, Zstd, Huff} {
		if es[i].DecodeSpeed <= 0 || er[i].DecodeSpeed != 0 {
			t.Errorf("%v: decoding timed at %.0f MB/s on sparse data, %.0f on random; want > 0 and 0 (not timed: it did not shrink)", c, es[i].DecodeSpeed/1e6, er[i].DecodeSpeed/1e6)
		}
	}
	// Made-up estimates: compressing fast and 100:1, decoding slower than
	// the link (s2 on bytes that repeat with a short period): the bytes go
	// as they are. Without the decoding measured, the old assumption
	// (decoding twice as fast as compressing) would compress.
	slowDecode := []Estimate{{Codec: S2, Ratio: 100, Speed: 9e9, DecodeSpeed: 1e9}}
	if p := Decide(n, 4e9, 1, slowDecode); p.Codec != Stored {
		t.Errorf("decoding at 1 GB/s over a 4 GB/s link: %v", p)
	}
	if p := Decide(n, 4e9, 1, []Estimate{{Codec: S2, Ratio: 100, Speed: 9e9}}); p.Codec != S2 {
		t.Errorf("decoding not timed, over a 4 GB/s link: %v", p)
	}
	if p := Decide(n, 0.2e9, 1, slowDecode); p.Codec != S2 {
		t.Errorf("decoding at 1 GB/s over a 0.2 GB/s link: %v", p)
	}
	// A made-up case: ratio 2 at 100 MB/s a core over 100 MB/s: on one
	// core compressing is the bottleneck (no win), on four it wins.
	e := []Estimate{{Codec: Zstd, Ratio: 2, Speed: 100e6}}
	if p := Decide(n, 100e6, 1, e); p.Codec != Stored {
		t.Errorf("one core: %v", p)
	}
	if p := Decide(n, 100e6, 4, e); p.Codec != Zstd || p.Packed > time.Duration(float64(n)/100e6/2*1e9)*12/10 {
		t.Errorf("four cores: %v", p)
	}
}
