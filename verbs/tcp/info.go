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

// infoMagic begins tcp's connection info (see softrc.Info).
const infoMagic = "TRTC"

// secretSize is the size of a queue pair's one-time secret.
const secretSize = softrc.SecretSize

type secret = softrc.Secret

// parseInfo decodes the connection info of a peer (see softrc.Info). A
// RoleDial queue pair listens for nothing: its address is empty, and only
// its address may be; any other's is "host:port". Every failure wraps
// verbs.ErrInvalidInfo.
func parseInfo(b []byte) (softrc.Info, error) {
	return softrc.ParseInfo(Name, infoMagic, b, func(in *softrc.Info) error {
		if in.Role == verbs.RoleDial {
			if in.Addr != "" {
				return fmt.Errorf("a dialing queue pair's info carries an address %q", in.Addr)
			}
			return nil
		}
		host, port, err := net.SplitHostPort(in.Addr)
		if err != nil {
			return fmt.Errorf("a %s queue pair's address %q: %v", in.Role, in.Addr, err)
		}
		if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 || host == "" {
			return fmt.Errorf("address %q has no usable host and port", in.Addr)
		}
		return nil
	})
}

// The handshake. The dialing side sends
//
//	handshakeMagic (8) | secret issued by the acceptor (16) |
//	the dialer's own secret (16) | the acceptor's queue pair id (8)
//
// and the accepting side answers handshakeMagic followed by one status
// byte: handshakeOK or handshakeRefused.
//
// The magic's last byte is the version of the frames that follow (wire.go):
// 2 since flagNoAck, which a peer of version 1 would refuse mid-session as
// a reserved bit; peers of different versions refuse each other here
// instead, and the session takes another plane.
var handshakeMagic = [8]byte{'t', 'r', 'p', 'c', 't', 'c', 'p', wireVersion}

// wireVersion is the version of the tcp frames (see handshakeMagic).
const wireVersion = 2

// magicError describes a handshake's magic that is not ours.
func magicError(what string, got []byte) error {
	if bytes.Equal(got[:7], handshakeMagic[:7]) {
		return fmt.Errorf("tcp: %s speaks tcp wire version %d, this side %d", what, got[7], wireVersion)
	}
	return fmt.Errorf("tcp: %s has a bad magic %x", what, got[:8])
}

const (
	helloSize        = 8 + 2*secretSize + 8
	replySize        = 8 + 1
	handshakeOK      = 0
	handshakeRefused = 1
)

// hello is the dialer's first message.
type hello = softrc.Hello

func encodeHello(h hello) []byte {
	b := make([]byte, 0, helloSize)
	b = append(b, handshakeMagic[:]...)
	b = append(b, h.Acceptor[:]...)
	b = append(b, h.Dialer[:]...)
	return binary.LittleEndian.AppendUint64(b, h.QPID)
}

func readHello(r io.Reader) (hello, error) {
	var b [helloSize]byte
	var h hello
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return h, fmt.Errorf("tcp: reading the handshake: %w", err)
	}
	if !bytes.Equal(b[:8], handshakeMagic[:]) {
		return h, magicError("the dialing peer's handshake", b[:])
	}
	copy(h.Acceptor[:], b[8:])
	copy(h.Dialer[:], b[8+secretSize:])
	h.QPID = binary.LittleEndian.Uint64(b[8+2*secretSize:])
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
		return 0, magicError("the accepting peer's reply", b[:])
	}
	return b[8], nil
}
