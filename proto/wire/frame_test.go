package wire

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	flatbuffers "github.com/google/flatbuffers/go"

	"github.com/tensorrpc/tensorrpc/proto/wirefb"
)

// frame builds a frame: header, body, then the releases.
func frame(h FrameHeader, body []byte, releases ...uint64) []byte {
	h.Releases = uint16(len(releases))
	b := make([]byte, FrameHeaderLen, FrameHeaderLen+len(body)+8*len(releases))
	b = append(b, body...)
	b = AppendReleases(b, releases...)
	PutFrameHeader(b, h, len(b)-FrameHeaderLen)
	return b
}

// validFrames has frames of every type, with and without bodies, flags and
// releases.
func validFrames() []struct {
	h        FrameHeader
	body     []byte
	releases []uint64
} {
	refs := AppendReleases(nil, 0x1122334455667788, 1, math.MaxUint64)
	return []struct {
		h        FrameHeader
		body     []byte
		releases []uint64
	}{
		{FrameHeader{Type: FrameFetchReq, Ref: 1}, []byte("layer3/weights"), nil},
		{FrameHeader{Type: FrameFetchReq, Flags: FlagWait | FlagLease, Credits: 3, Ref: math.MaxUint64}, []byte("k"), []uint64{9, 10}},
		{FrameHeader{Type: FrameFetchReq, Flags: FlagLease, Ref: 7}, nil, nil},
		{FrameHeader{Type: FrameFetchResp, Ref: 7, Credits: 1}, []byte{0, 0, 0, 0, 0x0a, 0x02}, nil},
		{FrameHeader{Type: FrameFetchResp, Flags: FlagIndirect, Ref: 7}, []byte{0, 0, 0, 0, 0x10, 6}, nil},
		{FrameHeader{Type: FrameFetchReq, Flags: FlagWait | FlagIndirect, Ref: 8}, []byte{0x10, 6}, nil},
		{FrameHeader{Type: FrameSendReq, Flags: FlagIndirect, Ref: 9}, []byte{0x10, 6}, nil},
		{FrameHeader{Type: FrameCallReq, Flags: FlagIndirect, Ref: 10}, []byte{0x10, 6}, nil},
		{FrameHeader{Type: FrameFetchReq, Flags: FlagRows | FlagWait, Ref: 11}, []byte{0x12, 1, 'k', 0x32, 1, 3}, nil},
		{FrameHeader{Type: FrameFetchReq, Flags: FlagLanding | FlagHeaders, Ref: 12}, []byte{0, 0, 0, 0, 0x12, 1, 'k', 0x3a, 2, 0x30, 9}, nil},
		{FrameHeader{Type: FrameCredit, Credits: 16}, nil, nil},
		{FrameHeader{Type: FrameCredit}, nil, nil},
		{FrameHeader{Type: FrameSendReq, Ref: 0xabcdef, Credits: math.MaxUint32}, bytes.Repeat([]byte{0x5a}, 1000), []uint64{1, 2, 3}},
		{FrameHeader{Type: FrameSendResp, Ref: 0xabcdef}, []byte{0, 0, 0, 0}, nil},
		{FrameHeader{Type: FrameCallReq, Ref: 42}, []byte("call"), []uint64{77}},
		{FrameHeader{Type: FrameCallReq, Flags: FlagHeaders, Ref: 43}, []byte{2, 0, 0, 0, 0x10, 1, 'c'}, nil},
		{FrameHeader{Type: FrameFetchReq, Flags: FlagHeaders | FlagWait, Ref: 44}, []byte{0, 0, 0, 0, 'k'}, nil},
		{FrameHeader{Type: FrameCallResp, Ref: 42}, []byte{0, 0, 0, 0}, nil},
		{FrameHeader{Type: FrameCallResp, Flags: FlagIndirect, Ref: 42, Credits: 2}, []byte{0, 0, 0, 0, 8, 1}, nil},
		{FrameHeader{Type: FrameRelease}, refs, nil},
		{FrameHeader{Type: FrameRelease, Credits: 5}, nil, []uint64{100, 200}},
		{FrameHeader{Type: FrameRelease}, refs, []uint64{100}},
		{FrameHeader{Type: FrameRelease}, nil, nil},
	}
}

func ids(r Releases) []uint64 {
	out := []uint64{}
	for i := range r.Len() {
		out = append(out, r.At(i))
	}
	return out
}

