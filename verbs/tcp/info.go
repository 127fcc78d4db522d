package tcp

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strconv"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// infoVersion is the first byte of LocalInfo. Version 2 added the role.
const infoVersion = 2

// secretSize is the size of a queue pair's one-time secret.
const secretSize = softrc.SecretSize

type secret = softrc.Secret

// info is a queue pair's connection information. Its encoding is
//
//	version (1) | role (1) | secret (16) | queue pair id (8, little endian) |
//	address length (1) | address ("host:port", address length bytes)
//
// The role is a verbs.ConnectRole. A RoleDial queue pair listens for
// nothing: its address is empty, and only its address may be.
type info struct {
	role   verbs.ConnectRole
	secret secret
	qpID   uint64
	addr   string
}

const infoFixed = 1 + 1 + secretSize + 8 + 1

func (in *info) encode() []byte {
	b := make([]byte, 0, infoFixed+len(in.addr))
	b = append(b, infoVersion, byte(in.role))
	b = append(b, in.secret[:]...)
	b = binary.LittleEndian.AppendUint64(b, in.qpID)
	b = append(b, byte(len(in.addr)))
	return append(b, in.addr...)
}

// parseInfo decodes connection information from a peer. Every failure wraps
// verbs.ErrInvalidInfo.
func parseInfo(b []byte) (info, error) {
	var in info
	if len(b) < infoFixed {
		return in, fmt.Errorf("tcp: connection info of %d bytes is shorter than %d: %w", len(b), infoFixed, verbs.ErrInvalidInfo)
	}
	if b[0] != infoVersion {
		return in, fmt.Errorf("tcp: connection info version %d, want %d: %w", b[0], infoVersion, verbs.ErrInvalidInfo)
	}
	in.role = verbs.ConnectRole(b[1])
	switch in.role {
	case verbs.RoleAny, verbs.RoleDial, verbs.RoleAccept:
	default:
		return in, fmt.Errorf("tcp: connection info has an unknown role %d: %w", b[1], verbs.ErrInvalidInfo)
	}
	copy(in.secret[:], b[2:])
	in.qpID = binary.LittleEndian.Uint64(b[2+secretSize:])
	n := int(b[infoFixed-1])
	if len(b) != infoFixed+n {
		return in, fmt.Errorf("tcp: connection info of %d bytes, its address length says %d: %w", len(b), infoFixed+n, verbs.ErrInvalidInfo)
	}
	in.addr = string(b[infoFixed:])
	if in.secret == (secret{}) {
		return in, fmt.Errorf("tcp: connection info has an all-zero secret: %w", verbs.ErrInvalidInfo)
	}
	if in.role == verbs.RoleDial {
		if in.addr != "" {
			return in, fmt.Errorf("tcp: connection info of a dialing queue pair carries an address %q: %w", in.addr, verbs.ErrInvalidInfo)
		}
		return in, nil
	}
	if in.addr == "" {
		return in, fmt.Errorf("tcp: connection info of a %s queue pair has no address: %w", in.role, verbs.ErrInvalidInfo)
	}
	host, port, err := net.SplitHostPort(in.addr)
	if err != nil {
		return in, fmt.Errorf("tcp: connection info address %q: %v: %w", in.addr, err, verbs.ErrInvalidInfo)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 || host == "" {
		return in, fmt.Errorf("tcp: connection info address %q has no usable host and port: %w", in.addr, verbs.ErrInvalidInfo)
	}
	return in, nil
}

// The handshake. The dialing side sends
//
//	handshakeMagic (8) | secret issued by the acceptor (16) |
//	the dialer's own secret (16) | the acceptor's queue pair id (8)
//
// and the accepting side answers handshakeMagic followed by one status
// byte: handshakeOK or handshakeRefused.
var handshakeMagic = [8]byte{'t', 'r', 'p', 'c', 't', 'c', 'p', 1}

const (
	helloSize        = 8 + 2*secretSize + 8
	replySize        = 8 + 1
	handshakeOK      = 0
	handshakeRefused = 1
)

// hello is the dialer's first message.
type hello struct {
	acceptor secret // the secret the accepting queue pair issued
	dialer   secret // the dialing queue pair's own secret
	qpID     uint64 // the accepting queue pair's id
}

func (h *hello) encode() []byte {
	b := make([]byte, 0, helloSize)
	b = append(b, handshakeMagic[:]...)
	b = append(b, h.acceptor[:]...)
	b = append(b, h.dialer[:]...)
	return binary.LittleEndian.AppendUint64(b, h.qpID)
}

func readHello(r io.Reader) (hello, error) {
	var b [helloSize]byte
	var h hello
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return h, fmt.Errorf("tcp: reading the handshake: %w", err)
	}
	if !bytes.Equal(b[:8], handshakeMagic[:]) {
		return h, fmt.Errorf("tcp: handshake has a bad magic %x", b[:8])
	}
	copy(h.acceptor[:], b[8:])
	copy(h.dialer[:], b[8+secretSize:])
	h.qpID = binary.LittleEndian.Uint64(b[8+2*secretSize:])
	return h, nil
}

func replyBytes(status byte) []byte {
	return append(handshakeMagic[:len(handshakeMagic):len(handshakeMagic)], status)
}

func readReply(r io.Reader) (byte, error) {
	var b [replySize]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, fmt.Errorf("tcp: reading the handshake reply: %w", err)
	}
	if !bytes.Equal(b[:8], handshakeMagic[:]) {
		return 0, fmt.Errorf("tcp: handshake reply has a bad magic %x", b[:8])
	}
	return b[8], nil
}
