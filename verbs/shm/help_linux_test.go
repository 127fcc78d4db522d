package shm

import (
	"bytes"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestReceiversHelpLargeReads: with sharing on (TENSORRPC_COPY=share), a
// ring receiver polling its empty ring (b's, after the Send it took)
// copies chunks of a large Read the poster copies meanwhile
// (memcopy.Share), and every Read arrives whole, source byte for byte.
func TestReceiversHelpLargeReads(t *testing.T) {
	defer leakcheck.Check(t)
	defer memcopy.SetSharing(memcopy.SetSharing(true))
	const size = 2 << 20
	a, b, closeAll := connected(t, size)
	defer closeAll()
	var patterns [2][]byte
	for i := range patterns {
		patterns[i] = make([]byte, size)
		pattern(patterns[i], byte(i+1))
	}
	before := memcopy.Helped()
	reads := 0
	for ; reads < 2000 && memcopy.Helped()-before < 16; reads++ {
		src := b.mr.Bytes()
		copy(src, patterns[reads%2]) // each Read's bytes differ from the last one's everywhere
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: b.mr, Offset: size - 8, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		// The Send wakes b's receiver, which then polls while a's Read of
		// the rest copies.
		post(t, a,
			verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Offset: size - 8, Length: 8}},
			readOf(3, a, 0, b, 0, size-8))
		if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
		if !bytes.Equal(a.mr.Bytes()[:size-8], src[:size-8]) {
			t.Fatalf("Read %d: the bytes differ from the source", reads)
		}
	}
	n := memcopy.Helped() - before
	if n == 0 {
		t.Fatalf("no receiver took a chunk of %d Reads of %d bytes", reads, size-8)
	}
	t.Logf("receivers copied %d chunks of %d Reads", n, reads)
}
