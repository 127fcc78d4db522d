package shm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
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
