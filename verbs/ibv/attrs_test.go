package ibv

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// connectX is what a ConnectX-class NIC reports (values of that order).
func connectX() deviceLimits {
	return deviceLimits{
		maxMsgSize:      1 << 30,
		capFlags:        capMemWindow | capMemWindowType2B,
		maxMW:           1 << 24,
		maxQPWR:         32768,
		maxSGE:          30,
		maxSGERd:        30,
		maxQPRdAtom:     16,
		maxQPInitRdAtom: 16,
		probeSendSGE:    16,
		probeRecvSGE:    16,
		probeInline:     220,
	}
}

func TestAttributesFrom(t *testing.T) {
	for _, tc := range []struct {
		name   string
		limits func(*deviceLimits)
		inline int
		want   verbs.Attributes
	}{
		{
			name:   "connectx",
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 30, MaxSegments: 16, MaxInline: 64,
				MaxOutstandingReads: 16, MaxQueueDepth: 32768, Grants: verbs.GrantWindow},
		},
		{
			name:   "type 2A windows",
			limits: func(l *deviceLimits) { l.capFlags = capMemWindowType2A },
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 30, MaxSegments: 16, MaxInline: 64,
				MaxOutstandingReads: 16, MaxQueueDepth: 32768, Grants: verbs.GrantWindow},
		},
		{
			name:   "type 1 windows only",
			limits: func(l *deviceLimits) { l.capFlags = capMemWindow },
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 30, MaxSegments: 16, MaxInline: 64,
				MaxOutstandingReads: 16, MaxQueueDepth: 32768, Grants: verbs.GrantRegistration},
		},
		{
			name:   "type 2 flag but no windows to allocate",
			limits: func(l *deviceLimits) { l.maxMW = 0 },
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 30, MaxSegments: 16, MaxInline: 64,
				MaxOutstandingReads: 16, MaxQueueDepth: 32768, Grants: verbs.GrantRegistration},
		},
		{
			name: "small device",
			limits: func(l *deviceLimits) {
				*l = deviceLimits{maxMsgSize: 1 << 23, maxQPWR: 4096, maxSGE: 8, maxSGERd: 4,
					maxQPRdAtom: 4, maxQPInitRdAtom: 8, probeSendSGE: 4, probeRecvSGE: 4, probeInline: 0}
			},
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 23, MaxSegments: 4, MaxInline: 0,
				MaxOutstandingReads: 4, MaxQueueDepth: 4096, Grants: verbs.GrantRegistration},
		},
		{
			name:   "no max_msg_sz, no max_sge_rd, more inline than asked",
			limits: func(l *deviceLimits) { l.maxMsgSize, l.maxSGERd = 0, 0 },
			inline: 32,
			want: verbs.Attributes{MaxMessageBytes: 1 << 31, MaxSegments: 16, MaxInline: 32,
				MaxOutstandingReads: 16, MaxQueueDepth: 32768, Grants: verbs.GrantWindow},
		},
		{
			name:   "probe granted fewer receive elements",
			limits: func(l *deviceLimits) { l.probeRecvSGE = 6 },
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 30, MaxSegments: 6, MaxInline: 64,
				MaxOutstandingReads: 16, MaxQueueDepth: 32768, Grants: verbs.GrantWindow},
		},
		{
			name:   "read depths beyond ibv_qp_attr",
			limits: func(l *deviceLimits) { l.maxQPRdAtom, l.maxQPInitRdAtom = 1000, 300 },
			inline: 64,
			want: verbs.Attributes{MaxMessageBytes: 1 << 30, MaxSegments: 16, MaxInline: 64,
				MaxOutstandingReads: 255, MaxQueueDepth: 32768, Grants: verbs.GrantWindow},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := connectX()
			if tc.limits != nil {
				tc.limits(&l)
			}
			if got := attributesFrom(l, tc.inline); got != tc.want {
				t.Errorf("attributesFrom = %+v\nwant             %+v", got, tc.want)
			}
		})
	}
}

func TestProbeSGEAndReadDepths(t *testing.T) {
	l := connectX()
	if got := l.probeSGE(); got != maxSegmentsCap {
		t.Errorf("probeSGE of max_sge 30 = %d, want the cap %d", got, maxSegmentsCap)
	}
	l.maxSGE, l.maxSGERd = 8, 5
	if got := l.probeSGE(); got != 5 {
		t.Errorf("probeSGE with max_sge_rd 5 = %d, want 5", got)
	}
	l.maxSGE, l.maxSGERd = 0, 0
	if got := l.probeSGE(); got != 1 {
		t.Errorf("probeSGE of a device reporting nothing = %d, want 1", got)
	}
	l.maxQPRdAtom, l.maxQPInitRdAtom = -1, 7
	if r, i := l.readDepths(); r != 0 || i != 7 {
		t.Errorf("readDepths = %d, %d; want 0, 7", r, i)
	}
}

func TestIncRKey(t *testing.T) {
	for _, tc := range []struct{ in, want uint32 }{
		{0x00001200, 0x00001201},
		{0x000012fe, 0x000012ff},
		{0x000012ff, 0x00001200}, // the tag wraps; the index stays
		{0xffffffff, 0xffffff00},
	} {
		if got := incRKey(tc.in); got != tc.want {
			t.Errorf("incRKey(%#x) = %#x, want %#x", tc.in, got, tc.want)
		}
	}
	k := uint32(0xabcdef00)
	seen := map[uint32]bool{}
	for range 256 {
		if seen[k] || k&^0xff != 0xabcdef00 {
			t.Fatalf("incRKey repeated or changed the index: %#x", k)
		}
		seen[k] = true
		k = incRKey(k)
	}
	if k != 0xabcdef00 {
		t.Fatalf("256 increments = %#x, want back at %#x", k, 0xabcdef00)
	}
}