func TestFrameRoundTrip(t *testing.T) {
	seen := map[uint8]bool{}
	for i, c := range validFrames() {
		b := frame(c.h, c.body, c.releases...)
		if len(b) != FrameHeaderLen+len(c.body)+8*len(c.releases) {
			t.Fatalf("%d: frame of %d bytes", i, len(b))
		}
		h, body, rel, err := DecodeFrame(b)
		if err != nil {
			t.Fatalf("%d: %v", i, err)
		}
		want := c.h
		want.Releases = uint16(len(c.releases))
		if h != want {
			t.Errorf("%d: header %+v, want %+v", i, h, want)
		}
		if !bytes.Equal(body, c.body) {
			t.Errorf("%d: body %x, want %x", i, body, c.body)
		}
		if got := ids(rel); len(got) != len(c.releases) || (len(got) > 0 && !equalU64(got, c.releases)) {
			t.Errorf("%d: releases %v, want %v", i, got, c.releases)
		}
		// body and releases alias b.
		if len(body) > 0 && &body[0] != &b[FrameHeaderLen] {
			t.Errorf("%d: body does not alias the frame", i)
		}
		if len(rel) > 0 && &rel[0] != &b[FrameHeaderLen+len(c.body)] {
			t.Errorf("%d: releases do not alias the frame", i)
		}
		if h.Type == FrameRelease {
			if got, want := ids(Releases(body)), ids(Releases(c.body)); !equalU64(got, want) {
				t.Errorf("%d: RELEASE refs %v, want %v", i, got, want)
			}
		}
		seen[h.Type] = true
	}
	for typ := FrameFetchReq; typ <= FrameRelease; typ++ {
		if !seen[typ] {
			t.Errorf("type %d has no round trip", typ)
		}
	}
}

