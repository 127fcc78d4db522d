package shm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc/granttest"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
	"golang.org/x/sys/unix"
)

// TestCMAProbe: two queue pairs of one process probe each other at
// connect; each reaches the other, through the pid the socket names.
func TestCMAProbe(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	pidfds := true
	if fd, err := unix.PidfdOpen(os.Getpid(), 0); err != nil {
		pidfds = false
	} else {
		unix.Close(fd)
	}
	for _, e := range []*end{a, b} {
		if err := e.qp.CMA(); err != nil {
			t.Fatalf("CMA() = %v, want nil between two queue pairs of one process", err)
		}
		e.qp.Mu.Lock()
		c := e.qp.cma
		e.qp.Mu.Unlock()
		if c.reach != nil || c.peer.pid != os.Getpid() || c.peer.uid != uint32(os.Geteuid()) {
			t.Fatalf("the handshake decided %+v, want reach nil and our own pid %d", c, os.Getpid())
		}
		if pidfds && c.pidfd < 0 {
			t.Fatal("no pidfd of the peer, though pidfd_open works here")
		}
	}
}

// TestCMABeforeConnect: before Connect, CMA says it is not decided yet.
func TestCMABeforeConnect(t *testing.T) {
	defer leakcheck.Check(t)
	e := newEnd(t, New(), 4096, allRemote)
	defer e.pd.Close()
	err := e.qp.CMA()
	if !errors.Is(err, ErrCMAUnusable) || !errors.Is(err, verbs.ErrNotConnected) {
		t.Fatalf("CMA() before Connect = %v, want ErrCMAUnusable and ErrNotConnected", err)
	}
}

// TestCMAProbeRefused: when the kernel refuses the probes (forced here:
// EPERM, as under Yama ptrace_scope 1 or between users), Connect still
// succeeds and each side's CMA says why, naming the peer's pid.
func TestCMAProbeRefused(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096, withCMAProbeErrno(unix.EPERM))
	defer closeAll()
	for _, e := range []*end{a, b} {
		err := e.qp.CMA()
		want := fmt.Sprintf("the peer (pid %d) cannot read this process's memory: process_vm_readv: operation not permitted", os.Getpid())
		if !errors.Is(err, ErrCMAUnusable) || !strings.Contains(err.Error(), want) {
			t.Fatalf("CMA() = %v, want ErrCMAUnusable saying %q", err, want)
		}
		e.qp.Mu.Lock()
		c := e.qp.cma
		e.qp.Mu.Unlock()
		if !errors.Is(c.reach, ErrCMAUnusable) || !strings.Contains(c.reach.Error(), "this process cannot read the memory of the peer") || c.pidfd != -1 {
			t.Fatalf("the handshake decided %+v, want reach refused and no pidfd", c)
		}
	}
	sendRecv(t, a, b, 64) // the connection works without CMA
}

// testProbe is the probe of the tests' fake peers, holding their secret
// (the smallest but the all-zero one, so that they dial): a variable of
// the package, whose address stays (a goroutine's stack may move).
var testProbe = [16]byte{softrc.SecretSize - 1: 1}

