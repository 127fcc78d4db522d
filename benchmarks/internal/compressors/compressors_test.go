package compressors

import (
	"bytes"
	"io"
	"math/rand/v2"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestRoundTrip compresses and decompresses through every compressor, twice,
// so the second pass uses pooled encoders and decoders.
func TestRoundTrip(t *testing.T) {
	defer leakcheck.Check(t)
	r := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(r.IntN(4)) // compressible
	}
	for _, c := range All() {
		for pass := range 2 {
			var buf bytes.Buffer
			w, err := c.Compress(&buf)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := w.Write(data); err != nil {
				t.Fatal(err)
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			if buf.Len() >= len(data) {
				t.Errorf("%s: %d bytes compressed to %d", c.Name(), len(data), buf.Len())
			}
			rd, err := c.Decompress(&buf)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(rd)
			if err != nil {
				t.Fatalf("%s pass %d: %v", c.Name(), pass, err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("%s pass %d: round trip differs", c.Name(), pass)
			}
		}
	}
}

func TestRegisterAndGet(t *testing.T) {
	Register()
	Register()
	for _, name := range []string{ZstdFastest, ZstdDefault, S2, Snappy, Gzip} {
		if Get(name) == nil {
			t.Errorf("Get(%q) = nil", name)
		}
	}
	if Get("nope") != nil {
		t.Error("Get of an unknown name returned a compressor")
	}
}
