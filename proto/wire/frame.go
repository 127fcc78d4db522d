package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/tensorrpc/tensorrpc/proto/wirefb"
)

// Frames are the session engine's calls on the data plane: a 24-byte
// FrameHeader (struct FrameHeader of proto/header.fbs, which defines the
// format), a body, then 8*Releases bytes of piggybacked transfer ids.
const (
	FrameHeaderLen = 24   // bytes of wirefb.FrameHeader
	FrameMagic     = 0xF1 // FrameHeader.magic: this format and version
)

// Frame types, FrameHeader.Type.
const (
	FrameFetchReq  uint8 = 1
	FrameFetchResp uint8 = 2
	FrameCredit    uint8 = 3
	FrameSendReq   uint8 = 4
	FrameSendResp  uint8 = 5
	FrameCallReq   uint8 = 6
	FrameCallResp  uint8 = 7
	FrameRelease   uint8 = 8
)

// Flags, FrameHeader.Flags; their meaning depends on the type.
const (
	FlagWait  uint16 = 1 << 0 // FETCH_REQ: wait for an unpublished key
	FlagLease uint16 = 1 << 1 // FETCH_REQ: lease (shm mapping)
	// FlagIndirect: the body, too large for a receive slot, is elsewhere:
	// on a request, the body is a TensorMeta naming the client's grant of
	// the bytes the body would have been; on a response, a status and a
	// TensorMeta naming a transfer whose bytes are the response's protobuf.
	FlagIndirect uint16 = 1 << 2
	// FlagHeaders (FETCH_REQ, SEND_REQ, CALL_REQ): the frame's body starts
	// with a u32 length and a protobuf CallHeaders (the caller's metadata
	// and deadline); the type's body (or, with FlagIndirect, the
	// TensorMeta naming it) follows.
	FlagHeaders uint16 = 1 << 3
	// FlagRows (FETCH_REQ): the body is a protobuf FetchRequest (the key
	// and the rows asked for) instead of the raw key.
	FlagRows uint16 = 1 << 4
	// FlagLanding (FETCH_REQ): the body is a protobuf FetchRequest (the
	// key, and a landing the server may Write the tensor into before it
	// answers, see FetchRequest.landing); only on a session whose
	// HandshakeResponse.fetch_landing is not 0.
	FlagLanding uint16 = 1 << 5
)

// ErrInvalidFrame wraps every frame decoding error.
var ErrInvalidFrame = errors.New("wire: invalid frame")

// frameFlags are the flags each type allows; index 0 and the types past
// FrameRelease are unknown.
var frameFlags = [...]uint16{
	FrameFetchReq:  FlagWait | FlagLease | FlagIndirect | FlagHeaders | FlagRows | FlagLanding,
	FrameFetchResp: FlagIndirect,
	FrameSendReq:   FlagIndirect | FlagHeaders,
	FrameCallReq:   FlagIndirect | FlagHeaders,
	FrameCallResp:  FlagIndirect,
	FrameRelease:   0,
}

var frameNames = [...]string{
	FrameFetchReq:  "FETCH_REQ",
	FrameFetchResp: "FETCH_RESP",
	FrameCredit:    "CREDIT",
	FrameSendReq:   "SEND_REQ",
	FrameSendResp:  "SEND_RESP",
	FrameCallReq:   "CALL_REQ",
	FrameCallResp:  "CALL_RESP",
	FrameRelease:   "RELEASE",
}

// FrameHeader is a decoded frame header. The magic, length and reserved
// fields of the wire header are not here: PutFrameHeader derives them and
// DecodeFrame checks them.
type FrameHeader struct {
	Type     uint8
	Flags    uint16
	Credits  uint32 // receive slots the sender reposted since its last frame
	Ref      uint64 // the client's name for the call; 0 for CREDIT and RELEASE
	Releases uint16 // u64 transfer ids at the end of the frame
}

