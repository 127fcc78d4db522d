package shm

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

// Cross-memory attach (CMA): a peer reaches our memory that has no memfd
// with process_vm_readv and process_vm_writev against our pid, which the
// kernel allows when the peer may ptrace us (same user, and Yama's
// ptrace_scope permitting). Whether it does is decided per connection in
// the handshake, by a real probe each way: each side puts the address of
// its probe, 16 bytes holding its own secret, in its hello or welcome,
// and the other reads them with process_vm_readv from the pid the socket
// names (SO_PEERCRED), never from a pid the peer sends. The acceptor
// tells its outcome in the welcome, the dialer in a msgCMA that ends the
// handshake, so that when Connect returns each side knows whether the
// peer reaches it (CMA) and whether it reaches the peer.

var _ CrossMemory = (*queuePair)(nil)

// cmaCode is the outcome of one side's probe, as it tells the other.
type cmaCode uint32

const (
	cmaUsable       cmaCode = iota // the probe read the peer's secret
	cmaErrno                       // process_vm_readv failed; the errno goes along
	cmaNoPid                       // the socket names no pid in the prober's pid namespace
	cmaOtherProcess                // the pid holds other bytes: it is not the peer
	cmaBadCode                     // (never sent) a code this side does not know
)

// cmaProbe is one side's outcome of reading the other's probe.
type cmaProbe struct {
	code  cmaCode
	errno unix.Errno
}

// peerProcess is the process at the other end of a unix socket, as the
// kernel recorded it when the socket connected (SO_PEERCRED): for the
// dialer, the process that listened; for the acceptor, the one that
// dialed.
type peerProcess struct {
	pid      int
	uid, gid uint32
}

func peerOf(c *net.UnixConn) (peerProcess, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return peerProcess{}, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return peerProcess{}, err
	}
	if credErr != nil {
		return peerProcess{}, fmt.Errorf("SO_PEERCRED: %w", credErr)
	}
	return peerProcess{pid: int(cred.Pid), uid: cred.Uid, gid: cred.Gid}, nil
}

// peerIsThisProcess reports whether the process at the other end of c is
// this one (false when the socket does not say).
func peerIsThisProcess(c *net.UnixConn) bool {
	p, err := peerOf(c)
	return err == nil && p.pid == os.Getpid()
}

// PeerInProcess (verbs.PeerLocator) reports whether the connected peer
// is this process.
func (qp *queuePair) PeerInProcess() bool { return qp.inProcess.Load() }

// probeAddr is the address of qp's probe, which the peer reads. The
// queue pair is a heap object, which Go's collector never moves, and it
// lives as long as the connection can be probed.
func (qp *queuePair) probeAddr() uint64 {
	return uint64(uintptr(unsafe.Pointer(&qp.probe)))
}

// cmaLink is what a connection's handshake decided about cross-memory
// attach.
type cmaLink struct {
	decided bool
	taken   bool // both sides take part: we announce memory without a memfd
	peer    peerProcess
	// pidfd refers to the peer's process (opened before the probe that
	// showed the pid is the peer's), for a look before each copy that it
	// still runs, so that a pid freed and reused by another process is
	// never written; -1 when there is none.
	pidfd int
	// reach is why this process cannot reach the peer's memory (nil: it
	// can); peerReach why the peer cannot reach ours (CMA).
	reach, peerReach error
}

func (c *cmaLink) release() {
	closeFD(c.pidfd)
	c.pidfd = -1
}

// notTaken is the link of a handshake in which cross-memory attach was
// not negotiated, for reason.
func notTaken(reason string) cmaLink {
	err := fmt.Errorf("%w: %s", ErrCMAUnusable, reason)
	return cmaLink{decided: true, pidfd: -1, reach: err, peerReach: err}
}

// probe reads the peer's probe, want at its address addr, from the peer
// process of c. It returns the link's view of the peer with reach set;
// the caller sets peerReach when the peer tells it.
func (o *options) probe(c *net.UnixConn, addr uint64, want [16]byte) (cmaLink, cmaProbe) {
	l := cmaLink{decided: true, taken: true, pidfd: -1}
	peer, err := peerOf(c)
	if err != nil {
		// Without the peer's pid nothing can be probed; say so as a pid
		// we cannot see.
		l.reach = fmt.Errorf("%w: the socket does not name the peer's process: %v", ErrCMAUnusable, err)
		return l, cmaProbe{code: cmaNoPid}
	}
	l.peer = peer
	p := o.readProbe(&l, addr, want)
	if p.code != cmaUsable {
		l.release()
		l.reach = cmaError(p, peer, true)
	}
	return l, p
}