func equalU64(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestFrameGolden pins the bytes of one frame, as header.fbs describes
// them.
func TestFrameGolden(t *testing.T) {
	b := frame(FrameHeader{Type: FrameFetchReq, Flags: FlagWait, Credits: 0x04030201, Ref: 0x0807060504030201}, []byte("ab"), 0x1122334455667788)
	const want = "f1" + "01" + "0100" + "01020304" + "0102030405060708" + "0a000000" + "0100" + "0000" +
		"6162" + "8877665544332211"
	if got := hex.EncodeToString(b); got != want {
		t.Fatalf("frame\n got %s\nwant %s", got, want)
	}
}

func TestDecodeFrameRejects(t *testing.T) {
	good := frame(FrameHeader{Type: FrameFetchReq, Flags: FlagWait, Credits: 1, Ref: 9}, []byte("key"), 5)
	mut := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	put16 := func(off int, v uint16) []byte {
		return mut(func(b []byte) []byte { binary.LittleEndian.PutUint16(b[off:], v); return b })
	}
	put32 := func(off int, v uint32) []byte {
		return mut(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[off:], v); return b })
	}
	hdr := func(typ uint8, flags uint16, ref uint64, releases uint16, payload []byte) []byte {
		b := make([]byte, FrameHeaderLen, FrameHeaderLen+len(payload))
		b = append(b, payload...)
		PutFrameHeader(b, FrameHeader{Type: typ, Flags: flags, Ref: ref, Releases: releases}, len(payload))
		return b
	}
	cases := []struct {
		name  string
		frame []byte
	}{
		{"empty", nil},
		{"short", good[:FrameHeaderLen-1]},
		{"wrong magic", mut(func(b []byte) []byte { b[0] = 0xF2; return b })},
		{"zero magic", mut(func(b []byte) []byte { b[0] = 0; return b })},
		{"type 0", mut(func(b []byte) []byte { b[1] = 0; return b })},
		{"type 9", hdr(9, 0, 1, 0, nil)},
		{"type 255", hdr(255, 0, 1, 0, nil)},
		{"reserved low", put16(22, 1)},
		{"reserved high", put16(22, 0x8000)},
		{"length short", put32(16, uint32(len(good)-FrameHeaderLen-1))},
		{"length long", put32(16, uint32(len(good)-FrameHeaderLen+1))},
		{"length max", put32(16, math.MaxUint32)},
		{"truncated", good[:len(good)-1]},
		{"trailing byte", append(bytes.Clone(good), 0)},
		{"releases past length", put16(20, 2)},
		{"releases max", put16(20, math.MaxUint16)},
		{"releases in a header-only frame", hdr(FrameSendResp, 0, 1, 1, nil)},
		{"releases splitting nothing", hdr(FrameSendResp, 0, 1, 1, make([]byte, 7))},
		{"FETCH_REQ flag 64", hdr(FrameFetchReq, 64, 1, 0, []byte("k"))},
		{"FETCH_REQ flag 0x8000", hdr(FrameFetchReq, FlagWait|0x8000, 1, 0, []byte("k"))},
		{"FETCH_RESP flag 1 (version 2's FALLBACK)", hdr(FrameFetchResp, 1, 1, 0, nil)},
		{"FETCH_RESP flag 2", hdr(FrameFetchResp, 2, 1, 0, []byte{0, 0, 0, 0})},
		{"FETCH_REQ without a ref", hdr(FrameFetchReq, 0, 0, 0, []byte("k"))},
		{"SEND_RESP without a ref", hdr(FrameSendResp, 0, 0, 0, []byte{0, 0, 0, 0})},
		{"CALL_REQ without a ref", hdr(FrameCallReq, 0, 0, 0, nil)},
		{"CREDIT flags", hdr(FrameCredit, 1, 0, 0, nil)},
		{"CREDIT ref", hdr(FrameCredit, 0, 1, 0, nil)},
		{"CREDIT body", hdr(FrameCredit, 0, 0, 0, []byte{0})},
		{"CREDIT releases", hdr(FrameCredit, 0, 0, 1, make([]byte, 8))},
		{"SEND_REQ flags", hdr(FrameSendReq, 1, 1, 0, nil)},
		{"SEND_REQ flag 2", hdr(FrameSendReq, 2, 1, 0, nil)},
		{"SEND_REQ flag 16", hdr(FrameSendReq, FlagHeaders|16, 1, 0, nil)},
		{"FETCH_RESP headers", hdr(FrameFetchResp, FlagHeaders, 1, 0, nil)},
		{"SEND_RESP flags", hdr(FrameSendResp, 2, 1, 0, nil)},
		{"SEND_RESP indirect", hdr(FrameSendResp, FlagIndirect, 1, 0, nil)},
		{"CALL_REQ flags", hdr(FrameCallReq, 1, 1, 0, nil)},
		{"CALL_RESP flag 1", hdr(FrameCallResp, 1, 1, 0, nil)},
		{"CALL_RESP flag 2 (version 2's INDIRECT)", hdr(FrameCallResp, 2, 1, 0, nil)},
		{"CALL_RESP flag 8", hdr(FrameCallResp, FlagIndirect|8, 1, 0, nil)},
		{"RELEASE flags", hdr(FrameRelease, 1, 0, 0, nil)},
		{"RELEASE ref", hdr(FrameRelease, 0, 1, 0, make([]byte, 8))},
		{"RELEASE body of 7", hdr(FrameRelease, 0, 0, 0, make([]byte, 7))},
		{"RELEASE body of 9 with releases", hdr(FrameRelease, 0, 0, 1, make([]byte, 17))},
	}
	for _, c := range cases {
		h, body, rel, err := DecodeFrame(c.frame)
		if !errors.Is(err, ErrInvalidFrame) {
			t.Errorf("%s: DecodeFrame = %+v, %x, %x, %v; want ErrInvalidFrame", c.name, h, body, rel, err)
		}
		if err != nil && (h != FrameHeader{} || body != nil || rel != nil) {
			t.Errorf("%s: error with results %+v, %x, %x", c.name, h, body, rel)
		}
	}
	if _, _, _, err := DecodeFrame(good); err != nil {
		t.Fatalf("the unbroken frame: %v", err)
	}
}

