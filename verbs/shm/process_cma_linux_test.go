package shm

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// Cross-memory attach between two processes: the parent and a child (the
// test binary re-executed, see process_linux_test.go) each grant the
// other memory without an fd, a Go slice, and reach the other's.

// grantLine is how a process tells the other its read and write grants.
func grantLine(r, w verbs.Grant) string {
	return fmt.Sprintf("%d %d %d %d", r.Remote().Addr, r.Remote().Key, w.Remote().Addr, w.Remote().Key)
}

func parseGrants(line string) (r, w verbs.Remote, err error) {
	_, err = fmt.Sscanf(line, "%d %d %d %d", &r.Addr, &r.Key, &w.Addr, &w.Key)
	return r, w, err
}

// childCMA is the child of TestOtherProcessCMA (mode "cma") and
// TestOtherProcessCMARefused (mode "cma/refused", whose probes fail with
// EPERM). It reads the parent's info, prints its own, connects and
// prints its CMA(). In mode "cma" it grants the first half of a slice
// for reading and the second for writing, prints the grants, reads the
// parent's ("skip" ends it), Reads the parent's read grant and Writes
// the parent's write grant, checks what it read and prints "done"; on
// "check" it checks what the parent wrote into its slice and that the
// parent's read grant, which the parent revoked, is refused, and prints
// "ok". In mode "cma/refused" it reads the parent's grants, and its Read
// must fail saying why; it prints "refused".
func childCMA(mode string) error {
	line, err := childproc.ReadParent()
	if err != nil {
		return fmt.Errorf("no parent info: %v", err)
	}
	parentInfo, err := hex.DecodeString(line)
	if err != nil {
		return err
	}
	var opts []Option
	if mode == "cma/refused" {
		opts = append(opts, withCMAProbeErrno(unix.EPERM))
	}
	pd, err := New(opts...).Open("")
	if err != nil {
		return err
	}
	defer pd.Close()
	cq, err := pd.NewCompletionQueue(16)
	if err != nil {
		return err
	}
	vqp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 8, MaxRecv: 8})
	if err != nil {
		return err
	}
	qp := vqp.(*queuePair)
	fmt.Printf("%x\n", qp.LocalInfo())
	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	if err := qp.Connect(ctx, parentInfo); err != nil {
		return err
	}
	fmt.Printf("cma %v\n", qp.CMA())
	wait := func(n int) ([]verbs.Completion, error) {
		cs := make([]verbs.Completion, n)
		for got := 0; got < n; {
			k, err := cq.Wait(ctx, cs[got:])
			if err != nil {
				return nil, err
			}
			got += k
		}
		return cs, nil
	}
	local := make([]byte, 2*childHalf)
	lmr, err := pd.RegisterMemory(verbs.Memory{Bytes: local}, verbs.AccessLocalWrite)
	if err != nil {
		return err
	}

	if mode == "cma/refused" {
		line, err := childproc.ReadParent()
		if err != nil {
			return err
		}
		r, _, err := parseGrants(line)
		if err != nil {
			return err
		}
		pattern(local, childSeed)
		if err := qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: lmr, Length: childHalf}, Remote: r}); err != nil {
			return err
		}
		cs, err := wait(1)
		if err != nil {
			return err
		}
		if c := cs[0]; c.Status != verbs.StatusRemoteAccess || !errors.Is(c.Err, ErrCMAUnusable) || !strings.Contains(c.Err.Error(), "operation not permitted") {
			return fmt.Errorf("a Read where cross-memory attach is unusable: %v, want a remote access error saying why", verbs.CompletionError(c))
		}
		want := make([]byte, 2*childHalf)
		pattern(want, childSeed)
		if !bytes.Equal(local, want) {
			return errors.New("the refused Read changed the local buffer")
		}
		fmt.Println("refused")
		return nil
	}

	mem := make([]byte, 2*childHalf) // memory without an fd, granted to the parent
	pattern(mem[:childHalf], childSeed)
	mr, err := pd.RegisterMemory(verbs.Memory{Bytes: mem}, verbs.AccessLocalWrite)
	if err != nil {
		return err
	}
	rg, err := qp.Grant(mr, 0, childHalf, verbs.AccessRemoteRead)
	if err != nil {
		return err
	}
	wg, err := qp.Grant(mr, childHalf, childHalf, verbs.AccessRemoteWrite)
	if err != nil {
		return err
	}
	fmt.Println(grantLine(rg, wg))
	if line, err = childproc.ReadParent(); err != nil || line == "skip" {
		return err
	}
	r, w, err := parseGrants(line)
	if err != nil {
		return err
	}
	pattern(local[childHalf:], childSeed^0xff)
	err = qp.PostSend(
		verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: lmr, Length: childHalf}, Remote: r},
		verbs.SendRequest{ID: 2, Op: verbs.OpWrite, Local: verbs.Local{Region: lmr, Offset: childHalf, Length: childHalf}, Remote: w},
	)
	if err != nil {
		return err
	}
	cs, err := wait(2)
	if err != nil {
		return err
	}
	for _, c := range cs {
		if err := verbs.CompletionError(c); err != nil {
			return err
		}
	}
	want := make([]byte, childHalf)
	pattern(want, parentSeed)
	if !bytes.Equal(local[:childHalf], want) {
		return errors.New("read other bytes from the parent's memory")
	}
	fmt.Println("done")
	if line, err := childproc.ReadParent(); err != nil || line != "check" {
		return fmt.Errorf("no check from the parent: %q %v", line, err)
	}
	pattern(want, parentSeed^0x0f)
	if !bytes.Equal(mem[childHalf:], want) {
		return errors.New("the parent's Write did not land in our memory")
	}
	if err := qp.PostSend(verbs.SendRequest{ID: 3, Op: verbs.OpRead, Local: verbs.Local{Region: lmr, Length: 8}, Remote: r}); err != nil {
		return err
	}
	if cs, err = wait(1); err != nil {
		return err
	}
	if cs[0].Status != verbs.StatusRemoteAccess {
		return fmt.Errorf("a Read through the revoked grant: %v, want a remote access error", verbs.CompletionError(cs[0]))
	}
	fmt.Println("ok")
	return nil
}