// readProbe opens the peer's pidfd and reads its probe.
func (o *options) readProbe(l *cmaLink, addr uint64, want [16]byte) cmaProbe {
	if o.cmaProbeErrno != 0 {
		return cmaProbe{code: cmaErrno, errno: unix.Errno(o.cmaProbeErrno)}
	}
	pid := l.peer.pid
	if pid <= 0 {
		return cmaProbe{code: cmaNoPid}
	}
	// Opened first: when the probe then finds the peer's secret at pid,
	// the pidfd is the peer's, which held that pid since it connected.
	// Without pidfds (before Linux 5.3, or a filter) copies go without
	// the look.
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		l.pidfd = fd
	} else if err == unix.ESRCH {
		return cmaProbe{code: cmaErrno, errno: unix.ESRCH}
	}
	var got [16]byte
	local := []unix.Iovec{{Base: &got[0]}}
	local[0].SetLen(len(got))
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(got)}}
	n, err := unix.ProcessVMReadv(pid, local, remote, 0)
	for err == unix.EINTR {
		n, err = unix.ProcessVMReadv(pid, local, remote, 0)
	}
	switch {
	case err != nil:
		errno, _ := err.(unix.Errno)
		return cmaProbe{code: cmaErrno, errno: errno}
	case n != len(got) || !bytes.Equal(got[:], want[:]):
		return cmaProbe{code: cmaOtherProcess}
	}
	return cmaProbe{code: cmaUsable}
}

// told is the probe outcome the peer told in the handshake.
func told(code, errno uint32) cmaProbe {
	if cmaCode(code) >= cmaBadCode {
		return cmaProbe{code: cmaBadCode}
	}
	return cmaProbe{code: cmaCode(code), errno: unix.Errno(errno)}
}

// cmaError says why a probe failed: ours, this process's probe of peer,
// or the peer's probe of us.
func cmaError(p cmaProbe, peer peerProcess, ours bool) error {
	if p.code == cmaUsable {
		return nil
	}
	who := fmt.Sprintf("this process cannot read the memory of the peer (pid %d)", peer.pid)
	if !ours {
		who = fmt.Sprintf("the peer (pid %d) cannot read this process's memory", peer.pid)
	}
	var why string
	switch p.code {
	case cmaErrno:
		why = "process_vm_readv: " + p.errno.Error()
		if hint := errnoHint(p.errno, peer, ours); hint != "" {
			why += " (" + hint + ")"
		}
	case cmaNoPid:
		why = "the socket names no pid of the reader's pid namespace"
	case cmaOtherProcess:
		why = "the pid the socket names holds other bytes at the probe's address: it is not the peer (another pid namespace?)"
	default:
		why = fmt.Sprintf("the peer's probe ended with unknown code %d", p.code)
	}
	return fmt.Errorf("%w: %s: %s", ErrCMAUnusable, who, why)
}

// errnoHint explains a failed process_vm_readv by what the kernel checks.
// The reader is this process when ours, else the peer.
func errnoHint(errno unix.Errno, peer peerProcess, ours bool) string {
	switch errno {
	case unix.EPERM:
		var why []string
		switch ptraceScope() {
		case 1:
			why = append(why, "Yama ptrace_scope is 1: only an ancestor of a process, or the process it names with prctl(PR_SET_PTRACER), may read its memory")
		case 2:
			why = append(why, "Yama ptrace_scope is 2: only a process with CAP_SYS_PTRACE may read another's memory")
		case 3:
			why = append(why, "Yama ptrace_scope is 3: no process may read another's memory")
		}
		if uid, gid := uint32(os.Geteuid()), uint32(os.Getegid()); uid != peer.uid || gid != peer.gid {
			why = append(why, fmt.Sprintf("the processes run as different users: this one as uid %d gid %d, the peer as uid %d gid %d", uid, gid, peer.uid, peer.gid))
		}
		if len(why) == 0 {
			why = append(why, "the kernel denies ptrace access: a process that is not dumpable, a seccomp filter or a security module")
		}
		return strings.Join(why, "; ")
	case unix.ESRCH:
		if ours {
			return "the peer's process is gone"
		}
		return "the peer finds no process with the pid its socket names"
	case unix.ENOSYS:
		return "the kernel has no cross-memory attach (CONFIG_CROSS_MEMORY_ATTACH), or a seccomp filter hides it"
	case unix.EFAULT:
		return "nothing is mapped at the probe's address"
	}
	return ""
}

