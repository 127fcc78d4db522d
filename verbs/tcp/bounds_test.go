package tcp

import (
	"bytes"
	"io"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestHugeWriteIsRefusedAtOnce: a WRITE that declares 2^62 bytes and sends
// none is refused at once (its NAK arrives while the peer still owes the
// payload), and the queue pair does not hang waiting for the bytes.
func TestHugeWriteIsRefusedAtOnce(t *testing.T) {
	defer leakcheck.Check(t)
	pd, qp, _ := newTestQP(t, WithLingerTimeout(200*time.Millisecond))
	defer pd.Close()
	mr, err := pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 64)}, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	c := fakePeer(t, qp)
	defer c.Close()
	if _, err := c.Write(frame(header{op: frameWrite, key: mr.RemoteKey(), addr: mr.Addr(), seq: 1, length: 1 << 62}, nil)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var hb [headerSize]byte
	if _, err := io.ReadFull(c, hb[:]); err != nil {
		t.Fatalf("no NAK for a WRITE declaring 2^62 bytes: %v", err)
	}
	h, err := parseHeader(hb[:])
	if err != nil || h.op != frameAck || verbs.Status(h.status) != verbs.StatusRemoteAccess || h.seq != 1 {
		t.Fatalf("answer %+v (%v), want a remote-access NAK of request 1", h, err)
	}
	if st := qp.State(); st != verbs.QPError {
		t.Fatalf("queue pair in %v, want ERR", st)
	}
	io.Copy(io.Discard, c) // and the connection goes, without waiting for 2^62 bytes
}

// TestUnreadResponsesAreBounded: a peer sends 200,000 READ requests and
// never reads a response. The queue pair keeps a bounded number of
// responses queued (the rest wait in TCP's buffers: back-pressure), rather
// than growing its heap with every request.
func TestUnreadResponsesAreBounded(t *testing.T) {
	defer leakcheck.Check(t)
	pd, qp, _ := newTestQP(t, WithLingerTimeout(200*time.Millisecond))
	defer pd.Close()
	mr, err := pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 4096)}, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	c := fakePeer(t, qp)
	const requests = 200000
	var buf bytes.Buffer
	for i := range requests {
		buf.Write(frame(header{op: frameReadReq, key: mr.RemoteKey(), addr: mr.Addr(), seq: uint64(i + 1), length: 4096}, nil))
	}
	wrote := make(chan int64, 1)
	go func() {
		c.SetWriteDeadline(time.Now().Add(3 * time.Second))
		n, _ := io.Copy(c, &buf) // blocks once the queue pair stops reading
		wrote <- n
	}()
	peak := 0
	deadline := time.Now().Add(4 * time.Second)
	for time.Now().Before(deadline) {
		qp.Mu.Lock()
		peak = max(peak, len(qp.ctrl))
		qp.Mu.Unlock()
		time.Sleep(time.Millisecond)
	}
	sent := <-wrote
	t.Logf("the peer got %d of %d bytes of requests in; at most %d responses were queued", sent, requests*headerSize, peak)
	if peak > maxQueuedCtrl {
		t.Fatalf("%d responses queued, bound %d", peak, maxQueuedCtrl)
	}
	c.Close()
}
