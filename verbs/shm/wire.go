package shm

import (
	"encoding/binary"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// msgType is the kind of a control message on a queue pair's socket.
type msgType uint8

const (
	// msgHello opens a data connection: seq is the acceptor's queue pair
	// id, secret[0] the acceptor's secret, secret[1] the dialer's; length
	// is the size of the dialer's staging buffer, whose fd rides along.
	msgHello msgType = iota + 1
	// msgWelcome accepts it: length is the size of the acceptor's staging
	// buffer, whose fd rides along.
	msgWelcome
	// msgSend: a chunk of a Send lies in the sender's staging buffer at
	// [0, length); it belongs at offset in a message of total bytes.
	msgSend
	// msgWriteImm: length bytes were written; consume a Recv with imm.
	msgWriteImm
	// msgAck answers msgSend and msgWriteImm with the same seq and a status.
	msgAck
	// msgMapRequest asks the peer for region key; seq is a request id.
	msgMapRequest
	// msgMapReply answers it: flagFound, addr, length, access, offset (the
	// offset in the fd); the region's fd rides along when found. The
	// answer for a grant is marked flagRegion: offset is then the grant's
	// offset in its region, total the region's exposure id (chosen by the
	// target, never reused on the queue pair), and the region's range of
	// its fd is in secret[0] (see regionRange); the fd rides along only
	// the first time the region is exposed, later grants of the region
	// name the exposure id alone.
	msgMapReply
	// msgUnmap tells the peer to drop its mapping of key; seq is a token.
	// With flagRegion it drops the exposed region total instead, and every
	// grant of it.
	msgUnmap
	// msgUnmapAck confirms msgUnmap with the same token.
	msgUnmapAck
	// msgWake, on the socket of a queue pair whose control messages go
	// through the shared ring, wakes the peer's receiver, which said it
	// was going to sleep (see ring_linux.go).
	msgWake
	// msgFD, on the socket of such a queue pair, carries the fd of the
	// ring record with the same seq, which is marked flagFD.
	msgFD
	// msgGrant announces a grant unasked, as soon as it is made, when its
	// region is already exposed to the peer: the fields of a msgMapReply
	// marked flagFound and flagRegion, never an fd, no seq. The peer
	// caches it as if it had asked, so the grant's first use needs no
	// msgMapRequest.
	msgGrant
	// msgCMA ends the handshake when both msgHello and msgWelcome are
	// marked flagCMA: the dialer tells the outcome of its probe of the
	// acceptor's memory, imm a cmaCode and key its errno (see
	// cma_linux.go).
	msgCMA
)

const (
	flagLast   = 1 << 0 // msgSend: the last chunk of the message
	flagHasImm = 1 << 1 // msgSend: the Send carries imm
	flagFound  = 1 << 2 // msgMapReply: the region exists
	flagFD     = 1 << 3 // a ring record: its fd follows on the socket in a msgFD
	flagRing   = 1 << 4 // msgHello, msgWelcome: control messages go through shared rings; the ring's memfd is the second fd
	flagRegion = 1 << 5 // msgMapReply, msgUnmap: a grant within an exposed region; the region
	// flagCMA on msgHello and msgWelcome: the sender takes part in
	// cross-memory attach; addr is its probe's address, and on msgWelcome
	// imm and key tell the outcome of the acceptor's probe of the dialer
	// (as msgCMA does). On msgMapReply and msgGrant (with flagFound, and
	// no fd): the key names memory without a memfd, which the peer copies
	// by cross-memory attach; offset is the virtual address of its first
	// byte in the announcer's process.
	flagCMA = 1 << 6
)

// message is every control message; each type uses the fields its comment
// above names. It travels as messageSize bytes in one SOCK_SEQPACKET record
// or one record of the peer's control ring.
type message struct {
	typ    msgType
	flags  uint8
	status verbs.Status
	imm    uint32
	key    uint32
	access verbs.Access
	seq    uint64
	addr   uint64
	offset uint64
	length uint64
	total  uint64
	secret [2][16]byte
}

const messageSize = 88

// setRegionRange puts a granted region's range of its fd, offset and
// length, in secret[0] of a msgMapReply marked flagRegion.
func (m *message) setRegionRange(offset, length uint64) {
	binary.LittleEndian.PutUint64(m.secret[0][0:], offset)
	binary.LittleEndian.PutUint64(m.secret[0][8:], length)
}

// regionRange reads what setRegionRange put; the receiver checks it.
func (m *message) regionRange() (offset, length uint64) {
	return binary.LittleEndian.Uint64(m.secret[0][0:]), binary.LittleEndian.Uint64(m.secret[0][8:])
}

func (m *message) encode(b *[messageSize]byte) {
	*b = [messageSize]byte{}
	b[0] = byte(m.typ)
	b[1] = m.flags
	b[2] = byte(m.status)
	le := binary.LittleEndian
	le.PutUint32(b[4:], m.imm)
	le.PutUint32(b[8:], m.key)
	le.PutUint32(b[12:], uint32(m.access))
	le.PutUint64(b[16:], m.seq)
	le.PutUint64(b[24:], m.addr)
	le.PutUint64(b[32:], m.offset)
	le.PutUint64(b[40:], m.length)
	le.PutUint64(b[48:], m.total)
	copy(b[56:72], m.secret[0][:])
	copy(b[72:88], m.secret[1][:])
}

// decodeMessage decodes a control message from the peer. It checks only the
// framing; each handler checks the fields it uses.
func decodeMessage(b []byte) (message, error) {
	var m message
	if len(b) != messageSize {
		return m, fmt.Errorf("shm: control message is %d bytes, want %d", len(b), messageSize)
	}
	m.typ = msgType(b[0])
	if m.typ < msgHello || m.typ > msgCMA {
		return m, fmt.Errorf("shm: unknown control message type %d", b[0])
	}
	if b[3] != 0 {
		return m, fmt.Errorf("shm: control message has reserved byte %#x", b[3])
	}
	m.flags = b[1]
	m.status = verbs.Status(b[2])
	le := binary.LittleEndian
	m.imm = le.Uint32(b[4:])
	m.key = le.Uint32(b[8:])
	m.access = verbs.Access(le.Uint32(b[12:]))
	m.seq = le.Uint64(b[16:])
	m.addr = le.Uint64(b[24:])
	m.offset = le.Uint64(b[32:])
	m.length = le.Uint64(b[40:])
	m.total = le.Uint64(b[48:])
	copy(m.secret[0][:], b[56:72])
	copy(m.secret[1][:], b[72:88])
	return m, nil
}

// peekFlags is the flags byte of an encoded message, read without decoding
// it.
func peekFlags(b []byte) uint8 { return b[1] }