// cmaParent is the parent's side of a cross-process test of
// cross-memory attach: a queue pair connected to a child in mode, and
// the child's CMA() line.
func cmaParent(t *testing.T, mode string) (ps *parentSide, p *childproc.Process, childCMA string) {
	ps = newParentSide(t)
	p = childtest.Start(t, mode, childproc.Options{})
	if err := p.WriteLine(fmt.Sprintf("%x", ps.qp.LocalInfo())); err != nil {
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
	return ps, p, childtest.Line(t, p)
}

// TestOtherProcessCMA: a parent and a child process Read and Write each
// other's memory without an fd through grants, by cross-memory attach;
// the bytes are exact, the guard bytes untouched, and a revoked grant is
// refused. It skips where the probes say the two processes cannot reach
// each other.
func TestOtherProcessCMA(t *testing.T) {
	defer leakcheck.Check(t)
	ps, p, childCMA := cmaParent(t, "cma")
	defer ps.pd.Close()
	defer p.Kill() // on early returns
	childGrants := childtest.Line(t, p)
	if ours := ps.qp.(CrossMemory).CMA(); ours != nil || childCMA != "cma <nil>" {
		p.WriteLine("skip")
		p.Wait()
		ps.qp.Close()
		t.Skipf("cross-memory attach is unusable between two processes here: the child reaching us: %v; us reaching the child: %s", ours, childCMA)
	}
	cr, cw, err := parseGrants(childGrants)
	if err != nil {
		t.Fatalf("child grants %q: %v", childGrants, err)
	}

	mem := newGuarded(2 * childHalf) // granted to the child
	pattern(mem.Bytes[:childHalf], parentSeed)
	mr, err := ps.pd.RegisterMemory(verbs.Memory{Bytes: mem.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rg, err := ps.qp.Grant(mr, 0, childHalf, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	wg, err := ps.qp.Grant(mr, childHalf, childHalf, verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	local := newGuarded(2 * childHalf)
	lmr, err := ps.pd.RegisterMemory(verbs.Memory{Bytes: local.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	pattern(local.Bytes[childHalf:], parentSeed^0x0f)
	if err := p.WriteLine(grantLine(rg, wg)); err != nil {
		t.Fatal(err)
	}
	err = ps.qp.PostSend(
		verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: lmr, Length: childHalf}, Remote: cr},
		verbs.SendRequest{ID: 2, Op: verbs.OpWrite, Local: verbs.Local{Region: lmr, Offset: childHalf, Length: childHalf}, Remote: cw},
	)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if c := waitOne(t, ps.cq); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
	}
	want := make([]byte, childHalf)
	pattern(want, childSeed)
	if !bytes.Equal(local.Bytes[:childHalf], want) {
		t.Fatal("read other bytes from the child's memory")
	}
	if l := childtest.Line(t, p); l != "done" {
		t.Fatalf("the child said %q, want done", l)
	}
	pattern(want, childSeed^0xff)
	if !bytes.Equal(mem.Bytes[childHalf:], want) {
		t.Fatal("the child's Write did not land in our memory")
	}
	for _, g := range []guarded{mem, local} {
		if err := g.intact(); err != nil {
			t.Fatal(err)
		}
	}
	if err := rg.Revoke(); err != nil {
		t.Fatal(err)
	}
	p.WriteLine("check")
	if l := childtest.Line(t, p); l != "ok" {
		t.Fatalf("the child said %q, want ok", l)
	}
	if err := p.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	ps.qp.Close()
}

// TestOtherProcessCMARefused: a child whose probe of our memory fails
// (forced: EPERM) tells us, so our CMA says why, naming its pid; its Read
// through our grant on memory without an fd then fails saying why, and
// moves nothing.
func TestOtherProcessCMARefused(t *testing.T) {
	defer leakcheck.Check(t)
	ps, p, _ := cmaParent(t, "cma/refused")
	defer ps.pd.Close()
	defer p.Kill() // on early returns
	want := fmt.Sprintf("the peer (pid %d) cannot read this process's memory: process_vm_readv: operation not permitted", p.PID())
	if err := ps.qp.(CrossMemory).CMA(); !errors.Is(err, ErrCMAUnusable) || !strings.Contains(err.Error(), want) {
		t.Fatalf("CMA() = %v, want ErrCMAUnusable saying %q", err, want)
	}
	mem := newGuarded(childHalf)
	pattern(mem.Bytes, parentSeed)
	before := bytes.Clone(mem.Bytes)
	mr, err := ps.pd.RegisterMemory(verbs.Memory{Bytes: mem.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rg, err := ps.qp.Grant(mr, 0, childHalf, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.WriteLine(grantLine(rg, rg)); err != nil {
		t.Fatal(err)
	}
	if l := childtest.Line(t, p); l != "refused" {
		t.Fatalf("the child said %q, want refused", l)
	}
	if err := p.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	if !bytes.Equal(mem.Bytes, before) {
		t.Fatal("the refused Read changed our memory")
	}
	if err := mem.intact(); err != nil {
		t.Fatal(err)
	}
	ps.qp.Close()
}
