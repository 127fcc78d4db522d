package tcp

import (
	"encoding/binary"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// A frame is a fixed header, in little endian, optionally followed by a
// payload of header.length bytes:
//
//	offset size field
//	0      1    opcode
//	1      1    status (acknowledgements only): a verbs.Status, nonzero
//	            fails request seq (see softrc.Refused)
//	2      1    flags (flagImm: the imm field is valid; flagLazyAck:
//	            the request's acknowledgement may wait, see queueAck;
//	            flagNoAck: the request is not acknowledged at all, its
//	            sender completed it as it wrote it (see earlyLocked),
//	            though a refusal is still reported; since wire version
//	            2, see handshakeMagic;
//	            flagCompress: on a Read request, the data may come
//	            compressed, imm says how (compressImm); on a Read
//	            response, it did: the payload is an internal/zchunk
//	            stream of length raw bytes. The answer to a Read that
//	            asked, compressed or not, says in imm the codec and the
//	            ratio auto's sample showed (answerImm))
//	3      1    reserved, zero
//	4      4    remote key
//	8      4    immediate value
//	12     8    sequence number of the request
//	20     8    remote address
//	28     8    length
const headerSize = 36

// Frame opcodes.
const (
	frameWrite    = 1 // request: write payload at (key, addr)
	frameWriteImm = 2 // request: write payload, then consume a receive
	frameSend     = 3 // request: payload lands in the next receive
	frameReadReq  = 4 // request: send back length bytes at (key, addr)
	frameReadResp = 5 // response: payload is the data a read asked for
	frameAck      = 6 // response: requests up to seq done; status != 0 fails seq
)

// requestOps are the requests that request frames carry.
var requestOps = [...]verbs.Opcode{frameWrite: verbs.OpWrite, frameWriteImm: verbs.OpWriteImm, frameSend: verbs.OpSend, frameReadReq: verbs.OpRead}

const (
	flagImm      = 1
	flagLazyAck  = 2
	flagCompress = 4
	flagNoAck    = 8
)

// compressImm is a Read request's imm with flagCompress: the codec asked
// for in the top 8 bits, the requester's goodput estimate in KB/s in the
// low 24 (clamped).
func compressImm(c verbs.Compression) uint32 {
	kbs := uint64(c.Goodput / 1e3)
	return uint32(c.Codec)<<24 | uint32(min(kbs, 1<<24-1))
}

// compressionOf decodes compressImm.
func compressionOf(imm uint32) verbs.Compression {
	return verbs.Compression{Codec: verbs.Codec(imm >> 24), Goodput: float64(imm&(1<<24-1)) * 1e3}
}

// maxFrameLength bounds the length field so that lengths convert to int
// without overflow on 64-bit platforms.
const maxFrameLength = 1 << 62

// header is a decoded frame header.
type header struct {
	op     uint8
	status uint8
	flags  uint8
	key    uint32
	imm    uint32
	seq    uint64
	addr   uint64
	length uint64
}

func (h *header) put(b []byte) {
	_ = b[headerSize-1]
	b[0], b[1], b[2], b[3] = h.op, h.status, h.flags, 0
	binary.LittleEndian.PutUint32(b[4:], h.key)
	binary.LittleEndian.PutUint32(b[8:], h.imm)
	binary.LittleEndian.PutUint64(b[12:], h.seq)
	binary.LittleEndian.PutUint64(b[20:], h.addr)
	binary.LittleEndian.PutUint64(b[28:], h.length)
}

// parseHeader decodes and checks a header from the wire.
func parseHeader(b []byte) (header, error) {
	if len(b) < headerSize {
		return header{}, fmt.Errorf("tcp: short frame header of %d bytes", len(b))
	}
	h := header{
		op:     b[0],
		status: b[1],
		flags:  b[2],
		key:    binary.LittleEndian.Uint32(b[4:]),
		imm:    binary.LittleEndian.Uint32(b[8:]),
		seq:    binary.LittleEndian.Uint64(b[12:]),
		addr:   binary.LittleEndian.Uint64(b[20:]),
		length: binary.LittleEndian.Uint64(b[28:]),
	}
	if h.op < frameWrite || h.op > frameAck {
		return h, fmt.Errorf("tcp: unknown frame opcode %d", h.op)
	}
	if b[3] != 0 || h.flags&^(flagImm|flagLazyAck|flagCompress|flagNoAck) != 0 {
		return h, fmt.Errorf("tcp: frame %d has reserved bits set", h.op)
	}
	if h.flags&flagNoAck != 0 && (h.op == frameReadReq || h.op == frameReadResp || h.op == frameAck) {
		return h, fmt.Errorf("tcp: frame %d has the no-acknowledgement flag", h.op)
	}
	if h.flags&flagCompress != 0 && h.op != frameReadReq && h.op != frameReadResp {
		return h, fmt.Errorf("tcp: frame %d has the compression flag", h.op)
	}
	if h.length > maxFrameLength {
		return h, fmt.Errorf("tcp: frame length %d too large", h.length)
	}
	if h.op == frameAck && h.length != 0 {
		return h, fmt.Errorf("tcp: acknowledgement carries %d bytes", h.length)
	}
	if h.op != frameAck && h.status != 0 {
		return h, fmt.Errorf("tcp: frame %d carries status %d", h.op, h.status)
	}
	return h, nil
}

// hasPayload reports whether length payload bytes follow the header.
func (h *header) hasPayload() bool {
	switch h.op {
	case frameWrite, frameWriteImm, frameSend, frameReadResp:
		return true
	}
	return false
}