// PutFrameHeader writes h into b[:FrameHeaderLen] for payloadLen bytes
// after the header: the body and the 8*h.Releases bytes of releases. It
// does not check h (DecodeFrame does); it panics when b is shorter than a
// header or payloadLen does not fit the u32 length.
func PutFrameHeader(b []byte, h FrameHeader, payloadLen int) {
	if payloadLen < 0 || uint64(payloadLen) > math.MaxUint32 {
		panic("wire: frame payload length out of range")
	}
	b = b[:FrameHeaderLen]
	b[0] = FrameMagic
	b[1] = h.Type
	binary.LittleEndian.PutUint16(b[2:], h.Flags)
	binary.LittleEndian.PutUint32(b[4:], h.Credits)
	binary.LittleEndian.PutUint64(b[8:], h.Ref)
	binary.LittleEndian.PutUint32(b[16:], uint32(payloadLen))
	binary.LittleEndian.PutUint16(b[20:], h.Releases)
	binary.LittleEndian.PutUint16(b[22:], 0)
}

// DecodeFrame checks and decodes one received frame, b being exactly the
// bytes the Send carried. body and releases alias b. It allocates nothing
// unless it fails; every error wraps ErrInvalidFrame.
func DecodeFrame(b []byte) (h FrameHeader, body []byte, releases Releases, err error) {
	if len(b) < FrameHeaderLen {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: %d bytes, shorter than a header", ErrInvalidFrame, len(b))
	}
	var fh wirefb.FrameHeader
	fh.Init(b, 0)
	if m := fh.Magic(); m != FrameMagic {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: magic %#x", ErrInvalidFrame, m)
	}
	h = FrameHeader{Type: fh.Type(), Flags: fh.Flags(), Credits: fh.Credits(), Ref: fh.Ref(), Releases: fh.Releases()}
	n := fh.Length()
	if uint64(n) != uint64(len(b)-FrameHeaderLen) {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: length %d, frame carries %d", ErrInvalidFrame, n, len(b)-FrameHeaderLen)
	}
	if r := fh.Reserved(); r != 0 {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: reserved %#x", ErrInvalidFrame, r)
	}
	if h.Type == 0 || int(h.Type) >= len(frameNames) {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: unknown type %d", ErrInvalidFrame, h.Type)
	}
	if extra := h.Flags &^ frameFlags[h.Type]; extra != 0 {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: %s with flags %#x", ErrInvalidFrame, frameNames[h.Type], h.Flags)
	}
	rel := 8 * int(h.Releases)
	if rel > int(n) {
		return FrameHeader{}, nil, nil, fmt.Errorf("%w: %d releases in %d bytes", ErrInvalidFrame, h.Releases, n)
	}
	body, releases = b[FrameHeaderLen:len(b)-rel], Releases(b[len(b)-rel:])
	switch h.Type {
	case FrameCredit:
		if h.Ref != 0 || n != 0 {
			return FrameHeader{}, nil, nil, fmt.Errorf("%w: CREDIT with a ref or %d bytes", ErrInvalidFrame, n)
		}
	case FrameRelease:
		if h.Ref != 0 || len(body)%8 != 0 {
			return FrameHeader{}, nil, nil, fmt.Errorf("%w: RELEASE with a ref or a %d-byte body", ErrInvalidFrame, len(body))
		}
	default: // requests and responses
		if h.Ref == 0 {
			return FrameHeader{}, nil, nil, fmt.Errorf("%w: %s without a ref", ErrInvalidFrame, frameNames[h.Type])
		}
	}
	return h, body, releases, nil
}

// Releases are the transfer ids at the end of a frame, or a RELEASE body's
// client refs: little-endian u64s.
type Releases []byte

// Len returns the number of ids.
func (r Releases) Len() int { return len(r) / 8 }

// At returns id i, 0 <= i < r.Len().
func (r Releases) At(i int) uint64 { return binary.LittleEndian.Uint64(r[8*i:]) }

// AppendReleases appends ids to b as little-endian u64s: a frame's
// releases, or a RELEASE body.
func AppendReleases(b []byte, ids ...uint64) []byte {
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint64(b, id)
	}
	return b
}
