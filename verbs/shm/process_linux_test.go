package shm

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// The tests in this file run a peer in another process: the test binary
// re-executed in a role (see package childproc), talking to the parent
// over stdin/stdout.

const (
	childHalf    = 32 << 10
	childImm     = 0xc0ffee
	parentSeed   = 0x51
	childSeed    = 0x7a
	childTimeout = 20 * time.Second
)

func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed ^ byte(i>>8)
	}
}

// childMain is the child's side: it reads "info addr key" from stdin,
// prints its own info, connects, and in mode "rw" writes the first half of
// the parent's region, reads back the second half, checks it, rings the
// parent with a WriteImm and waits for "bye"; in mode "idle" it connects
// and waits to be killed.
func childMain() int {
	mode := childproc.Role()
	run := child
	switch {
	case strings.HasPrefix(mode, "echo/"):
		run = childEcho
	case strings.HasPrefix(mode, "cma"):
		run = childCMA
	}
	if err := run(mode); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

func child(mode string) error {
	line, err := childproc.ReadParent()
	if err != nil {
		return fmt.Errorf("no parent info: %v", err)
	}
	var infoHex string
	var addr uint64
	var key uint32
	if _, err := fmt.Sscanf(line, "%s %d %d", &infoHex, &addr, &key); err != nil {
		return fmt.Errorf("parsing %q: %v", line, err)
	}
	parentInfo, err := hex.DecodeString(infoHex)
	if err != nil {
		return err
	}
	pd, err := New().Open("")
	if err != nil {
		return err
	}
	defer pd.Close()
	cq, err := pd.NewCompletionQueue(16)
	if err != nil {
		return err
	}
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 8, MaxRecv: 8})
	if err != nil {
		return err
	}
	fmt.Printf("%x\n", qp.LocalInfo())
	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	if err := qp.Connect(ctx, parentInfo); err != nil {
		return err
	}
	if mode == "idle" {
		fmt.Println("connected")
		childproc.WaitForStop() // until killed
		return nil
	}
	if mode == "lease" {
		// A region the parent maps with MapRemote, then kills us.
		fd, mem, err := newSealedMemfd("child-lease", childHalf)
		if err != nil {
			return err
		}
		pattern(mem, childSeed)
		mr, err := pd.RegisterMemory(verbs.Memory{Bytes: mem, HasFD: true, FD: fd}, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
		if err != nil {
			return err
		}
		fmt.Printf("%d %d\n", mr.Addr(), mr.RemoteKey())
		childproc.WaitForStop() // until killed
		return nil
	}

	fd, err := unix.MemfdCreate("child", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return err
	}
	if err := unix.Ftruncate(fd, 2*childHalf); err != nil {
		return err
	}
	mem, err := unix.Mmap(fd, 0, 2*childHalf, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		return err
	}
	mr, err := pd.RegisterMemory(verbs.Memory{Bytes: mem, HasFD: true, FD: fd}, verbs.AccessLocalWrite)
	if err != nil {
		return err
	}
	pattern(mem[:childHalf], childSeed)
	err = qp.PostSend(
		verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: mr, Length: childHalf}, Remote: verbs.Remote{Addr: addr, Key: key}},
		verbs.SendRequest{ID: 2, Op: verbs.OpRead, Local: verbs.Local{Region: mr, Offset: childHalf, Length: childHalf}, Remote: verbs.Remote{Addr: addr + childHalf, Key: key}},
	)
	if err != nil {
		return err
	}
	cs := make([]verbs.Completion, 2)
	for got := 0; got < 2; {
		n, err := cq.Wait(ctx, cs[got:])
		if err != nil {
			return err
		}
		got += n
	}
	for _, c := range cs {
		if err := verbs.CompletionError(c); err != nil {
			return err
		}
	}
	want := make([]byte, childHalf)
	pattern(want, parentSeed)
	if string(mem[childHalf:]) != string(want) {
		return errors.New("read the wrong bytes from the parent's region")
	}
	if err := qp.PostSend(verbs.SendRequest{ID: 3, Op: verbs.OpWriteImm, Imm: childImm, Remote: verbs.Remote{Addr: addr, Key: key}}); err != nil {
		return err
	}
	if _, err := cq.Wait(ctx, cs[:1]); err != nil {
		return err
	}
	if err := verbs.CompletionError(cs[0]); err != nil {
		return err
	}
	if l, err := childproc.ReadParent(); err != nil || l != "bye" {
		return errors.New("no bye from the parent")
	}
	qp.Close()
	mr.Deregister()
	return nil
}

// parentSide is the parent's end of a cross-process test.
type parentSide struct {
	pd  verbs.ProtectionDomain
	cq  verbs.CompletionQueue
	qp  verbs.QueuePair
	mr  verbs.MemoryRegion
	rmr verbs.MemoryRegion
}

