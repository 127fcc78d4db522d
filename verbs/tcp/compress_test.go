package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/payloadtest"
	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/verbs"
)

func payload(kind string, n int, seed uint64) []byte {
	b := make([]byte, n)
	payloadtest.Fill(kind, b, seed)
	return b
}

// TestCompressedReads: a Read that asks for compression gets its data
// compressed only when the responder allows it, with the codec asked for,
// or for CodecAuto only when the sample and the goodput say it pays; the
// bytes land exact, into one segment or several.
func TestCompressedReads(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	const n = 3<<20 + 4096
	sparse, random := payload("sparse-f32", n, 1), payload("random", n, 2)
	src := append(append([]byte(nil), sparse...), random...)
	smr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: src}, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, n+64)
	dmr, err := a.pd.RegisterMemory(verbs.Memory{Bytes: dst}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	const gbit = 1e9 / 8
	cases := []struct {
		name     string
		allow    bool
		off      int // sparse at 0, random at n
		c        verbs.Compression
		segments bool
		want     verbs.Codec
	}{
		{"not allowed", false, 0, verbs.Compression{Codec: verbs.CodecS2}, false, verbs.CodecNone},
		{"s2", true, 0, verbs.Compression{Codec: verbs.CodecS2}, false, verbs.CodecS2},
		{"zstd", true, 0, verbs.Compression{Codec: verbs.CodecZstd}, false, verbs.CodecZstd},
		{"s2 into segments", true, 0, verbs.Compression{Codec: verbs.CodecS2}, true, verbs.CodecS2},
		{"s2 random, stored", true, n, verbs.Compression{Codec: verbs.CodecS2}, false, verbs.CodecS2},
		// 10 Mb/s: slower than any codec compresses, even under the race
		// detector.
		{"auto sparse at 10 Mb/s", true, 0, verbs.Compression{Codec: verbs.CodecAuto, Goodput: gbit / 100}, false, verbs.CodecS2},
		{"auto random at 10 Mb/s", true, n, verbs.Compression{Codec: verbs.CodecAuto, Goodput: gbit / 100}, false, verbs.CodecNone},
		{"auto sparse at 400 Gb/s", true, 0, verbs.Compression{Codec: verbs.CodecAuto, Goodput: 400 * gbit}, false, verbs.CodecNone},
		{"auto sparse, goodput unknown", true, 0, verbs.Compression{Codec: verbs.CodecAuto}, false, verbs.CodecNone},
	}
	for i, c := range cases {
		b.qp.(verbs.Compressor).AllowCompression(c.allow)
		clear(dst)
		wr := verbs.SendRequest{ID: uint64(i + 1), Op: verbs.OpRead, Local: verbs.Local{Region: dmr, Length: n},
			Remote: verbs.Remote{Addr: smr.Addr() + uint64(c.off), Key: smr.RemoteKey()}, Compress: c.c}
		if c.segments {
			wr.Segments = []verbs.Local{{Region: dmr, Length: 1000}, {Region: dmr, Offset: 1000, Length: n - 2000}, {Region: dmr, Offset: n - 1000, Length: 1000}}
		}
		if err := a.qp.PostSend(wr); err != nil {
			t.Fatal(err)
		}
		got, ok := waitCompletion(t, a.cq, 30*time.Second)
		if !ok || got.Status != verbs.StatusSuccess || got.Len != n {
			t.Fatalf("%s: completion %+v", c.name, got)
		}
		if !bytes.Equal(dst[:n], src[c.off:c.off+n]) {
			t.Fatalf("%s: wrong bytes", c.name)
		}
		// Auto on sparse data may pick either codec.
		if packed := got.Packed; packed != c.want && !(c.c.Codec == verbs.CodecAuto && c.want != verbs.CodecNone && packed != verbs.CodecNone) {
			t.Errorf("%s: packed %v, want %v", c.name, packed, c.want)
		}
		switch {
		case got.Packed == verbs.CodecNone && got.Wire != 0:
			t.Errorf("%s: %d wire bytes for a Read that came as it was", c.name, got.Wire)
		case got.Packed != verbs.CodecNone && c.off == 0 && got.Wire > n/3:
			t.Errorf("%s: %d wire bytes for %d sparse ones", c.name, got.Wire, n)
		case got.Packed != verbs.CodecNone && c.off == n && got.Wire < n:
			t.Errorf("%s: %d wire bytes for %d random ones", c.name, got.Wire, n)
		}
	}
}

// TestHostileCompressedResponse: a peer that answers a Read with a
// compressed stream that does not decode fails that Read with
// StatusBadData and the queue pair with it; one that sends a compressed
// answer nobody asked for breaks the connection. Neither writes past the
// destination.
func TestHostileCompressedResponse(t *testing.T) {
	bomb := zchunk.AppendChunk(nil, zchunk.S2, make([]byte, 1<<20))
	putLen := func(b []byte, raw int) []byte { binary.LittleEndian.PutUint32(b[4:], uint32(raw)); return b }
	for _, tc := range []struct {
		name   string
		ask    verbs.Codec
		stream []byte
		want   verbs.Status
	}{
		{"inflation bomb", verbs.CodecS2, putLen(append([]byte(nil), bomb...), 4096), verbs.StatusBadData},
		{"unasked", verbs.CodecNone, zchunk.AppendChunk(nil, zchunk.Stored, make([]byte, 4096)), verbs.StatusTransport},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			pd, qp, cq := newTestQP(t, WithLingerTimeout(200*time.Millisecond))
			defer pd.Close()
			dst := make([]byte, 4096+64)
			mr, err := pd.RegisterMemory(verbs.Memory{Bytes: dst}, verbs.AccessLocalWrite)
			if err != nil {
				t.Fatal(err)
			}
			c := fakePeer(t, qp)
			defer c.Close()
			if err := qp.PostSend(verbs.SendRequest{ID: 7, Op: verbs.OpRead, Local: verbs.Local{Region: mr, Length: 4096},
				Remote: verbs.Remote{Addr: 1 << 20, Key: 5}, Compress: verbs.Compression{Codec: tc.ask}}); err != nil {
				t.Fatal(err)
			}
			var hb [headerSize]byte
			if _, err := io.ReadFull(c, hb[:]); err != nil {
				t.Fatal(err)
			}
			req, err := parseHeader(hb[:])
			if err != nil || req.op != frameReadReq || (req.flags&flagCompress != 0) != (tc.ask != verbs.CodecNone) {
				t.Fatalf("request %+v, %v", req, err)
			}
			c.Write(frame(header{op: frameReadResp, flags: flagCompress, imm: uint32(zchunk.S2), seq: req.seq, length: 4096}, tc.stream))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			out := make([]verbs.Completion, 1)
			if n, err := cq.Wait(ctx, out); err != nil || n != 1 || out[0].ID != 7 || out[0].Status != tc.want {
				t.Fatalf("completion %+v, %v: want status %v", out[:n], err, tc.want)
			}
			if st := qp.State(); st != verbs.QPError {
				t.Fatalf("queue pair in %v, want ERR", st)
			}
			if !bytes.Equal(dst[4096:], make([]byte, 64)) {
				t.Fatal("wrote past the destination")
			}
			io.Copy(io.Discard, c)
		})
	}
}
