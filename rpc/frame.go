package rpc

import (
	"encoding/binary"
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// Frames are the session engine's control messages on the data plane
// (negotiated with HandshakeRequest.data_plane_calls): each is one Send
// into one of the peer's receive slots. A frame is a fixed little-endian
// header followed by its payload:
//
//	offset size
//	0      1    magic and version (frameMagic)
//	1      1    type (frameFetchReq, frameFetchResp, frameCredit)
//	2      2    flags (by type)
//	4      4    credits: receive slots the sender reposted since its last frame
//	8      8    ref: the client's name for the call
//	16     4    payload length: exactly the bytes that follow the header
//	20     4    zero
//
// Payloads:
//
//   - FETCH_REQ: the key; flags frameWait and frameLease.
//   - FETCH_RESP: u32 status code (gRPC's; 0 is OK), u32 message length,
//     the message, then on OK a protobuf FetchResponse (meta, inline data
//     or a Location, transfer id). Flag frameFallback instead says that the
//     answer does not fit a slot: the client asks with the Fetch method.
//   - CREDIT: empty; it only returns credits.
//
// This is a hand-written header, not proto/header.fbs: this first slice of
// the engine has three frame types; decodeFrame checks every bound.
const (
	frameMagic     = 0xF1
	frameHeaderLen = 24

	frameFetchReq  = 1
	frameFetchResp = 2
	frameCredit    = 3

	frameWait     = 1 << 0 // FETCH_REQ: WaitForKey
	frameLease    = 1 << 1 // FETCH_REQ: Lease
	frameFallback = 1 << 0 // FETCH_RESP: ask again with the Fetch method
)

// frameHeader is a decoded header.
type frameHeader struct {
	typ     uint8
	flags   uint16
	credits uint32
	ref     uint64
}

var errFrame = errors.New("tensorrpc: malformed frame")

// putFrameHeader writes h for a payload of n bytes into b[:frameHeaderLen].
func putFrameHeader(b []byte, h frameHeader, n int) {
	b[0] = frameMagic
	b[1] = h.typ
	binary.LittleEndian.PutUint16(b[2:], h.flags)
	binary.LittleEndian.PutUint32(b[4:], h.credits)
	binary.LittleEndian.PutUint64(b[8:], h.ref)
	binary.LittleEndian.PutUint32(b[16:], uint32(n))
	binary.LittleEndian.PutUint32(b[20:], 0)
}

// decodeFrame checks and decodes one received frame, b being exactly the
// bytes the Send carried. The payload aliases b.
func decodeFrame(b []byte) (frameHeader, []byte, error) {
	if len(b) < frameHeaderLen {
		return frameHeader{}, nil, fmt.Errorf("%w: %d bytes, shorter than a header", errFrame, len(b))
	}
	if b[0] != frameMagic {
		return frameHeader{}, nil, fmt.Errorf("%w: magic %#x", errFrame, b[0])
	}
	h := frameHeader{typ: b[1], flags: binary.LittleEndian.Uint16(b[2:]), credits: binary.LittleEndian.Uint32(b[4:]), ref: binary.LittleEndian.Uint64(b[8:])}
	n := binary.LittleEndian.Uint32(b[16:])
	if uint64(n) != uint64(len(b)-frameHeaderLen) {
		return frameHeader{}, nil, fmt.Errorf("%w: payload length %d, frame carries %d", errFrame, n, len(b)-frameHeaderLen)
	}
	if binary.LittleEndian.Uint32(b[20:]) != 0 {
		return frameHeader{}, nil, fmt.Errorf("%w: reserved bytes set", errFrame)
	}
	switch h.typ {
	case frameFetchReq:
		if h.flags&^(frameWait|frameLease) != 0 {
			return frameHeader{}, nil, fmt.Errorf("%w: FETCH_REQ flags %#x", errFrame, h.flags)
		}
	case frameFetchResp:
		if h.flags&^frameFallback != 0 {
			return frameHeader{}, nil, fmt.Errorf("%w: FETCH_RESP flags %#x", errFrame, h.flags)
		}
	case frameCredit:
		if h.flags != 0 || n != 0 || h.ref != 0 {
			return frameHeader{}, nil, fmt.Errorf("%w: CREDIT with flags, ref or payload", errFrame)
		}
	default:
		return frameHeader{}, nil, fmt.Errorf("%w: unknown type %d", errFrame, h.typ)
	}
	return h, b[frameHeaderLen:], nil
}

// fetchResult is a decoded FETCH_RESP payload.
type fetchResult struct {
	code     uint32
	msg      string
	resp     *pb.FetchResponse
	fallback bool
	err      error // the session or plane failed
}

// appendFetchResp encodes a FETCH_RESP payload after b.
func appendFetchResp(b []byte, code uint32, msg string, resp *pb.FetchResponse) ([]byte, error) {
	b = binary.LittleEndian.AppendUint32(b, code)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(msg)))
	b = append(b, msg...)
	if resp != nil {
		return proto.MarshalOptions{}.MarshalAppend(b, resp)
	}
	return b, nil
}

// decodeFetchResp decodes a FETCH_RESP payload; its bytes are copied.
func decodeFetchResp(p []byte) (fetchResult, error) {
	if len(p) < 8 {
		return fetchResult{}, fmt.Errorf("%w: FETCH_RESP of %d bytes", errFrame, len(p))
	}
	r := fetchResult{code: binary.LittleEndian.Uint32(p)}
	n := binary.LittleEndian.Uint32(p[4:])
	p = p[8:]
	if uint64(n) > uint64(len(p)) {
		return fetchResult{}, fmt.Errorf("%w: FETCH_RESP message of %d bytes in %d", errFrame, n, len(p))
	}
	r.msg, p = string(p[:n]), p[n:]
	if r.code == 0 {
		r.resp = &pb.FetchResponse{}
		if err := proto.Unmarshal(p, r.resp); err != nil {
			return fetchResult{}, fmt.Errorf("%w: FETCH_RESP body: %v", errFrame, err)
		}
	} else if len(p) != 0 {
		return fetchResult{}, fmt.Errorf("%w: FETCH_RESP error with a body", errFrame)
	}
	return r, nil
}
