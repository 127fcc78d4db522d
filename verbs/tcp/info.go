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
var handshakeMagic = [8]byte{'t', 'r', 'p', 'c', 't', 'c', 'p', 1}

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
		return h, fmt.Errorf("tcp: handshake has a bad magic %x", b[:8])
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
		return 0, fmt.Errorf("tcp: handshake reply has a bad magic %x", b[:8])
	}
	return b[8], nil
}
