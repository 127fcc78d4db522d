package engine

import (
	"encoding/binary"
	"fmt"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/proto/wire"
)

// Frames are the session engine's calls on the data plane: every session
// open on a data plane carries its Fetch, Send and Call as frames, each one
// Send into one of the peer's receive slots. proto/header.fbs specifies them (FrameHeader and
// the comment above it: types, bodies, credits, what a receiver rejects)
// and proto/wire decodes the header. A frame is the 24-byte header, a body
// and then, on frames from the client, releases: transfer ids the client
// is done with, piggybacked on whatever frame goes out next.
//
// Bodies are protobuf messages of tensorrpc.proto, after a status (u32
// length and a google.rpc.Status, empty for OK) on responses:
//
//   - FETCH_REQ: the key; flags frameWait and frameLease.
//   - FETCH_RESP: status, then on OK a FetchResponse.
//   - SEND_REQ: a SendRequest: the tensor inline, or with meta.location
//     naming the client's tensor, which the client granted the server to
//     read; the server reads it, publishes it and then answers.
//   - SEND_RESP: status.
//   - CALL_REQ: a CallRequest: tensors inline or, like SEND_REQ's, by
//     location in the client's memory.
//   - CALL_RESP: status, then on OK a CallResponse.
//   - CREDIT: empty; it only returns credits.
//   - RELEASE: client refs to cancel, 8 bytes each (perhaps none: then it
//     only carries releases).
//
// A body too large for a slot goes indirect (frameIndirect), whatever the
// request or answer: a request's body is then a TensorMeta naming a grant
// of the client's pool buffer that holds the body (the key, for a
// FETCH_REQ), which the server pulls before it serves the request as any
// other; an answer's is a status and a TensorMeta naming a transfer whose
// bytes are the answer's protobuf, which the client reads and releases.
// So every call on a data-plane session is frames, whatever its size.
//
// Every request frame gets exactly one response frame with its ref, also
// when it fails or is cancelled (unless the session ends first): the
// client keeps what it granted for a request until the response arrives or
// the session ends.
const (
	frameMagic     = wire.FrameMagic
	frameHeaderLen = wire.FrameHeaderLen

	frameFetchReq  = wire.FrameFetchReq
	frameFetchResp = wire.FrameFetchResp
	frameCredit    = wire.FrameCredit
	frameSendReq   = wire.FrameSendReq
	frameSendResp  = wire.FrameSendResp
	frameCallReq   = wire.FrameCallReq
	frameCallResp  = wire.FrameCallResp
	frameRelease   = wire.FrameRelease

	frameWait     = wire.FlagWait     // FETCH_REQ: WaitForKey
	frameLease    = wire.FlagLease    // FETCH_REQ: Lease
	frameIndirect = wire.FlagIndirect // the body names where the body is
	frameHeaders  = wire.FlagHeaders  // requests: the body starts with CallHeaders (metadata, deadline)

	// MaxReleases bounds the releases one frame carries.
	MaxReleases = 64
)

// frameHeader is a decoded header.
type frameHeader = wire.FrameHeader

// errFrame wraps every error of a frame the peer got wrong.
var errFrame = wire.ErrInvalidFrame

// PutFrameHeader writes h for n bytes after the header (releases
// included) into b[:frameHeaderLen].
func PutFrameHeader(b []byte, h frameHeader, n int) { wire.PutFrameHeader(b, h, n) }

// DecodeFrame checks and decodes one received frame, b being exactly the
// bytes the Send carried. The body and releases alias b.
func DecodeFrame(b []byte) (frameHeader, []byte, []byte, error) {
	h, body, releases, err := wire.DecodeFrame(b)
	return h, body, releases, err
}

// AppendStatus appends err as a frame's status: u32 length and a
// google.rpc.Status (details included), at most room bytes in all. A
// status too large loses its details, then the end of its message.
func AppendStatus(b []byte, err error, room int) []byte {
	if err == nil {
		return binary.LittleEndian.AppendUint32(b, 0)
	}
	sp := status.Convert(err).Proto()
	if sp.Code == 0 {
		sp.Code = int32(codes.Unknown) // an error is never OK
	}
	enc, _ := proto.Marshal(sp)
	if len(enc)+4 > room {
		sp.Details = nil
		if over := len(enc) + 4 - room; over > 0 && over < len(sp.Message) {
			sp.Message = sp.Message[:len(sp.Message)-over]
		} else if over > 0 {
			sp.Message = ""
		}
		enc, _ = proto.Marshal(sp)
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(enc)))
	return append(b, enc...)
}

// DecodeStatus splits a response body into its status (nil for OK) and
// what follows.
func DecodeStatus(p []byte) (error, []byte, error) {
	if len(p) < 4 {
		return nil, nil, fmt.Errorf("%w: response of %d bytes", errFrame, len(p))
	}
	n := binary.LittleEndian.Uint32(p)
	p = p[4:]
	if uint64(n) > uint64(len(p)) {
		return nil, nil, fmt.Errorf("%w: status of %d bytes in %d", errFrame, n, len(p))
	}
	if n == 0 {
		return nil, p, nil
	}
	sp := &spb.Status{}
	if err := proto.Unmarshal(p[:n], sp); err != nil {
		return nil, nil, fmt.Errorf("%w: status: %v", errFrame, err)
	}
	if sp.Code == 0 || len(p) != int(n) {
		return nil, nil, fmt.Errorf("%w: an error status of code %d with a body", errFrame, sp.Code)
	}
	return status.FromProto(sp).Err(), nil, nil
}

// AppendReleases appends transfer ids to a frame.
func AppendReleases(b []byte, ids []uint64) []byte {
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint64(b, id)
	}
	return b
}

// ReadU64s decodes a list of u64s (releases, a RELEASE body).
func ReadU64s(b []byte) []uint64 {
	out := make([]uint64, 0, len(b)/8)
	for ; len(b) >= 8; b = b[8:] {
		out = append(out, binary.LittleEndian.Uint64(b))
	}
	return out
}
