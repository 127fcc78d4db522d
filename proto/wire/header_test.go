package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func sample() *Header {
	h := &Header{
		Key:         []byte("layer3/weights"),
		DType:       zerocopy.Float32,
		ByteLength:  4 * 2 * 3 * 5,
		Checksum:    0xdeadbeef,
		HasChecksum: true,
		HasLocation: true,
		Location:    Location{Provider: ProviderTCP, RegionID: 7, RemoteKey: 0x1234, Address: 0x7f0000001000, Offset: 4096, Length: 120},
	}
	h.SetShape([]int64{2, 3, 5})
	return h
}

func equal(a, b *Header) bool {
	return bytes.Equal(a.Key, b.Key) && a.DType == b.DType && a.Rank == b.Rank && a.Dims == b.Dims &&
		a.ByteLength == b.ByteLength && a.Checksum == b.Checksum && a.HasChecksum == b.HasChecksum &&
		a.HasLocation == b.HasLocation && a.Location == b.Location
}

func TestRoundTrip(t *testing.T) {
	var enc Encoder
	cases := []*Header{sample(), {DType: zerocopy.Uint8, ByteLength: 1}}
	for _, d := range zerocopy.DTypes() {
		h := &Header{Key: []byte(d.String()), DType: d, ByteLength: uint64(7 * 11 * d.Size())}
		h.SetShape([]int64{7, 11})
		cases = append(cases, h)
	}
	big := &Header{DType: zerocopy.Int8}
	big.SetShape(make([]int64, zerocopy.MaxRank))
	cases = append(cases, big)
	for _, h := range cases {
		b, err := enc.Encode(h)
		if err != nil {
			t.Fatalf("Encode(%v): %v", h.DType, err)
		}
		var got Header
		if err := Decode(b, &got); err != nil {
			t.Fatalf("Decode(%v): %v", h.DType, err)
		}
		if !equal(h, &got) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, *h)
		}
	}
}

func TestValidateRejects(t *testing.T) {
	cases := map[string]func(h *Header){
		"invalid dtype":    func(h *Header) { h.DType = 0 },
		"unknown dtype":    func(h *Header) { h.DType = 99 },
		"negative dim":     func(h *Header) { h.Dims[1] = -3 },
		"length mismatch":  func(h *Header) { h.ByteLength++ },
		"overflow":         func(h *Header) { h.Dims[0] = math.MaxInt64 },
		"key too long":     func(h *Header) { h.Key = make([]byte, MaxKeyLen+1) },
		"rank":             func(h *Header) { h.Rank = zerocopy.MaxRank + 1 },
		"provider":         func(h *Header) { h.Location.Provider = 9 },
		"no provider":      func(h *Header) { h.Location.Provider = 0 },
		"location length":  func(h *Header) { h.Location.Length = 1 },
		"offset overflow":  func(h *Header) { h.Location.Offset = math.MaxInt64 },
		"address overflow": func(h *Header) { h.Location.Address = math.MaxUint64 - 5 },
	}
	var enc Encoder
	for name, mutate := range cases {
		h := sample()
		mutate(h)
		if err := h.Validate(); !errors.Is(err, ErrInvalidHeader) {
			t.Errorf("%s: Validate = %v", name, err)
		}
		if _, err := enc.Encode(h); !errors.Is(err, ErrInvalidHeader) {
			t.Errorf("%s: Encode = %v", name, err)
		}
	}
	if err := sample().SetShape(make([]int64, zerocopy.MaxRank+1)); err == nil {
		t.Error("SetShape accepted rank 33")
	}
}

// TestDecodeRejectsCorruption flips, truncates and rewrites encoded headers
// and checks that Decode returns an error (and does not panic).
func TestDecodeRejectsCorruption(t *testing.T) {
	var enc Encoder
	good, err := enc.Encode(sample())
	if err != nil {
		t.Fatal(err)
	}
	good = bytes.Clone(good)
	var h Header
	for n := range len(good) {
		// Only trailing alignment padding may go without an error, and
		// then nothing of the header is lost.
		if err := Decode(good[:n], &h); err == nil && (n < len(good)-7 || !equal(&h, sample())) {
			t.Errorf("truncated to %d of %d bytes: decoded %+v", n, len(good), h)
		}
	}
	bad := bytes.Clone(good)
	copy(bad[4:], "XXXX")
	if err := Decode(bad, &h); err == nil {
		t.Error("wrong identifier accepted")
	}
	bad = bytes.Clone(good)
	binary.LittleEndian.PutUint32(bad, uint32(len(bad)))
	if err := Decode(bad, &h); err == nil {
		t.Error("root offset past the end accepted")
	}
	if err := Decode(make([]byte, MaxHeaderSize+1), &h); err == nil {
		t.Error("oversized input accepted")
	}
	// Every single-byte change either decodes to a valid header or fails.
	for i := range good {
		for _, v := range []byte{0, 0xff, good[i] ^ 0x80, good[i] + 1} {
			bad = bytes.Clone(good)
			bad[i] = v
			if err := Decode(bad, &h); err == nil {
				if verr := h.Validate(); verr != nil {
					t.Fatalf("byte %d = %#x decoded into an invalid header: %v", i, v, verr)
				}
			}
		}
	}
}

func TestDecodeAllocatesNothing(t *testing.T) {
	var enc Encoder
	b, err := enc.Encode(sample())
	if err != nil {
		t.Fatal(err)
	}
	var h Header
	allocs := testing.AllocsPerRun(1000, func() {
		if err := Decode(b, &h); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("Decode allocates %.1f times per call", allocs)
	}
}

func FuzzDecode(f *testing.F) {
	var enc Encoder
	for _, h := range []*Header{sample(), {DType: zerocopy.Bool, ByteLength: 1}} {
		b, err := enc.Encode(h)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(bytes.Clone(b))
	}
	f.Add([]byte("TRH1"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var h Header
		if err := Decode(b, &h); err != nil {
			if !errors.Is(err, ErrInvalidHeader) {
				t.Fatalf("error does not wrap ErrInvalidHeader: %v", err)
			}
			return
		}
		// A header that decodes is valid and survives a round trip.
		if err := h.Validate(); err != nil {
			t.Fatalf("decoded an invalid header: %v", err)
		}
		var e Encoder
		out, err := e.Encode(&h)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		var h2 Header
		if err := Decode(out, &h2); err != nil || !equal(&h, &h2) {
			t.Fatalf("re-decode: %v\n%+v\n%+v", err, h, h2)
		}
	})
}

// TestDecodeFreshHeaderAllocatesNothing: a Header declared per call stays
// on the stack.
func TestDecodeFreshHeaderAllocatesNothing(t *testing.T) {
	var enc Encoder
	b, err := enc.Encode(sample())
	if err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(1000, func() {
		var h Header
		if err := Decode(b, &h); err != nil || h.Rank != 3 {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("Decode into a fresh Header allocates %.1f times per call", allocs)
	}
}
