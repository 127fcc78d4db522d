package ibv

import (
	"encoding/binary"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// The connection info a queue pair hands to its peer, big endian:
//
//	offset size field
//	     0    2 magic "IB"
//	     2    1 version (1)
//	     3    1 link layer (1 InfiniBand, 2 Ethernet/RoCE)
//	     4    1 path MTU code (1=256 … 5=4096), the largest this side accepts
//	     5    1 responder resources: RDMA Reads this side serves at once
//	     6    2 LID (InfiniBand)
//	     8    4 QP number (24 bits)
//	    12    4 first packet sequence number (24 bits)
//	    16   16 GID (RoCE; may be zero on InfiniBand)
//	    32   16 secret
//
// Parsing is pure Go so that it is tested and fuzzed on every build, with or
// without libibverbs.
const (
	infoMagic0   = 'I'
	infoMagic1   = 'B'
	infoVersion  = 1
	infoSize     = 48
	maxQPN       = 1<<24 - 1
	maxPSN       = 1<<24 - 1
	linkInfini   = 1
	linkEthernet = 2
)

// connInfo is the decoded connection info of one queue pair.
type connInfo struct {
	linkLayer  uint8
	mtu        uint8 // IBV_MTU_* code
	responders uint8 // max_dest_rd_atomic of the sender of the info
	lid        uint16
	qpn        uint32
	psn        uint32
	gid        [16]byte
	// secret is the one-time value the control plane binds the data plane
	// with. A NIC cannot check it: an RC queue pair accepts packets only
	// from the QPN, PSN range and GID/LID it was connected to, and those
	// arrive over the same control-plane session as the secret.
	secret [16]byte
}

func (c connInfo) marshal() []byte {
	b := make([]byte, infoSize)
	b[0], b[1], b[2] = infoMagic0, infoMagic1, infoVersion
	b[3] = c.linkLayer
	b[4] = c.mtu
	b[5] = c.responders
	binary.BigEndian.PutUint16(b[6:], c.lid)
	binary.BigEndian.PutUint32(b[8:], c.qpn)
	binary.BigEndian.PutUint32(b[12:], c.psn)
	copy(b[16:32], c.gid[:])
	copy(b[32:48], c.secret[:])
	return b
}

// parseInfo decodes a peer's connection info. Any malformed input yields an
// error wrapping verbs.ErrInvalidInfo; it never panics.
func parseInfo(b []byte) (connInfo, error) {
	var c connInfo
	bad := func(format string, args ...any) (connInfo, error) {
		return connInfo{}, fmt.Errorf("ibv: %w: "+format, append([]any{verbs.ErrInvalidInfo}, args...)...)
	}
	if len(b) != infoSize {
		return bad("%d bytes, want %d", len(b), infoSize)
	}
	if b[0] != infoMagic0 || b[1] != infoMagic1 {
		return bad("not ibv connection info (magic %#x %#x)", b[0], b[1])
	}
	if b[2] != infoVersion {
		return bad("version %d, want %d", b[2], infoVersion)
	}
	c.linkLayer = b[3]
	c.mtu = b[4]
	c.responders = b[5]
	c.lid = binary.BigEndian.Uint16(b[6:])
	c.qpn = binary.BigEndian.Uint32(b[8:])
	c.psn = binary.BigEndian.Uint32(b[12:])
	copy(c.gid[:], b[16:32])
	copy(c.secret[:], b[32:48])

	switch c.linkLayer {
	case linkInfini:
		if c.lid == 0 {
			return bad("InfiniBand peer without a LID")
		}
	case linkEthernet:
		if c.gid == [16]byte{} {
			return bad("RoCE peer without a GID")
		}
	default:
		return bad("unknown link layer %d", c.linkLayer)
	}
	if c.mtu < 1 || c.mtu > 5 {
		return bad("path MTU code %d outside 1..5", c.mtu)
	}
	// QP numbers 0 and 1 are the management queue pairs, never an RC peer.
	if c.qpn < 2 || c.qpn > maxQPN {
		return bad("QP number %#x", c.qpn)
	}
	if c.psn > maxPSN {
		return bad("PSN %#x wider than 24 bits", c.psn)
	}
	return c, nil
}

// mtuCode converts bytes to the IBV_MTU_* code of the largest MTU not above
// it; anything below 256 is 256.
func mtuCode(bytes int) uint8 {
	code := uint8(1)
	for size := 512; code < 5 && size <= bytes; size *= 2 {
		code++
	}
	return code
}

// mtuBytes converts an IBV_MTU_* code to bytes.
func mtuBytes(code uint8) int {
	if code < 1 || code > 5 {
		return 0
	}
	return 128 << code
}
