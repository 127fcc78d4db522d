package ibv

import "github.com/tensorrpc/tensorrpc/verbs"

// This file is pure Go so that it is tested on every build: the cgo code
// fills a deviceLimits from ibv_query_device(_ex), ibv_query_port and a
// probe queue pair, and attributesFrom turns it into verbs.Attributes.

// Device capability bits of ibv_device_attr(_ex).device_cap_flags(_ex)
// (enum ibv_device_cap_flags); the rdma build asserts that they match the
// installed header.
const (
	capMemWindow       = 1 << 17 // IBV_DEVICE_MEM_WINDOW
	capMemWindowType2A = 1 << 23 // IBV_DEVICE_MEM_WINDOW_TYPE_2A
	capMemWindowType2B = 1 << 24 // IBV_DEVICE_MEM_WINDOW_TYPE_2B
)

const (
	// maxSegmentsCap bounds the scatter/gather elements a queue pair is
	// created with: each one makes every work queue entry bigger, and
	// devices report up to 30 or more.
	maxSegmentsCap = 16
	// minSegments is what the verbs contract promises at least.
	minSegments = 4
	// defaultMaxMessage is the InfiniBand limit of one message (2^31
	// bytes), used when a port reports no max_msg_sz.
	defaultMaxMessage = 1 << 31
	// maxReadDepth is the widest max_rd_atomic and max_dest_rd_atomic
	// ibv_qp_attr can carry (uint8_t), and the widest the connection info
	// carries.
	maxReadDepth = 255
)

// deviceLimits is what the provider reads of a device, its port and a probe
// queue pair.
type deviceLimits struct {
	maxMsgSize      uint32 // port max_msg_sz
	capFlags        uint64 // device_cap_flags_ex, or device_cap_flags
	maxMW           int    // max_mw
	maxQPWR         int    // max_qp_wr
	maxSGE          int    // max_sge
	maxSGERd        int    // max_sge_rd (0: not reported)
	maxQPRdAtom     int    // max_qp_rd_atom: Reads served at once per QP
	maxQPInitRdAtom int    // max_qp_init_rd_atom: Reads issued at once per QP
	// The probe queue pair's granted capacities (ibv_qp_init_attr.cap
	// after ibv_create_qp), created with probeSGE elements and
	// probeInline bytes of inline data requested.
	probeSendSGE int
	probeRecvSGE int
	probeInline  int
}

// probeSGE is how many scatter/gather elements the probe queue pair asks
// for: the device's max_sge, capped.
func (l deviceLimits) probeSGE() int {
	n := min(l.maxSGE, maxSegmentsCap)
	if l.maxSGERd > 0 {
		n = min(n, l.maxSGERd)
	}
	return max(n, 1)
}

// windows reports whether the device binds type 2 memory windows.
func (l deviceLimits) windows() bool {
	return l.capFlags&(capMemWindowType2A|capMemWindowType2B) != 0 && l.maxMW > 0
}

// readDepths returns the Reads a queue pair serves (max_dest_rd_atomic at
// RTR) and issues (max_rd_atomic at RTS) at once: the device's limits,
// clamped to what ibv_qp_attr holds.
func (l deviceLimits) readDepths() (responder, initiator uint8) {
	clamp := func(v int) uint8 { return uint8(min(max(v, 0), maxReadDepth)) }
	return clamp(l.maxQPRdAtom), clamp(l.maxQPInitRdAtom)
}

// attributesFrom maps a device's limits to verbs.Attributes. wantInline is
// the inline size the provider asks queue pairs for (WithMaxInline).
func attributesFrom(l deviceLimits, wantInline int) verbs.Attributes {
	msg := int64(l.maxMsgSize)
	if msg <= 0 {
		msg = defaultMaxMessage
	}
	segs := min(l.probeSGE(), l.probeSendSGE, l.probeRecvSGE)
	responder, initiator := l.readDepths()
	a := verbs.Attributes{
		MaxMessageBytes: msg,
		MaxSegments:     max(segs, 0),
		MaxInline:       max(min(wantInline, l.probeInline), 0),
		// A queue pair issues no more Reads at once than it may as
		// initiator, nor than a peer of the same kind serves.
		MaxOutstandingReads: int(min(responder, initiator)),
		MaxQueueDepth:       max(l.maxQPWR, 0),
		Grants:              verbs.GrantRegistration,
	}
	if l.windows() {
		a.Grants = verbs.GrantWindow
	}
	return a
}

// incRKey advances the 8-bit tag of a memory window's rkey, as
// ibv_inc_rkey does: each bind of a type 2 window names a new rkey, so a key
// from an earlier bind no longer matches.
func incRKey(rkey uint32) uint32 {
	return rkey&^0xff | (rkey+1)&0xff
}
