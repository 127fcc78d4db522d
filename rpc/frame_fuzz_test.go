package rpc

import (
	"bytes"
	"encoding/binary"
	"testing"

	"google.golang.org/grpc/codes"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func hdr(typ uint8, flags uint16, credits uint32, ref uint64, n int, payload []byte) []byte {
	b := make([]byte, frameHeaderLen, frameHeaderLen+len(payload))
	putFrameHeader(b, frameHeader{typ: typ, flags: flags, credits: credits, ref: ref}, n)
	return append(b, payload...)
}

func FuzzDecodeFrame(f *testing.F) {
	resp, _ := appendFetchResp(nil, 0, "", &pb.FetchResponse{Meta: &pb.TensorMeta{Key: "k", Dtype: pb.DType(zerocopy.Float32), Shape: []int64{2}, ByteLength: 8}, InlineData: make([]byte, 8)})
	errResp, _ := appendFetchResp(nil, uint32(codes.NotFound), "no such key", nil)
	f.Add(hdr(frameFetchReq, frameWait|frameLease, 3, 42, 3, []byte("key")))
	f.Add(hdr(frameFetchResp, 0, 1, 42, len(resp), resp))
	f.Add(hdr(frameFetchResp, 0, 0, 7, len(errResp), errResp))
	f.Add(hdr(frameFetchResp, frameFallback, 0, 7, 8, make([]byte, 8)))
	f.Add(hdr(frameCredit, 0, 16, 0, 0, nil))
	f.Add(hdr(frameFetchReq, 0, 0, 1, 1000, nil))
	f.Add([]byte{frameMagic})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, p, err := decodeFrame(b)
		if err != nil {
			return
		}
		if len(p) != len(b)-frameHeaderLen || int(binary.LittleEndian.Uint32(b[16:])) != len(p) {
			t.Fatalf("payload of %d bytes from a frame of %d", len(p), len(b))
		}
		again := hdr(h.typ, h.flags, h.credits, h.ref, len(p), p)
		if !bytes.Equal(again, b) {
			t.Fatalf("header does not round-trip")
		}
		if h.typ == frameFetchResp {
			decodeFetchResp(p) // must not panic
		}
	})
}