// TestCMAProbeOutcomes runs the probe against this process: its own
// bytes, other bytes, an unmapped address and no pid.
func TestCMAProbeOutcomes(t *testing.T) {
	var o options
	secret := testProbe
	addr := uint64(addrOf(testProbe[:]))
	other := secret
	other[15] ^= 1
	self := peerProcess{pid: os.Getpid(), uid: uint32(os.Geteuid()), gid: uint32(os.Getegid())}
	for _, tc := range []struct {
		name string
		peer peerProcess
		addr uint64
		want [16]byte
		code cmaCode
		text string
	}{
		{"its bytes", self, addr, secret, cmaUsable, ""},
		{"other bytes", self, addr, other, cmaOtherProcess, "it is not the peer"},
		{"nothing mapped", self, 4096, secret, cmaErrno, "bad address (nothing is mapped at the probe's address)"},
		{"no pid", peerProcess{}, addr, secret, cmaNoPid, "names no pid"},
	} {
		l := cmaLink{peer: tc.peer, pidfd: -1}
		p := o.readProbe(&l, tc.addr, tc.want)
		l.release()
		if p.code != tc.code {
			t.Errorf("%s: probe code %d, want %d", tc.name, p.code, tc.code)
		}
		err := cmaError(p, tc.peer, true)
		if tc.code == cmaUsable {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
		} else if !errors.Is(err, ErrCMAUnusable) || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("%s: %v, want ErrCMAUnusable saying %q", tc.name, err, tc.text)
		}
	}
	// What the peer tells, explained here.
	stranger := peerProcess{pid: 4242, uid: self.uid + 1, gid: self.gid}
	for _, tc := range []struct {
		p    cmaProbe
		text string
	}{
		{told(uint32(cmaErrno), uint32(unix.EPERM)), "operation not permitted (" + map[bool]string{true: "Yama", false: "the processes run as different users: this one as uid"}[ptraceScope() > 0]},
		{told(uint32(cmaErrno), uint32(unix.ENOSYS)), "CONFIG_CROSS_MEMORY_ATTACH"},
		{told(uint32(cmaErrno), uint32(unix.ESRCH)), "finds no process"},
		{told(99, 0), "unknown code"},
	} {
		err := cmaError(tc.p, stranger, false)
		if !errors.Is(err, ErrCMAUnusable) || !strings.Contains(err.Error(), "the peer (pid 4242) cannot read") || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("%+v: %v, want it to say %q", tc.p, err, tc.text)
		}
	}
}

// fakeDialer dials acc's queue pair as a peer that offers cross-memory
// attach (flagCMA) with its hello and reads the welcome; the caller ends
// the handshake.
func fakeDialer(t *testing.T, acc *end) (c *net.UnixConn, welcome message, connectErr chan error, cancel func()) {
	t.Helper()
	small := softrc.Secret(testProbe)
	info := softrc.Info{Host: acc.pd.hostID, Secret: small, QPID: 1, Addr: "@tensorrpc-shm-cma-nobody"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	connectErr = make(chan error, 1)
	go func() { connectErr <- acc.qp.Connect(ctx, info.Encode(infoMagic)) }()
	stagingFD, staging, err := newSealedMemfd("cma-staging", stagingHeader+4096)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(staging)
	defer unix.Close(stagingFD)
	wordAt(staging, 0).Store(stateUp)
	if c, err = net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: acc.pd.addr, Net: "unixpacket"}); err != nil {
		t.Fatal(err)
	}
	hello := message{typ: msgHello, flags: flagCMA, seq: acc.qp.ID, length: uint64(len(staging)), addr: uint64(addrOf(testProbe[:]))}
	hello.secret[0], hello.secret[1] = acc.qp.Secret, small
	if err := writeMessage(c, &hello, stagingFD); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	welcome, fds, err := readMessageFDs(c, newMsgBuffers())
	fds.close()
	if err != nil || welcome.typ != msgWelcome {
		t.Fatalf("welcome: %+v %v", welcome, err)
	}
	return c, welcome, connectErr, cancel
}

