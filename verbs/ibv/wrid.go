package ibv

import "fmt"

// This file is pure Go so that it is tested on every build.
//
// A work request's wr_id is the provider's, never the caller's ID (the
// caller's ID lives in the slot): the top two bits say which table the slot
// index in the low 32 bits belongs to.
//
//	bit 63     receive queue slot (PostRecv)
//	bit 62     provider-internal send: a memory window bind or a local
//	           invalidate posted by Grant or Revoke. Its completion is
//	           consumed inside the completion queue's poll path and never
//	           reaches the caller of Poll or Wait.
//	neither    send queue slot (PostSend)
//
// Internal requests take send queue slots like the caller's requests, so
// they count against MaxSend and against the completion queue's
// reservation.
const (
	wrRecvBit     = 1 << 63
	wrInternalBit = 1 << 62
	wrKindMask    = wrRecvBit | wrInternalBit
	wrIndexMask   = 1<<32 - 1
)

type wrKind uint8

const (
	wrSend wrKind = iota
	wrRecv
	wrInternal
)

func (k wrKind) String() string {
	switch k {
	case wrSend:
		return "send"
	case wrRecv:
		return "recv"
	case wrInternal:
		return "internal"
	}
	return fmt.Sprintf("wrKind(%d)", uint8(k))
}

func encodeWRID(k wrKind, index uint32) uint64 {
	id := uint64(index)
	switch k {
	case wrRecv:
		id |= wrRecvBit
	case wrInternal:
		id |= wrInternalBit
	}
	return id
}

// decodeWRID splits a wr_id; ok is false for a wr_id the provider never
// makes (both bits, or bits between 32 and 61 set).
func decodeWRID(id uint64) (k wrKind, index uint32, ok bool) {
	if id&^(wrKindMask|wrIndexMask) != 0 {
		return 0, 0, false
	}
	switch id & wrKindMask {
	case 0:
		k = wrSend
	case wrRecvBit:
		k = wrRecv
	case wrInternalBit:
		k = wrInternal
	default:
		return 0, 0, false
	}
	return k, uint32(id & wrIndexMask), true
}
