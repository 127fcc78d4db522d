package shm

import (
	"encoding/binary"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// connInfo is a queue pair's connection information, the bytes of
// LocalInfo. Its layout (little endian):
//
//	[0:4]   magic "TRSM"
//	[4]     version (1)
//	[5]     reserved, zero
//	[6:22]  host identity (16 bytes)
//	[22:38] one-time secret (16 bytes)
//	[38:46] queue pair id
//	[46:48] socket address length n, 1..maxAddrLen
//	[48:]   socket address: "@name" (abstract) or an absolute path
type connInfo struct {
	hostID [16]byte
	secret softrc.Secret
	qpID   uint64
	addr   string
}

const (
	infoMagic   = "TRSM"
	infoVersion = 1
	infoHeader  = 48
	// maxAddrLen is the longest unix socket address: sun_path is 108
	// bytes, the abstract form spends one on the leading NUL ('@' here).
	maxAddrLen = 107
)

func (ci connInfo) marshal() []byte {
	b := make([]byte, infoHeader+len(ci.addr))
	copy(b, infoMagic)
	b[4] = infoVersion
	copy(b[6:22], ci.hostID[:])
	copy(b[22:38], ci.secret[:])
	binary.LittleEndian.PutUint64(b[38:46], ci.qpID)
	binary.LittleEndian.PutUint16(b[46:48], uint16(len(ci.addr)))
	copy(b[infoHeader:], ci.addr)
	return b
}

func invalidInfo(format string, args ...any) error {
	return fmt.Errorf("shm: %s: %w", fmt.Sprintf(format, args...), verbs.ErrInvalidInfo)
}

// parseInfo decodes connection info from an untrusted peer. Every failure
// wraps verbs.ErrInvalidInfo.
func parseInfo(b []byte) (connInfo, error) {
	var ci connInfo
	if len(b) < infoHeader {
		return ci, invalidInfo("connection info is %d bytes, want at least %d", len(b), infoHeader)
	}
	if string(b[:4]) != infoMagic {
		return ci, invalidInfo("connection info is not shm info (magic %q)", b[:4])
	}
	if b[4] != infoVersion {
		return ci, invalidInfo("connection info version %d, want %d", b[4], infoVersion)
	}
	if b[5] != 0 {
		return ci, invalidInfo("connection info has reserved byte %#x", b[5])
	}
	n := int(binary.LittleEndian.Uint16(b[46:48]))
	if n == 0 || n > maxAddrLen {
		return ci, invalidInfo("socket address length %d out of range 1..%d", n, maxAddrLen)
	}
	if len(b) != infoHeader+n {
		return ci, invalidInfo("connection info is %d bytes, want %d", len(b), infoHeader+n)
	}
	addr := b[infoHeader:]
	if addr[0] != '@' && addr[0] != '/' {
		return ci, invalidInfo("socket address %q is neither abstract (@) nor absolute", addr)
	}
	for _, c := range addr {
		if c == 0 {
			return ci, invalidInfo("socket address contains NUL")
		}
	}
	copy(ci.hostID[:], b[6:22])
	copy(ci.secret[:], b[22:38])
	ci.qpID = binary.LittleEndian.Uint64(b[38:46])
	ci.addr = string(addr)
	return ci, nil
}