// TestCMAHandshake plays the dialer: the acceptor probes it and says how
// in the welcome, and takes the outcome of the dialer's probe from its
// msgCMA; one that sends anything else fails the Connect.
func TestCMAHandshake(t *testing.T) {
	defer leakcheck.Check(t)
	p := New()
	acc := newEnd(t, p, 4096, allRemote)
	defer acc.pd.Close()

	c, welcome, errc, cancel := fakeDialer(t, acc)
	if welcome.flags&flagCMA == 0 || welcome.addr != acc.qp.probeAddr() || cmaCode(welcome.imm) != cmaUsable {
		c.Close()
		cancel()
		t.Fatalf("welcome %+v: want flagCMA, the acceptor's probe and a usable outcome", welcome)
	}
	writeMessage(c, &message{typ: msgCMA, imm: uint32(cmaErrno), key: uint32(unix.EPERM)})
	err := <-errc
	cancel()
	if err != nil {
		c.Close()
		t.Fatal(err)
	}
	if err := acc.qp.CMA(); !errors.Is(err, ErrCMAUnusable) || !strings.Contains(err.Error(), "operation not permitted") {
		t.Fatalf("CMA() after the dialer told EPERM = %v", err)
	}
	acc.qp.Close()
	c.Close()

	for _, tc := range []struct {
		name string
		end  func(c *net.UnixConn)
		text string
	}{
		{"another message", func(c *net.UnixConn) { writeMessage(c, &message{typ: msgUnmapAck}) }, "not the outcome of its cross-memory attach probe"},
		{"an fd", func(c *net.UnixConn) { writeMessage(c, &message{typ: msgCMA}, int(os.Stdin.Fd())) }, "carried an fd"},
		{"hang up", func(c *net.UnixConn) { c.CloseWrite() }, "without its cross-memory attach probe"},
	} {
		before := openFDs(t)
		q := moreQP(t, acc)
		c, _, errc, cancel := fakeDialer(t, q)
		tc.end(c)
		err := <-errc
		cancel()
		c.Close()
		if err == nil || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("%s: Connect = %v, want it to say %q", tc.name, err, tc.text)
		}
		q.closeQP()
		if after := openFDs(t); after != before {
			t.Errorf("%s: %d fds open before, %d after (the pidfd?)", tc.name, before, after)
		}
	}
}

// TestCMAPeerWithoutIt: a peer whose hello does not offer cross-memory
// attach (an older provider) connects, and CMA says it does not take part.
func TestCMAPeerWithoutIt(t *testing.T) {
	defer leakcheck.Check(t)
	acc := newEnd(t, New(), 4096, allRemote)
	defer acc.pd.Close()
	f := newFakePeer(t, acc, true)
	defer f.close()
	if err := acc.qp.CMA(); !errors.Is(err, ErrCMAUnusable) || !strings.Contains(err.Error(), "does not take part") {
		t.Fatalf("CMA() with a peer that does not offer it = %v", err)
	}
	acc.qp.Close()
}

// heapMemory is memory without an fd, as a framework's array is.
func heapMemory(t testing.TB, size int) verbs.Memory {
	return verbs.Memory{Bytes: make([]byte, size)}
}

// noMapper hides verbs.RemoteMapper: memory without an fd cannot be
// mapped, which the conformance suite's mapping tests would need.
type noMapper struct{ verbs.ProtectionDomain }

func (d noMapper) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	qp, err := d.ProtectionDomain.NewQueuePair(cfg)
	if err != nil {
		return nil, err
	}
	return struct{ verbs.QueuePair }{qp}, nil
}

// cmaEnv is the conformance environment over memory without an fd,
// which peers reach by cross-memory attach.
func cmaEnv(opts ...Option) verbstest.Env {
	return verbstest.Env{
		Name: "shm-cma",
		Open: func(t testing.TB) (a, b verbs.ProtectionDomain) {
			a, b = verbstest.OpenTwo(New(opts...), "shm", "")(t)
			return noMapper{a}, noMapper{b}
		},
		NewMemory: heapMemory,
	}
}

// TestConformanceCMA runs the verbs contract over memory without an fd:
// every Read and Write of a peer's region, by its key or a grant, is a
// copy by cross-memory attach.
func TestConformanceCMA(t *testing.T) { verbstest.Run(t, cmaEnv()) }

// TestGrantsCMA: grants on memory without an fd open exactly their range,
// right and queue pair until revoked; refused accesses move no byte.
func TestGrantsCMA(t *testing.T) { granttest.Run(t, cmaEnv()) }