// TestFrameHeaderMatchesFlatc checks PutFrameHeader against the generated
// code of header.fbs: the wirefb.FrameHeader accessors read back every
// field as written, and flatc's own builder lays out the same 24 bytes.
func TestFrameHeaderMatchesFlatc(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	headers := []FrameHeader{{}, {Type: math.MaxUint8, Flags: math.MaxUint16, Credits: math.MaxUint32, Ref: math.MaxUint64, Releases: math.MaxUint16}}
	for range 1000 {
		headers = append(headers, FrameHeader{Type: uint8(r.Uint32()), Flags: uint16(r.Uint32()), Credits: r.Uint32(), Ref: r.Uint64(), Releases: uint16(r.Uint32())})
	}
	b := make([]byte, FrameHeaderLen)
	builder := flatbuffers.NewBuilder(64)
	for _, h := range headers {
		n := int(r.Uint32())
		PutFrameHeader(b, h, n)
		var fh wirefb.FrameHeader
		fh.Init(b, 0)
		if fh.Magic() != FrameMagic || fh.Type() != h.Type || fh.Flags() != h.Flags || fh.Credits() != h.Credits ||
			fh.Ref() != h.Ref || fh.Length() != uint32(n) || fh.Releases() != h.Releases || fh.Reserved() != 0 {
			t.Fatalf("wirefb reads %#x %d %#x %d %#x %d %d %#x from PutFrameHeader(%+v, %d)",
				fh.Magic(), fh.Type(), fh.Flags(), fh.Credits(), fh.Ref(), fh.Length(), fh.Releases(), fh.Reserved(), h, n)
		}
		builder.Reset()
		wirefb.CreateFrameHeader(builder, FrameMagic, h.Type, h.Flags, h.Credits, h.Ref, uint32(n), h.Releases, 0)
		if fb := builder.Bytes[builder.Head():]; !bytes.Equal(fb, b) {
			t.Fatalf("flatc builder lays out %x, PutFrameHeader %x", fb, b)
		}
	}
	builder.Reset()
	start := builder.Offset()
	wirefb.CreateFrameHeader(builder, 0, 0, 0, 0, 0, 0, 0, 0)
	if size := builder.Offset() - start; size != FrameHeaderLen {
		t.Fatalf("flatc's FrameHeader is %d bytes", size)
	}
}

func TestFramePanics(t *testing.T) {
	for _, n := range []int{-1, math.MaxUint32 + 1} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("PutFrameHeader with payload length %d did not panic", n)
				}
			}()
			PutFrameHeader(make([]byte, FrameHeaderLen), FrameHeader{Type: FrameSendReq}, n)
		}()
	}
}

func TestFrameAllocatesNothing(t *testing.T) {
	buf := make([]byte, 0, 256)
	allocs := testing.AllocsPerRun(1000, func() {
		b := buf[:FrameHeaderLen]
		b = append(b, "key"...)
		b = AppendReleases(b, 1, 2, 3)
		PutFrameHeader(b, FrameHeader{Type: FrameFetchReq, Flags: FlagWait, Credits: 2, Ref: 7, Releases: 3}, len(b)-FrameHeaderLen)
		h, body, rel, err := DecodeFrame(b)
		if err != nil || h.Ref != 7 || len(body) != 3 || rel.Len() != 3 || rel.At(2) != 3 {
			t.Fatal(h, body, rel, err)
		}
	})
	if allocs != 0 {
		t.Fatalf("encoding and decoding a frame allocates %.1f times", allocs)
	}
}

func FuzzDecodeFrame(f *testing.F) {
	for _, c := range validFrames() {
		b := frame(c.h, c.body, c.releases...)
		f.Add(b)
		// Broken ones: truncated, a byte more, a flipped bit in each
		// header field.
		f.Add(b[:len(b)-1])
		f.Add(append(bytes.Clone(b), 0))
		for _, off := range []int{0, 1, 2, 16, 20, 22} {
			bad := bytes.Clone(b)
			bad[off] ^= 0x04
			f.Add(bad)
		}
	}
	f.Add([]byte{})
	f.Add([]byte{FrameMagic})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, body, rel, err := DecodeFrame(b)
		if err != nil {
			if !errors.Is(err, ErrInvalidFrame) {
				t.Fatalf("error does not wrap ErrInvalidFrame: %v", err)
			}
			return
		}
		if FrameHeaderLen+len(body)+len(rel) != len(b) || rel.Len() != int(h.Releases) || len(rel) != 8*int(h.Releases) {
			t.Fatalf("header %+v, %d-byte body and %d bytes of releases from a %d-byte frame", h, len(body), len(rel), len(b))
		}
		// A frame that decodes re-encodes to identical bytes.
		out := make([]byte, FrameHeaderLen, len(b))
		out = append(out, body...)
		for i := range rel.Len() {
			out = AppendReleases(out, rel.At(i))
		}
		PutFrameHeader(out, h, len(out)-FrameHeaderLen)
		if !bytes.Equal(out, b) {
			t.Fatalf("re-encoded\n%x\nfrom\n%x", out, b)
		}
	})
}
