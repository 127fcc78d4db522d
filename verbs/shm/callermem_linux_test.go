package shm

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// guardLen is the number of guard bytes on each side of a guarded buffer.
const guardLen = 256

// guarded is memory without an fd, as a framework's array is: Bytes lies
// between guard bytes of a known pattern, which no transfer of Bytes may
// touch.
type guarded struct {
	all   []byte
	Bytes []byte
}

func newGuarded(size int) guarded {
	all := make([]byte, guardLen+size+guardLen)
	for i := range all {
		all[i] = 0xee
	}
	return guarded{all: all, Bytes: all[guardLen : guardLen+size : guardLen+size]}
}

// intact reports an error when a guard byte changed.
func (g guarded) intact() error {
	for i, b := range g.all {
		if i >= guardLen && i < guardLen+len(g.Bytes) {
			continue
		}
		if b != 0xee {
			return fmt.Errorf("guard byte %d (of %d before and after %d bytes) is %#x", i, guardLen, len(g.Bytes), b)
		}
	}
	return nil
}

// post posts wrs on e's queue pair and waits for their completions, which
// must succeed.
func post(t *testing.T, e *end, wrs ...verbs.SendRequest) {
	t.Helper()
	if err := e.qp.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	for range wrs {
		if c := waitOne(t, e.cq); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
	}
}

// TestLocalMemoryWithoutFD registers memory without an fd for local use:
// it is the destination of Reads (whole and scattered) and of a Recv, the
// source of a Write and of a Send; the bytes are exact and the bytes
// around the region untouched.
func TestLocalMemoryWithoutFD(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	pattern(b.mr.Bytes(), 9)

	dst := newGuarded(5000)
	dmr, err := a.pd.RegisterMemory(verbs.Memory{Bytes: dst.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	remote := verbs.Remote{Addr: b.mr.Addr() + 100, Key: b.mr.RemoteKey()}
	post(t, a, verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: dmr, Length: 5000}, Remote: remote})
	if !bytes.Equal(dst.Bytes, b.mr.Bytes()[100:5100]) {
		t.Fatal("a Read into memory without an fd returned other bytes")
	}
	// Scattered: the first 1000 bytes read land at 4000, the next 2000 at 0.
	clear(dst.Bytes)
	post(t, a, verbs.SendRequest{ID: 2, Op: verbs.OpRead, Remote: remote, Segments: []verbs.Local{
		{Region: dmr, Offset: 4000, Length: 1000}, {Region: dmr, Length: 2000}}})
	if !bytes.Equal(dst.Bytes[4000:], b.mr.Bytes()[100:1100]) || !bytes.Equal(dst.Bytes[:2000], b.mr.Bytes()[1100:3100]) {
		t.Fatal("a scattered Read into memory without an fd returned other bytes")
	}
	if err := dst.intact(); err != nil {
		t.Fatal(err)
	}

	// A source needs no rights at all.
	src := newGuarded(3000)
	pattern(src.Bytes, 0x33)
	smr, err := a.pd.RegisterMemory(verbs.Memory{Bytes: src.Bytes}, 0)
	if err != nil {
		t.Fatal(err)
	}
	post(t, a, verbs.SendRequest{ID: 3, Op: verbs.OpWrite, Local: verbs.Local{Region: smr, Length: 3000}, Remote: verbs.Remote{Addr: b.mr.Addr() + 8192, Key: b.mr.RemoteKey()}})
	if !bytes.Equal(b.mr.Bytes()[8192:8192+3000], src.Bytes) {
		t.Fatal("a Write from memory without an fd landed other bytes")
	}

	// A Send from such memory into a Recv in such memory.
	in := newGuarded(4000)
	imr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: in.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 4, Local: verbs.Local{Region: imr, Offset: 500, Length: 3500}}); err != nil {
		t.Fatal(err)
	}
	post(t, a, verbs.SendRequest{ID: 5, Op: verbs.OpSend, Local: verbs.Local{Region: smr, Length: 3000}})
	if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess || c.Len != 3000 {
		t.Fatalf("receive: %+v", c)
	}
	if !bytes.Equal(in.Bytes[500:3500], src.Bytes) {
		t.Fatal("a Send from memory without an fd delivered other bytes")
	}
	for _, g := range []guarded{src, in} {
		if err := g.intact(); err != nil {
			t.Fatal(err)
		}
	}

	// The rights of the registration still hold.
	err = a.qp.PostSend(verbs.SendRequest{ID: 6, Op: verbs.OpRead, Local: verbs.Local{Region: smr, Length: 8}, Remote: remote})
	if !errors.Is(err, verbs.ErrInvalidMemory) {
		t.Fatalf("Read into memory registered without local write: %v, want ErrInvalidMemory", err)
	}
	for _, mr := range []verbs.MemoryRegion{dmr, smr, imr} {
		if err := mr.Deregister(); err != nil {
			t.Fatal(err)
		}
	}
}