// TestCMAReadWrite: a peer Reads and Writes memory without an fd, by the
// region's key and through grants (announced as they are made, so used
// without asking), from memory with and without an fd, whole and
// scattered, and a WriteImm lands before its Recv completes; the bytes
// are exact, the guard bytes untouched, and nothing is mapped.
func TestCMAReadWrite(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	g := newGuarded(10000)
	pattern(g.Bytes, 0x21)
	bmr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: g.Bytes}, allRemote)
	if err != nil {
		t.Fatal(err)
	}
	local := newGuarded(10000)
	lmr, err := a.pd.RegisterMemory(verbs.Memory{Bytes: local.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}

	// By the region's own key: the first use asks the peer.
	post(t, a, verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: a.mr, Length: 10000}, Remote: verbs.Remote{Addr: bmr.Addr(), Key: bmr.RemoteKey()}})
	if !bytes.Equal(a.mr.Bytes()[:10000], g.Bytes) {
		t.Fatal("a Read of memory without an fd returned other bytes")
	}
	pattern(a.mr.Bytes(), 0x42)
	post(t, a, verbs.SendRequest{ID: 2, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 5000}, Remote: verbs.Remote{Addr: bmr.Addr() + 3000, Key: bmr.RemoteKey()}})
	if !bytes.Equal(g.Bytes[3000:8000], a.mr.Bytes()[:5000]) {
		t.Fatal("a Write into memory without an fd landed other bytes")
	}

	// Through grants, between memory without an fd on both sides.
	rg, err := b.qp.Grant(bmr, 1000, 4000, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	waitCached(t, a.qp, rg.Remote().Key)
	post(t, a, verbs.SendRequest{ID: 3, Op: verbs.OpRead, Remote: rg.Remote(), Segments: []verbs.Local{
		{Region: lmr, Offset: 7000, Length: 1500}, {Region: lmr, Length: 2500}}})
	if !bytes.Equal(local.Bytes[7000:8500], g.Bytes[1000:2500]) || !bytes.Equal(local.Bytes[:2500], g.Bytes[2500:5000]) {
		t.Fatal("a scattered Read through a grant returned other bytes")
	}
	wg, err := b.qp.Grant(bmr, 6000, 2000, verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	waitCached(t, a.qp, wg.Remote().Key)
	pattern(local.Bytes, 0x63)
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 9}); err != nil {
		t.Fatal(err)
	}
	post(t, a, verbs.SendRequest{ID: 4, Op: verbs.OpWriteImm, Imm: 77, Local: verbs.Local{Region: lmr, Length: 2000}, Remote: wg.Remote()})
	c := waitOne(t, b.cq)
	if c.Status != verbs.StatusSuccess || c.Op != verbs.OpRecvImm || c.Imm != 77 || c.Key != wg.Remote().Key || c.Len != 2000 {
		t.Fatalf("the WriteImm's receive: %+v", c)
	}
	if !bytes.Equal(g.Bytes[6000:8000], local.Bytes[:2000]) {
		t.Fatal("the WriteImm through a grant landed other bytes")
	}
	for _, gd := range []guarded{g, local} {
		if err := gd.intact(); err != nil {
			t.Fatal(err)
		}
	}
	if regions, maps, requests := grantState(a.qp); regions != 0 || maps != 0 || requests != 1 {
		t.Fatalf("%d regions mapped, %d mappings made, %d map requests; want 0, 0 and 1 (the region's key)", regions, maps, requests)
	}

	// Memory without an fd cannot be mapped; the refusal leaves the queue
	// pair usable.
	if m, err := a.qp.MapRemote(rg.Remote(), 8); !errors.Is(err, verbs.ErrUnsupported) {
		if m != nil {
			m.Release()
		}
		t.Fatalf("MapRemote of memory without an fd = %v, want ErrUnsupported", err)
	}
	if err := rg.Revoke(); err != nil {
		t.Fatal(err)
	}
	if err := wg.Revoke(); err != nil {
		t.Fatal(err)
	}
	post(t, a, verbs.SendRequest{ID: 5, Op: verbs.OpRead, Local: verbs.Local{Region: lmr, Length: 8}, Remote: verbs.Remote{Addr: bmr.Addr(), Key: bmr.RemoteKey()}})
	if err := bmr.Deregister(); err != nil {
		t.Fatal(err)
	}
	a.qp.remoteMu.RLock()
	keys := len(a.qp.remote)
	a.qp.remoteMu.RUnlock()
	if keys != 0 {
		t.Fatalf("the initiator keeps %d keys after the target revoked and deregistered everything", keys)
	}
}