func newParentSide(t *testing.T) *parentSide {
	pd, err := New().Open("")
	if err != nil {
		t.Fatal(err)
	}
	cq, err := pd.NewCompletionQueue(16)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 8, MaxRecv: 8})
	if err != nil {
		t.Fatal(err)
	}
	mr, err := pd.RegisterMemory(sealedMemory(t, 2*childHalf), verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	rmr, err := pd.RegisterMemory(sealedMemory(t, 64), verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	return &parentSide{pd: pd, cq: cq, qp: qp, mr: mr, rmr: rmr}
}

// connectChild hands the child our info and region, and connects to it.
func (ps *parentSide) connectChild(t *testing.T, p *childproc.Process) {
	t.Helper()
	if err := p.WriteLine(fmt.Sprintf("%x %d %d", ps.qp.LocalInfo(), ps.mr.Addr(), ps.mr.RemoteKey())); err != nil {
		t.Fatalf("telling the child our info: %v", err)
	}
	l := childtest.Line(t, p)
	childInfo, err := hex.DecodeString(strings.TrimSpace(l))
	if err != nil {
		t.Fatalf("child info %q: %v", l, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	if err := ps.qp.Connect(ctx, childInfo); err != nil {
		t.Fatalf("connecting to the child: %v", err)
	}
}

// TestOtherProcess lets a peer in another process write into our region,
// read from it and ring us with a WriteImm.
func TestOtherProcess(t *testing.T) {
	defer leakcheck.Check(t)
	ps := newParentSide(t)
	defer ps.pd.Close()
	pattern(ps.mr.Bytes()[childHalf:], parentSeed)
	if err := ps.qp.PostRecv(verbs.RecvRequest{ID: 7, Local: verbs.Local{Region: ps.rmr, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	p := childtest.Start(t, "rw", childproc.Options{})
	defer p.Kill() // on early returns
	ps.connectChild(t, p)
	if ps.qp.(verbs.PeerLocator).PeerInProcess() {
		t.Error("PeerInProcess true with the peer in a child process")
	}

	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	cs := make([]verbs.Completion, 1)
	if _, err := ps.cq.Wait(ctx, cs); err != nil {
		t.Fatalf("waiting for the child's WriteImm: %v", err)
	}
	if c := cs[0]; c.ID != 7 || c.Op != verbs.OpRecvImm || c.Status != verbs.StatusSuccess || c.Imm != childImm {
		t.Fatalf("receive completion %+v, want id 7 RecvImm imm %#x", c, childImm)
	}
	want := make([]byte, childHalf)
	pattern(want, childSeed)
	if string(ps.mr.Bytes()[:childHalf]) != string(want) {
		t.Fatal("the child's Write did not land in our region")
	}
	p.WriteLine("bye")
	if err := p.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	ps.qp.Close()
}

// TestOtherProcessDies kills the peer process: our posted receives are
// flushed, the queue pair fails and nothing hangs.
func TestOtherProcessDies(t *testing.T) {
	defer leakcheck.Check(t)
	ps := newParentSide(t)
	defer ps.pd.Close()
	if err := ps.qp.PostRecv(verbs.RecvRequest{ID: 7, Local: verbs.Local{Region: ps.rmr, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	p := childtest.Start(t, "idle", childproc.Options{})
	defer p.Kill() // on early returns
	ps.connectChild(t, p)
	if l := childtest.Line(t, p); l != "connected" {
		t.Fatalf("child did not connect: %q", l)
	}
	p.Kill()

	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	cs := make([]verbs.Completion, 1)
	if _, err := ps.cq.Wait(ctx, cs); err != nil {
		t.Fatalf("waiting for the flushed receive: %v", err)
	}
	if c := cs[0]; c.ID != 7 || c.Status != verbs.StatusFlushed {
		t.Fatalf("receive completion %+v, want id 7 flushed", c)
	}
	if st := ps.qp.State(); st != verbs.QPError {
		t.Fatalf("queue pair is %v after the peer died, want ERR", st)
	}
	err := ps.qp.PostSend(verbs.SendRequest{ID: 8, Op: verbs.OpWrite, Local: verbs.Local{Region: ps.rmr, Length: 8}, Remote: verbs.Remote{Addr: 1, Key: 1}})
	if !errors.Is(err, verbs.ErrQPError) {
		t.Fatalf("PostSend after the peer died: %v, want ErrQPError", err)
	}
	ps.qp.Close()
}

// TestOtherProcessDiesLeaseSurvives maps the memory of a peer process with
// MapRemote, kills the peer and closes our queue pair: the Mapping still
// reads the peer's bytes, without a fault, until its Release.
func TestOtherProcessDiesLeaseSurvives(t *testing.T) {
	defer leakcheck.Check(t)
	ps := newParentSide(t)
	defer ps.pd.Close()
	p := childtest.Start(t, "lease", childproc.Options{})
	defer p.Kill() // on early returns
	ps.connectChild(t, p)
	var addr uint64
	var key uint32
	l := childtest.Line(t, p) // the child's region
	if _, err := fmt.Sscanf(l, "%d %d", &addr, &key); err != nil {
		t.Fatalf("child region %q: %v", l, err)
	}
	m, err := ps.qp.(verbs.RemoteMapper).MapRemote(verbs.Remote{Addr: addr, Key: key}, childHalf)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, childHalf)
	pattern(want, childSeed)
	if string(m.Bytes()) != string(want) {
		t.Fatal("the mapping does not hold the child's bytes")
	}
	p.Kill()
	deadline := time.Now().Add(childTimeout)
	for ps.qp.State() != verbs.QPError && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if err := ps.qp.Close(); err != nil {
		t.Fatal(err)
	}
	if string(m.Bytes()) != string(want) {
		t.Fatal("the mapping changed after the child died and the queue pair closed")
	}
	if err := m.Release(); err != nil {
		t.Fatal(err)
	}
}
