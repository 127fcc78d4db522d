package engine

import (
	"bytes"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// hdr is a frame: its header, for n bytes after it, then payload.
func hdr(typ uint8, flags uint16, credits uint32, ref uint64, n int, payload []byte) []byte {
	b := make([]byte, wire.FrameHeaderLen, wire.FrameHeaderLen+len(payload))
	PutFrameHeader(b, wire.FrameHeader{Type: typ, Flags: flags, Credits: credits, Ref: ref}, n)
	return append(b, payload...)
}

// okBody is a response body with an OK status and m.
func okBody(m proto.Message) []byte {
	b := AppendStatus(nil, nil, 1<<20)
	enc, _ := proto.Marshal(m)
	return append(b, enc...)
}

// FuzzDecodeFrame: whatever a peer sends, decoding a frame and its
// response status never panics, and a decoded frame re-encodes to the
// same bytes.
func FuzzDecodeFrame(f *testing.F) {
	resp := okBody(&pb.FetchResponse{Meta: &pb.TensorMeta{Key: "k", Dtype: pb.DType(zerocopy.Float32), Shape: []int64{2}, ByteLength: 8}, InlineData: make([]byte, 8)})
	errResp := AppendStatus(nil, status.Error(codes.NotFound, "no such key"), 1<<20)
	f.Add(hdr(wire.FrameFetchReq, wire.FlagWait|wire.FlagLease, 3, 42, 3, []byte("key")))
	f.Add(hdr(wire.FrameFetchResp, 0, 1, 42, len(resp), resp))
	f.Add(hdr(wire.FrameFetchResp, 0, 0, 7, len(errResp), errResp))
	f.Add(hdr(wire.FrameFetchResp, wire.FlagIndirect, 0, 7, len(resp), resp))
	f.Add(hdr(wire.FrameSendReq, wire.FlagIndirect, 0, 7, len(resp)-4, resp[4:]))
	f.Add(hdr(wire.FrameCallResp, wire.FlagIndirect, 0, 7, len(resp), resp))
	f.Add(hdr(wire.FrameCredit, 0, 16, 0, 0, nil))
	f.Add(hdr(wire.FrameRelease, 0, 0, 0, 8, make([]byte, 8)))
	rel := hdr(wire.FrameSendReq, 0, 0, 9, 16+3, []byte("abc"))
	rel[20] = 2
	f.Add(append(rel, make([]byte, 16)...))
	f.Add(hdr(wire.FrameFetchReq, 0, 0, 1, 1000, nil))
	f.Add([]byte{wire.FrameMagic})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, body, releases, err := DecodeFrame(b)
		if err != nil {
			if !errors.Is(err, wire.ErrInvalidFrame) {
				t.Fatalf("error %v does not wrap errFrame", err)
			}
			return
		}
		if len(body)+len(releases) != len(b)-wire.FrameHeaderLen || len(releases) != 8*int(h.Releases) {
			t.Fatalf("body of %d and releases of %d bytes from a frame of %d", len(body), len(releases), len(b))
		}
		again := make([]byte, wire.FrameHeaderLen, len(b))
		PutFrameHeader(again, h, len(body)+len(releases))
		again = append(append(again, body...), releases...)
		if !bytes.Equal(again, b) {
			t.Fatalf("frame does not round-trip")
		}
		if h.Type == wire.FrameFetchResp || h.Type == wire.FrameSendResp || h.Type == wire.FrameCallResp {
			st, rest, err := DecodeStatus(body) // must not panic
			if err == nil && st != nil && len(rest) != 0 {
				t.Fatalf("an error status with a body")
			}
		}
	})
}