// TestCMAShortTransfers: copies the kernel moves in short pieces (forced
// here: 1000 bytes a call) are continued where each stopped, across
// local segments of odd sizes.
func TestCMAShortTransfers(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<17, withCMAChunk(1000))
	defer closeAll()
	const n = 100_001
	g := newGuarded(n)
	pattern(g.Bytes, 0x17)
	bmr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: g.Bytes}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rg, err := b.qp.Grant(bmr, 0, n, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	segs := []verbs.Local{{Region: a.mr, Length: 33_333}, {Region: a.mr, Offset: 40_000, Length: 1}, {Region: a.mr, Offset: 50_000, Length: n - 33_334}}
	post(t, a, verbs.SendRequest{ID: 1, Op: verbs.OpRead, Remote: rg.Remote(), Segments: segs})
	var got []byte
	for _, s := range segs {
		got = append(got, a.mr.Bytes()[s.Offset:s.Offset+s.Length]...)
	}
	if !bytes.Equal(got, g.Bytes) {
		t.Fatal("a Read in short transfers returned other bytes")
	}
	wg, err := b.qp.Grant(bmr, 0, n, verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	pattern(a.mr.Bytes(), 0x71)
	post(t, a, verbs.SendRequest{ID: 2, Op: verbs.OpWrite, Remote: wg.Remote(), Segments: segs})
	got = got[:0]
	for _, s := range segs {
		got = append(got, a.mr.Bytes()[s.Offset:s.Offset+s.Length]...)
	}
	if !bytes.Equal(g.Bytes, got) {
		t.Fatal("a Write in short transfers landed other bytes")
	}
	if err := g.intact(); err != nil {
		t.Fatal(err)
	}
}

// TestCMAUnmappedMemory: memory the owner unmapped without deregistering
// it (the contract says not to; a framework may free it anyway) fails
// the peer's access with an error completion, after the bytes before the
// hole; nothing faults.
func TestCMAUnmappedMemory(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	page := os.Getpagesize()
	mem, err := unix.Mmap(-1, 0, 3*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	pattern(mem, 0x5c)
	bmr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: mem}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rg, err := b.qp.Grant(bmr, 0, 3*page, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(mem[:page])
	// The middle page goes (munmap of part of the mapping, through the
	// system call: mem itself stays for the deferred Munmap).
	if _, _, errno := unix.Syscall(unix.SYS_MUNMAP, uintptr(addrOf(mem[page:])), uintptr(page), 0); errno != 0 {
		t.Fatal(errno)
	}
	clear(a.mr.Bytes())
	if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: a.mr, Length: 3 * page}, Remote: rg.Remote()}); err != nil {
		t.Fatal(err)
	}
	c := waitOne(t, a.cq)
	if c.Status != verbs.StatusRemoteAccess || !errors.Is(c.Err, unix.EFAULT) || !strings.Contains(c.Err.Error(), "the peer unmapped that memory") {
		t.Fatalf("Read of memory the owner unmapped: %v, want a remote access error saying it is unmapped", verbs.CompletionError(c))
	}
	if !bytes.Equal(a.mr.Bytes()[:page], want) {
		t.Fatal("the bytes before the hole are not the owner's")
	}
	if st := a.qp.State(); st != verbs.QPError {
		t.Fatalf("the queue pair is %v after the failed Read, want ERR", st)
	}
}