// ptraceScope is Yama's ptrace_scope, -1 without Yama.
func ptraceScope() int {
	b, err := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

// CMA reports whether the peer can reach this process's memory by
// cross-memory attach (see CrossMemory): nil when it can, else why.
func (qp *queuePair) CMA() error {
	qp.Mu.Lock()
	defer qp.Mu.Unlock()
	if !qp.cma.decided {
		return fmt.Errorf("%w: queue pair %d is not connected (Connect probes it): %w", ErrCMAUnusable, qp.ID, verbs.ErrNotConnected)
	}
	return qp.cma.peerReach
}

var errNoCMAMessage = errors.New("shm: the dialer ended the handshake without its cross-memory attach probe")

// cacheCMA caches what the peer announced of its memory without a memfd
// (flagCMA), a region or a grant, which copies reach by cross-memory
// attach at the peer's virtual address m.offset. Nothing is mapped, so a
// peer that lies about it harms only itself; the error refuses the key:
// this process cannot reach the peer (the probe said why), or the
// announcement is malformed.
func (qp *queuePair) cacheCMA(m message) error {
	remote := verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	switch {
	case qp.cma.reach != nil:
		return fmt.Errorf("shm: remote key %#x is memory of the peer without a memfd, which only cross-memory attach reaches: %w", m.key, qp.cma.reach)
	case m.flags != flagFound|flagCMA:
		return fmt.Errorf("shm: peer memory %#x without a memfd is announced with flags %#x", m.key, m.flags)
	case m.access&^remote != 0 || m.access == 0:
		return fmt.Errorf("shm: peer memory %#x has access %v, want remote rights only", m.key, m.access)
	case m.length == 0 || m.length > uint64(math.MaxInt) || m.addr+m.length < m.addr || m.offset == 0 || m.offset+m.length < m.offset:
		return fmt.Errorf("shm: peer memory %#x has bad bounds [%#x, +%d) at address %#x", m.key, m.addr, m.length, m.offset)
	}
	rr := &remoteRegion{key: m.key, addr: m.addr, length: m.length, access: m.access, cma: true, vaddr: m.offset}
	qp.remoteMu.Lock()
	qp.putRemoteLocked(rr)
	qp.remoteMu.Unlock()
	return nil
}

// cmaCopy moves wr's bytes between its local segments and rr, the peer's
// memory without a memfd, with process_vm_writev (need is
// AccessRemoteWrite: a Write) or process_vm_readv (a Read), after the
// check every remote access makes of key, bounds and right. The caller
// holds remoteMu for reading, which keeps the pidfd open.
func (qp *queuePair) cmaCopy(rr *remoteRegion, wr *softrc.SendWR, need verbs.Access) error {
	off, err := softrc.InWindow(rr.key, rr.addr, rr.length, rr.access, need, wr.Remote.Addr, uint64(wr.N))
	if err != nil {
		return err
	}
	op, call := "Read", "process_vm_readv"
	if need == verbs.AccessRemoteWrite {
		op, call = "Write", "process_vm_writev"
	}
	pid := qp.cma.peer.pid
	if qp.peerExited() {
		return &statusError{verbs.StatusTransport, fmt.Errorf("shm: %s by cross-memory attach: the peer's process (pid %d) has exited", op, pid)}
	}
	addr := rr.vaddr + off
	done, err := cmaTransfer(pid, wr.Vec, addr, wr.N, need == verbs.AccessRemoteWrite, qp.pd.opts.cmaChunk)
	if err == nil {
		return nil
	}
	errno, _ := err.(unix.Errno)
	hint := errnoHint(errno, qp.cma.peer, true)
	if errno == unix.EFAULT {
		hint = "the peer unmapped that memory, or a local buffer is not mapped"
	}
	if hint != "" {
		hint = " (" + hint + ")"
	}
	err = fmt.Errorf("shm: %s of [%#x, +%d) of the peer's memory (pid %d, remote key %#x) by cross-memory attach: %s after %d bytes: %w%s", op, addr, wr.N, pid, rr.key, call, done, err, hint)
	if errno == unix.ESRCH {
		return &statusError{verbs.StatusTransport, err}
	}
	return err
}

// peerExited reports whether the peer's process has exited, by its pidfd
// (false without one): a pid whose process has exited may soon name
// another process, which a copy must never touch. A process that exits
// between this look and the copy cannot have its pid reused within it:
// the pid stays taken until its parent reaps it.
func (qp *queuePair) peerExited() bool {
	if qp.cma.pidfd < 0 {
		return false
	}
	fds := [1]unix.PollFd{{Fd: int32(qp.cma.pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds[:], 0)
	return err == nil && n > 0
}

// cmaTransfer moves n bytes between the local segments v and the memory
// of process pid at addr, continuing each short transfer where it
// stopped (the kernel moves at most about 2 GiB per call, and stops at
// the first page it cannot reach); a call that fails, or moves nothing,
// ends it. chunk, when not 0, caps each call (for tests). It returns how
// many bytes moved.
func cmaTransfer(pid int, v softrc.Vec, addr uint64, n int, write bool, chunk int) (int, error) {
	var iovs [softrc.MaxSegments]unix.Iovec
	var remote [1]unix.RemoteIovec
	done := 0
	for done < n {
		local := iovs[:0]
		skip := done
		for _, s := range v {
			if skip >= len(s.B) {
				skip -= len(s.B)
				continue
			}
			iov := unix.Iovec{Base: &s.B[skip]}
			iov.SetLen(len(s.B) - skip)
			local = append(local, iov)
			skip = 0
		}
		want := n - done
		if chunk > 0 {
			want = min(want, chunk)
		}
		remote[0] = unix.RemoteIovec{Base: uintptr(addr) + uintptr(done), Len: want}
		var k int
		var err error
		if write {
			k, err = unix.ProcessVMWritev(pid, local, remote[:], 0)
		} else {
			k, err = unix.ProcessVMReadv(pid, local, remote[:], 0)
		}
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return done, err
		case k <= 0:
			return done, errors.New("no byte moved")
		}
		done += k
	}
	return done, nil
}
