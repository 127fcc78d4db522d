package softrc

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestFlushOrder: after Fail, the first failed completion carries the
// error status in place of StatusFlushed and every later one stays
// StatusFlushed; a failure with its own status counts as the first;
// successes before it change nothing.
func TestFlushOrder(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []verbs.Status
		want []verbs.Status
	}{
		{"flushed", []verbs.Status{verbs.StatusFlushed, verbs.StatusFlushed}, []verbs.Status{verbs.StatusTransport, verbs.StatusFlushed}},
		{"success first", []verbs.Status{verbs.StatusSuccess, verbs.StatusFlushed, verbs.StatusFlushed}, []verbs.Status{verbs.StatusSuccess, verbs.StatusTransport, verbs.StatusFlushed}},
		{"own status first", []verbs.Status{verbs.StatusRemoteAccess, verbs.StatusFlushed}, []verbs.Status{verbs.StatusRemoteAccess, verbs.StatusFlushed}},
		{"local protection later", []verbs.Status{verbs.StatusFlushed, verbs.StatusLocalProtection}, []verbs.Status{verbs.StatusTransport, verbs.StatusLocalProtection}},
	} {
		w := NewWorkQueue(8)
		if err := w.Take(len(tc.in)); err != nil {
			t.Fatal(err)
		}
		w.Fail(verbs.StatusTransport)
		for i, st := range tc.in {
			e, ok := w.Complete(verbs.Completion{ID: uint64(i), Status: st}, false)
			if !ok || e.C.Status != tc.want[i] {
				t.Errorf("%s: completion %d = %v (%v), want %v", tc.name, i, e.C.Status, ok, tc.want[i])
			}
		}
	}
	// Before Fail, nothing is rewritten.
	w := NewWorkQueue(1)
	if e, _ := w.Complete(verbs.Completion{Status: verbs.StatusFlushed}, false); e.C.Status != verbs.StatusFlushed {
		t.Errorf("before Fail: %v, want %v", e.C.Status, verbs.StatusFlushed)
	}
}

// TestAckLocked: acknowledgements are cumulative, a refusal takes its
// request apart from those before it, and a violation changes nothing.
func TestAckLocked(t *testing.T) {
	inflight := func(ops ...verbs.Opcode) *QP {
		q := &QP{}
		for i, op := range ops {
			q.Inflight = append(q.Inflight, &SendWR{Op: op, Seq: uint64(i + 1)})
		}
		return q
	}
	q := inflight(verbs.OpWrite, verbs.OpSend, verbs.OpWrite)
	if done, refused, err := q.AckLocked(2, verbs.StatusSuccess); err != nil || len(done) != 2 || refused != nil || len(q.Inflight) != 1 {
		t.Errorf("ack 2: %d done, refused %v, %v; %d left", len(done), refused, err, len(q.Inflight))
	}
	q = inflight(verbs.OpWrite, verbs.OpSend)
	if done, refused, err := q.AckLocked(2, verbs.StatusRemoteAccess); err != nil || len(done) != 1 || refused == nil || refused.Seq != 2 || len(q.Inflight) != 0 {
		t.Errorf("NAK 2: %d done, refused %v, %v; %d left", len(done), refused, err, len(q.Inflight))
	}
	for _, tc := range []struct {
		name string
		q    *QP
		seq  uint64
	}{
		{"covers a read", inflight(verbs.OpRead, verbs.OpWrite), 2},
		{"not outstanding", inflight(verbs.OpWrite), 2},
		{"nothing outstanding", inflight(), 1},
	} {
		n := len(tc.q.Inflight)
		if _, _, err := tc.q.AckLocked(tc.seq, verbs.StatusSuccess); err == nil || len(tc.q.Inflight) != n {
			t.Errorf("%s: %v, %d of %d left", tc.name, err, len(tc.q.Inflight), n)
		}
	}
}