// TestCMARefused: where cross-memory attach is unusable (forced: the
// probes fail with EPERM), memory without an fd still registers and
// grants, and a peer's access fails with a remote access error that says
// why; no byte moves and the initiator's buffer stays as it was.
func TestCMARefused(t *testing.T) {
	defer leakcheck.Check(t)
	for _, op := range []verbs.Opcode{verbs.OpRead, verbs.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			a, b, closeAll := connected(t, 1<<16, withCMAProbeErrno(unix.EPERM))
			defer closeAll()
			g := newGuarded(4096)
			pattern(g.Bytes, 0x3d)
			before := bytes.Clone(g.Bytes)
			bmr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: g.Bytes}, verbs.AccessLocalWrite)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.qp.CMA(); !errors.Is(err, ErrCMAUnusable) {
				t.Fatalf("CMA() = %v, want ErrCMAUnusable", err)
			}
			right := verbs.AccessRemoteRead
			if op == verbs.OpWrite {
				right = verbs.AccessRemoteWrite
			}
			grant, err := b.qp.Grant(bmr, 0, 4096, right)
			if err != nil {
				t.Fatal(err)
			}
			pattern(a.mr.Bytes(), 0x99)
			local := bytes.Clone(a.mr.Bytes())
			if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: op, Local: verbs.Local{Region: a.mr, Length: 4096}, Remote: grant.Remote()}); err != nil {
				t.Fatal(err)
			}
			c := waitOne(t, a.cq)
			if c.Status != verbs.StatusRemoteAccess || !errors.Is(c.Err, ErrCMAUnusable) || !strings.Contains(c.Err.Error(), "operation not permitted") {
				t.Fatalf("%v through a grant on memory without an fd: %v, want a remote access error saying why cross-memory attach is unusable", op, verbs.CompletionError(c))
			}
			if !bytes.Equal(g.Bytes, before) || !bytes.Equal(a.mr.Bytes(), local) {
				t.Fatal("a refused access moved bytes")
			}
			if err := g.intact(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestCMAPeerExited: the look before each copy sees a process that has
// exited through its pidfd.
func TestCMAPeerExited(t *testing.T) {
	cmd := exec.Command("/bin/true")
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start /bin/true: %v", err)
	}
	fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		cmd.Wait()
		t.Skipf("no pidfds here: %v", err)
	}
	qp := &queuePair{cma: cmaLink{pidfd: fd, peer: peerProcess{pid: cmd.Process.Pid}}}
	defer qp.cma.release()
	// Running or exited, before Wait reaps it; exited after.
	qp.peerExited()
	cmd.Wait()
	if !qp.peerExited() {
		t.Fatal("peerExited = false for a process that has exited")
	}
	self, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	alive := &queuePair{cma: cmaLink{pidfd: self}}
	defer alive.cma.release()
	if alive.peerExited() {
		t.Fatal("peerExited = true for this process")
	}
}

// cmaTarget is memory a fake peer announces as its own memory without an
// fd: it is in this process, which the queue pair reaches, at an address
// that stays.
var cmaTarget [8192]byte

