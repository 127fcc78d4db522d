package ibv

import (
	"errors"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

func TestCheckGrant(t *testing.T) {
	rw := regionView{length: 4096, access: verbs.AccessLocalWrite, registered: true, localWrite: true}
	ro := regionView{length: 4096, access: 0, registered: true}
	gone := rw
	gone.registered = false
	for _, tc := range []struct {
		name           string
		r              regionView
		offset, length int
		access         verbs.Access
		ok             bool
	}{
		{"read all", rw, 0, 4096, verbs.AccessRemoteRead, true},
		{"write middle", rw, 100, 200, verbs.AccessRemoteWrite, true},
		{"read of a read-only region", ro, 0, 10, verbs.AccessRemoteRead, true},
		{"last byte", rw, 4095, 1, verbs.AccessRemoteRead, true},
		{"no right", rw, 0, 10, 0, false},
		{"both rights", rw, 0, 10, verbs.AccessRemoteRead | verbs.AccessRemoteWrite, false},
		{"local write", rw, 0, 10, verbs.AccessLocalWrite, false},
		{"unknown bit", rw, 0, 10, 1 << 7, false},
		{"empty", rw, 0, 0, verbs.AccessRemoteRead, false},
		{"negative offset", rw, -1, 10, verbs.AccessRemoteRead, false},
		{"negative length", rw, 0, -10, verbs.AccessRemoteRead, false},
		{"past the end", rw, 4000, 97, verbs.AccessRemoteRead, false},
		{"offset past the end", rw, 4097, 1, verbs.AccessRemoteRead, false},
		{"overflowing length", rw, 10, int(^uint(0) >> 1), verbs.AccessRemoteRead, false},
		{"write of a region without local write", ro, 0, 10, verbs.AccessRemoteWrite, false},
		{"deregistered", gone, 0, 10, verbs.AccessRemoteRead, false},
	} {
		err := checkGrant(tc.r, tc.offset, tc.length, tc.access)
		if tc.ok != (err == nil) {
			t.Errorf("%s: checkGrant = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, verbs.ErrInvalidMemory) {
			t.Errorf("%s: %v does not wrap ErrInvalidMemory", tc.name, err)
		}
	}
}

func TestCheckLocal(t *testing.T) {
	w := regionView{length: 100, access: verbs.AccessLocalWrite, registered: true, localWrite: true}
	r := regionView{length: 100, access: verbs.AccessRemoteRead, registered: true}
	for _, tc := range []struct {
		name           string
		r              regionView
		offset, length int
		written, ok    bool
	}{
		{"source", r, 0, 100, false, true},
		{"destination", w, 10, 90, true, true},
		{"empty destination without local write", r, 0, 0, true, true},
		{"destination without local write", r, 0, 1, true, false},
		{"out of bounds", w, 50, 51, false, false},
		{"negative", w, -1, 1, false, false},
	} {
		err := checkLocal(tc.r, tc.offset, tc.length, tc.written)
		if tc.ok != (err == nil) {
			t.Errorf("%s: checkLocal = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, verbs.ErrInvalidMemory) {
			t.Errorf("%s: %v does not wrap ErrInvalidMemory", tc.name, err)
		}
	}
}

func TestCheckLimits(t *testing.T) {
	seg := func(n int) verbs.Local { return verbs.Local{Length: n} }
	if total, err := checkLimits([]verbs.Local{seg(10), seg(20), seg(0)}, 4, 100); err != nil || total != 30 {
		t.Errorf("checkLimits within limits = %d, %v", total, err)
	}
	if _, err := checkLimits(make([]verbs.Local, 5), 4, 100); !errors.Is(err, verbs.ErrTooLarge) {
		t.Errorf("5 segments of 4: %v, want ErrTooLarge", err)
	}
	if _, err := checkLimits([]verbs.Local{seg(60), seg(41)}, 4, 100); !errors.Is(err, verbs.ErrTooLarge) {
		t.Errorf("101 bytes of 100: %v, want ErrTooLarge", err)
	}
	// No per-segment 2 GiB limit of its own: the device's max_msg_sz is.
	if _, err := checkLimits([]verbs.Local{seg(1 << 31)}, 4, 1<<31); err != nil {
		t.Errorf("2 GiB of 2 GiB: %v", err)
	}
}

func TestSegments(t *testing.T) {
	l := verbs.Local{Offset: 1, Length: 2}
	if got := segments(l, nil); len(got) != 1 || got[0] != l {
		t.Errorf("segments without Segments = %v", got)
	}
	s := []verbs.Local{{Length: 1}, {Length: 2}}
	if got := segments(l, s); len(got) != 2 {
		t.Errorf("segments with Segments = %v", got)
	}
}

func TestCheckSendOp(t *testing.T) {
	for _, op := range []verbs.Opcode{verbs.OpSend, verbs.OpWrite, verbs.OpWriteImm, verbs.OpRead} {
		if _, err := softrc.CheckOpcode(op); err != nil {
			t.Errorf("softrc.CheckOpcode(%s) = %v", op, err)
		}
	}
	for _, op := range []verbs.Opcode{0, verbs.OpRecv, verbs.OpRecvImm, 99} {
		if _, err := softrc.CheckOpcode(op); err == nil {
			t.Errorf("softrc.CheckOpcode(%s) accepted", op)
		}
	}
}
