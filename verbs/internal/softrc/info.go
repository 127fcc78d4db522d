package softrc

import (
	"encoding/binary"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// InfoVersion is the version of the Info encoding.
const InfoVersion = 3

// MaxInfoAddr is the longest address an Info carries.
const MaxInfoAddr = 255

// infoHeader is the size of an encoded Info before its address.
const infoHeader = 48

// Info is a queue pair's connection information, its LocalInfo: what the
// peer's Connect needs to reach it and to prove itself. Its encoding,
// little endian:
//
//	[0:4]   the provider's magic ("TRTC" for tcp, "TRSM" for shm)
//	[4]     InfoVersion
//	[5]     role, a verbs.ConnectRole
//	[6:22]  host identity (shm's; zero on tcp)
//	[22:38] one-time secret, never zero
//	[38:46] queue pair id
//	[46:48] address length n, at most MaxInfoAddr
//	[48:]   address: where the peer dials (tcp: "host:port"; shm: a
//	        unix socket)
type Info struct {
	Role   verbs.ConnectRole
	Host   [16]byte
	Secret Secret
	QPID   uint64
	Addr   string
}

// Encode encodes the info with the provider's magic.
func (in Info) Encode(magic string) []byte {
	b := make([]byte, infoHeader+len(in.Addr))
	copy(b, magic)
	b[4], b[5] = InfoVersion, byte(in.Role)
	copy(b[6:22], in.Host[:])
	copy(b[22:38], in.Secret[:])
	binary.LittleEndian.PutUint64(b[38:46], in.QPID)
	binary.LittleEndian.PutUint16(b[46:48], uint16(len(in.Addr)))
	copy(b[infoHeader:], in.Addr)
	return b
}

// ParseInfo decodes the info of a peer of provider ("tcp"), whose magic
// it must carry, and hands it to check, the provider's checks of the
// address and role. Every failure wraps verbs.ErrInvalidInfo.
func ParseInfo(provider, magic string, b []byte, check func(*Info) error) (Info, error) {
	var in Info
	invalid := func(format string, args ...any) (Info, error) {
		return Info{}, fmt.Errorf("%s: connection info: %s: %w", provider, fmt.Sprintf(format, args...), verbs.ErrInvalidInfo)
	}
	if len(b) < infoHeader {
		return invalid("%d bytes, shorter than %d", len(b), infoHeader)
	}
	if string(b[:4]) != magic {
		return invalid("magic %q, not %s's %q", b[:4], provider, magic)
	}
	if b[4] != InfoVersion {
		return invalid("version %d, want %d", b[4], InfoVersion)
	}
	in.Role = verbs.ConnectRole(b[5])
	switch in.Role {
	case verbs.RoleAny, verbs.RoleDial, verbs.RoleAccept:
	default:
		return invalid("unknown role %d", b[5])
	}
	copy(in.Host[:], b[6:22])
	copy(in.Secret[:], b[22:38])
	in.QPID = binary.LittleEndian.Uint64(b[38:46])
	if n := int(binary.LittleEndian.Uint16(b[46:48])); n > MaxInfoAddr || len(b) != infoHeader+n {
		return invalid("%d bytes, its address length says %d", len(b), infoHeader+n)
	}
	in.Addr = string(b[infoHeader:])
	if in.Secret == (Secret{}) {
		return invalid("all-zero secret")
	}
	if err := check(&in); err != nil {
		return invalid("%v", err)
	}
	return in, nil
}