// TestAttackForgedCMAAnnouncements plays a peer that takes part in
// cross-memory attach and answers the request for a key with forged
// announcements of memory without a memfd: malformed ones are refused
// before any copy (and an fd with one breaks the protocol), one that is
// well formed but does not allow the Write, or names unmapped memory,
// fails the Write; a good one gets it where it says. Pushed grants that
// are malformed are ignored.
func TestAttackForgedCMAAnnouncements(t *testing.T) {
	defer leakcheck.Check(t)
	acc := newEnd(t, New(), 4096, allRemote)
	defer acc.pd.Close()
	const key, addr = 0x1234, 1 << 20
	target := uint64(addrOf(cmaTarget[:]))
	cma := func(acc verbs.Access, vaddr, n uint64) message {
		return message{flags: flagFound | flagCMA, access: acc, addr: addr, offset: vaddr, length: n}
	}
	const rw = verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	for _, tc := range []struct {
		name   string
		reply  message
		fd     bool
		want   verbs.Status
		cached int
	}{
		{"with an fd", cma(rw, target, 4096), true, verbs.StatusTransport, 0},
		{"also a grant of an exposed region", func() message { m := cma(rw, target, 4096); m.flags |= flagRegion; return m }(), false, verbs.StatusRemoteAccess, 0},
		{"empty", cma(rw, target, 0), false, verbs.StatusRemoteAccess, 0},
		{"at address 0", cma(rw, 0, 4096), false, verbs.StatusRemoteAccess, 0},
		{"address wraps", cma(rw, ^uint64(0)-10, 4096), false, verbs.StatusRemoteAccess, 0},
		{"name wraps", func() message { m := cma(rw, target, 4096); m.addr = ^uint64(0) - 10; return m }(), false, verbs.StatusRemoteAccess, 0},
		{"length 2^63", cma(rw, target, 1<<63), false, verbs.StatusRemoteAccess, 0},
		{"local write", cma(rw|verbs.AccessLocalWrite, target, 4096), false, verbs.StatusRemoteAccess, 0},
		{"unknown rights", cma(rw|1<<20, target, 4096), false, verbs.StatusRemoteAccess, 0},
		{"read-only", cma(verbs.AccessRemoteRead, target, 4096), false, verbs.StatusRemoteAccess, 1},
		{"too short for the write", cma(rw, target, 63), false, verbs.StatusRemoteAccess, 1},
		{"unmapped memory", cma(rw, 4096, 4096), false, verbs.StatusRemoteAccess, 1},
		{"good", cma(rw, target+100, 4096), false, verbs.StatusSuccess, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(cmaTarget[:])
			before := openFDs(t)
			q := moreQP(t, acc)
			f := newFakePeerWith(t, q, true, true)
			copy(q.mr.Bytes(), "forged replies must not get this")
			if err := q.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: q.mr, Length: 64}, Remote: verbs.Remote{Addr: addr, Key: key}}); err != nil {
				t.Fatal(err)
			}
			req, fd := f.expect(msgMapRequest)
			closeFD(fd)
			reply := tc.reply
			reply.typ, reply.seq, reply.key = msgMapReply, req.seq, req.key
			if tc.fd {
				f.send(reply, int(os.Stdin.Fd()))
			} else {
				f.send(reply)
			}
			if c := waitOne(t, q.cq); c.Status != tc.want {
				t.Fatalf("the Write completed with %v (%v), want %v", c.Status, c.Err, tc.want)
			}
			landed := bytes.Contains(cmaTarget[:], []byte("forged replies"))
			if tc.want == verbs.StatusSuccess {
				if string(cmaTarget[100:132]) != "forged replies must not get this" {
					t.Fatal("the Write did not land at the announced address")
				}
			} else if landed {
				t.Fatal("a refused Write landed")
			}
			q.qp.remoteMu.RLock()
			n := len(q.qp.remote)
			q.qp.remoteMu.RUnlock()
			if n != tc.cached {
				t.Fatalf("%d announcements cached, want %d", n, tc.cached)
			}
			f.close()
			q.closeQP()
			if after := openFDs(t); after != before {
				t.Errorf("%d fds open before the attack, %d after", before, after)
			}
		})
	}

	// Pushed grants: malformed ones are ignored, one with an fd breaks
	// the protocol.
	q := moreQP(t, acc)
	defer q.closeQP()
	f := newFakePeerWith(t, q, true, true)
	defer f.close()
	for _, m := range []message{cma(rw, 0, 4096), cma(verbs.AccessLocalWrite, target, 4096), cma(rw, target, 0)} {
		m.typ, m.key = msgGrant, key
		f.send(m)
	}
	good := cma(verbs.AccessRemoteWrite, target, 64)
	good.typ, good.key = msgGrant, key+1
	f.send(good)
	waitCached(t, q.qp, key+1)
	q.qp.remoteMu.RLock()
	n := len(q.qp.remote)
	q.qp.remoteMu.RUnlock()
	if n != 1 || q.qp.State() != verbs.QPReadyToSend {
		t.Fatalf("%d pushed grants cached, queue pair %v; want 1, RTS", n, q.qp.State())
	}
	good.key = key + 2
	f.send(good, int(os.Stdin.Fd()))
	if !waitState(q.qp, verbs.QPError, 5*time.Second) {
		t.Fatalf("a pushed grant with an fd left the queue pair %v, want ERR", q.qp.State())
	}
}
