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
