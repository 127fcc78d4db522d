package shm

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

const allRemote = verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead

// end is one side of a connection made by the tests in this file.
type end struct {
	pd  *domain
	cq  verbs.CompletionQueue
	qp  *queuePair
	mem verbs.Memory
	mr  verbs.MemoryRegion
}

func newEnd(t testing.TB, p verbs.Provider, size int, access verbs.Access) *end {
	t.Helper()
	pd, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	cq, err := pd.NewCompletionQueue(256)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 128, MaxRecv: 128})
	if err != nil {
		t.Fatal(err)
	}
	e := &end{pd: pd.(*domain), cq: cq, qp: qp.(*queuePair), mem: sealedMemory(t, size)}
	if e.mr, err = pd.RegisterMemory(e.mem, access); err != nil {
		t.Fatal(err)
	}
	return e
}

// connected returns two connected ends with size-byte regions, closed when
// the test ends (before its leak check, which is deferred first).
func connected(t testing.TB, size int, opts ...Option) (a, b *end, closeAll func()) {
	t.Helper()
	p := New(opts...)
	a = newEnd(t, p, size, allRemote)
	b = newEnd(t, p, size, allRemote)
	closeAll = func() { a.pd.Close(); b.pd.Close() }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- b.qp.Connect(ctx, a.qp.LocalInfo()) }()
	if err := a.qp.Connect(ctx, b.qp.LocalInfo()); err != nil {
		closeAll()
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		closeAll()
		t.Fatal(err)
	}
	return a, b, closeAll
}

func waitOne(t testing.TB, cq verbs.CompletionQueue) verbs.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs := make([]verbs.Completion, 1)
	if _, err := cq.Wait(ctx, cs); err != nil {
		t.Fatalf("waiting for a completion: %v", err)
	}
	return cs[0]
}

func TestRegisterRefusesUnsealedMemfd(t *testing.T) {
	defer leakcheck.Check(t)
	pd, err := New().Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	for _, tc := range []struct {
		name  string
		seals int
	}{
		{"NoSeals", 0},
		{"GrowOnly", unix.F_SEAL_GROW},
	} {
		_, err := pd.RegisterMemory(memfdMemory(t, 4096, tc.seals), allRemote)
		if !errors.Is(err, verbs.ErrInvalidMemory) || !strings.Contains(err.Error(), "F_SEAL_SHRINK") {
			t.Errorf("%s: RegisterMemory = %v, want ErrInvalidMemory naming F_SEAL_SHRINK", tc.name, err)
		}
	}
	// A sealed memfd whose region would reach past its end.
	m := sealedMemory(t, 4096)
	m.FDOffset = 1
	if _, err := pd.RegisterMemory(m, allRemote); !errors.Is(err, verbs.ErrInvalidMemory) {
		t.Errorf("region past the end of the memfd: %v, want ErrInvalidMemory", err)
	}
}

// TestRegisterMemoryWithoutFD: memory without an fd registers with any
// rights, before any connection (peers reach it by cross-memory attach);
// an fd that is not a memfd is refused.
func TestRegisterMemoryWithoutFD(t *testing.T) {
	defer leakcheck.Check(t)
	pd, err := New().Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	heap := make([]byte, 4096)
	mr, err := pd.RegisterMemory(verbs.Memory{Bytes: heap}, allRemote)
	if err != nil {
		t.Fatalf("RegisterMemory of heap memory with remote rights: %v", err)
	}
	if mr.Addr() != uint64(addrOf(heap)) || mr.Access() != allRemote {
		t.Fatalf("region at %#x with %v, want the memory's address %#x and %v", mr.Addr(), mr.Access(), addrOf(heap), allRemote)
	}
	if err := mr.Deregister(); err != nil {
		t.Fatal(err)
	}
	if _, err := pd.RegisterMemory(verbs.Memory{Bytes: heap[:0]}, 0); !errors.Is(err, verbs.ErrInvalidMemory) {
		t.Fatalf("RegisterMemory of no bytes = %v, want ErrInvalidMemory", err)
	}
	// A regular file cannot be sealed.
	f, err := os.CreateTemp(t.TempDir(), "region")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Truncate(4096)
	_, err = pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 4096), HasFD: true, FD: int(f.Fd())}, allRemote)
	if !errors.Is(err, verbs.ErrInvalidMemory) {
		t.Fatalf("RegisterMemory of a regular file = %v, want ErrInvalidMemory", err)
	}
}

func TestDevicesAndHostIdentity(t *testing.T) {
	id, err := HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	if len(id) != 32 {
		t.Fatalf("HostIdentity = %q, want 32 hex digits", id)
	}
	if again, _ := HostIdentity(); again != id {
		t.Fatalf("HostIdentity changed from %s to %s", id, again)
	}
	devs, err := New().Devices()
	if err != nil || len(devs) != 1 || devs[0].Name != "shm" || devs[0].Provider != "shm" || !strings.Contains(devs[0].Description, id) {
		t.Fatalf("Devices = %+v, %v; want one shm device naming host %s", devs, err, id)
	}
	if _, err := New().Open("mlx5_0"); !errors.Is(err, verbs.ErrNoDevice) {
		t.Fatalf("Open(mlx5_0) = %v, want ErrNoDevice", err)
	}
}

func TestConnectRefusesOtherHost(t *testing.T) {
	defer leakcheck.Check(t)
	p := New()
	a := newEnd(t, p, 4096, allRemote)
	defer a.pd.Close()
	b := newEnd(t, p, 4096, allRemote)
	defer b.pd.Close()
	ci, err := parseInfo(b.qp.LocalInfo())
	if err != nil {
		t.Fatal(err)
	}
	ci.Host[0] ^= 1
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = a.qp.Connect(ctx, ci.Encode(infoMagic))
	if !errors.Is(err, ErrOtherHost) || !errors.Is(err, verbs.ErrInvalidInfo) {
		t.Fatalf("Connect with another host's info = %v, want ErrOtherHost wrapping ErrInvalidInfo", err)
	}
	if st := a.qp.State(); st != verbs.QPReset {
		t.Fatalf("after the refused Connect the queue pair is %v, want RESET", st)
	}
}

// hello dials addr and presents a hello; it reports whether the peer
// welcomed it.
func hello(t *testing.T, addr string, qpID uint64, acceptorSecret, dialerSecret [16]byte) bool {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: addr, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fd, staging, err := newSealedMemfd("test-staging", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(staging)
	defer unix.Close(fd)
	m := message{typ: msgHello, seq: qpID, length: 4096}
	m.secret[0], m.secret[1] = acceptorSecret, dialerSecret
	if err := writeMessage(c, &m, fd); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	reply, rfd, err := readMessage(c, newMsgBuffers())
	closeFD(rfd)
	return err == nil && reply.typ == msgWelcome
}

// TestAcceptorChecksSecrets dials a queue pair's socket as an impostor: a
// wrong acceptor secret, then a wrong dialer secret, then (after the real
// peer connected) a replay of the right ones. Each is refused, and the real
// connection works.
func TestAcceptorChecksSecrets(t *testing.T) {
	defer leakcheck.Check(t)
	p := New()
	a := newEnd(t, p, 4096, allRemote)
	defer a.pd.Close()
	b := newEnd(t, p, 4096, allRemote)
	defer b.pd.Close()
	// Make a the acceptor: the side with the larger secret accepts.
	acc, dia := a, b
	if string(acc.qp.Secret[:]) < string(dia.qp.Secret[:]) {
		acc, dia = b, a
	}
	wrong := softrc.NewSecret()
	if hello(t, acc.pd.addr, acc.qp.ID, wrong, dia.qp.Secret) {
		t.Fatal("a hello with the wrong acceptor secret was welcomed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- acc.qp.Connect(ctx, dia.qp.LocalInfo()) }()
	// The acceptor knows its peer's secret now: an impostor with the right
	// acceptor secret but not the peer's is refused too.
	if hello(t, acc.pd.addr, acc.qp.ID, acc.qp.Secret, wrong) {
		t.Fatal("a hello with the wrong dialer secret was welcomed")
	}
	if err := dia.qp.Connect(ctx, acc.qp.LocalInfo()); err != nil {
		t.Fatalf("dialer Connect after the impostors: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("acceptor Connect after the impostors: %v", err)
	}
	if hello(t, acc.pd.addr, acc.qp.ID, acc.qp.Secret, dia.qp.Secret) {
		t.Fatal("a replayed hello was welcomed: the secret is not one-time")
	}
	// The real connection still works.
	wr := verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: dia.mr, Length: 64}, Remote: verbs.Remote{Addr: acc.mr.Addr(), Key: acc.mr.RemoteKey()}}
	if err := dia.qp.PostSend(wr); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, dia.cq); c.Status != verbs.StatusSuccess {
		t.Fatal(verbs.CompletionError(c))
	}
}

// TestDeregisterUnmapsAtPeer checks that the peer maps a region once, drops
// the mapping when the region is deregistered, and fails later accesses.
func TestDeregisterUnmapsAtPeer(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	write := func(id uint64) verbs.Completion {
		wr := verbs.SendRequest{ID: id, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 128}, Remote: verbs.Remote{Addr: b.mr.Addr() + 64, Key: b.mr.RemoteKey()}}
		if err := a.qp.PostSend(wr); err != nil {
			t.Fatal(err)
		}
		return waitOne(t, a.cq)
	}
	copy(a.mr.Bytes(), "one copy into the peer's region")
	for i := range 3 {
		if c := write(uint64(i)); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
	}
	if string(b.mr.Bytes()[64:64+31]) != "one copy into the peer's region" {
		t.Fatalf("target holds %q", b.mr.Bytes()[64:95])
	}
	a.qp.remoteMu.RLock()
	mapped := len(a.qp.remote)
	a.qp.remoteMu.RUnlock()
	if mapped != 1 {
		t.Fatalf("initiator holds %d mappings after three writes to one region, want 1", mapped)
	}
	if err := b.mr.Deregister(); err != nil {
		t.Fatal(err)
	}
	a.qp.remoteMu.RLock()
	mapped = len(a.qp.remote)
	a.qp.remoteMu.RUnlock()
	if mapped != 0 {
		t.Fatalf("initiator still holds %d mappings after the target deregistered", mapped)
	}
	if c := write(9); c.Status != verbs.StatusRemoteAccess {
		t.Fatalf("write after Deregister: %v, want remote access error", verbs.CompletionError(c))
	}
}

// TestWriteRightAfterRegister registers a region and writes into it at
// once, many times: the initiator must learn of each new region from the
// target before it writes.
func TestWriteRightAfterRegister(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	copy(a.mr.Bytes(), "fresh")
	for i := range 20 {
		mr, err := b.pd.RegisterMemory(sealedMemory(t, 4096), allRemote)
		if err != nil {
			t.Fatal(err)
		}
		wr := verbs.SendRequest{ID: uint64(i), Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 5}, Remote: verbs.Remote{Addr: mr.Addr(), Key: mr.RemoteKey()}}
		if err := a.qp.PostSend(wr); err != nil {
			t.Fatal(err)
		}
		if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
		if string(mr.Bytes()[:5]) != "fresh" {
			t.Fatalf("region %d holds %q", i, mr.Bytes()[:5])
		}
		if err := mr.Deregister(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRefusesUnsealedPeerRegion plays a peer that announces an unsealed
// memfd: we must not map it, since its owner could truncate it under us.
func TestRefusesUnsealedPeerRegion(t *testing.T) {
	for _, seals := range []int{0, unix.F_SEAL_GROW} {
		m := memfdMemory(t, 8192, seals)
		ann := message{typ: msgMapReply, flags: flagFound, key: 5, access: allRemote, addr: 1 << 20, length: 8192}
		if _, err := mapAnnounced(ann, m.FD); err == nil || !strings.Contains(err.Error(), "F_SEAL_SHRINK") {
			t.Fatalf("seals %#x: mapAnnounced = %v, want a refusal naming F_SEAL_SHRINK", seals, err)
		}
	}
	m := sealedMemory(t, 8192)
	for _, ann := range []message{
		{key: 1, access: allRemote, addr: 4096, length: 8193},                       // longer than the file
		{key: 2, access: allRemote, addr: 4096, length: 4096, offset: 8192},         // past its end
		{key: 3, access: allRemote, addr: ^uint64(0) - 100, length: 4096},           // address wraps
		{key: 4, access: allRemote, addr: 4096, length: 0},                          // empty
		{key: 5, access: allRemote | 1<<7, addr: 4096, length: 4096},                // unknown rights
		{key: 6, access: allRemote, addr: 4096, length: 16, offset: ^uint64(0) - 8}, // offset wraps
	} {
		if rr, err := mapAnnounced(ann, m.FD); err == nil {
			rr.drop()
			t.Errorf("announcement %+v was mapped", ann)
		}
	}
	rr, err := mapAnnounced(message{key: 7, access: verbs.AccessRemoteRead, addr: 4096, length: 100, offset: 5000}, m.FD)
	if err != nil {
		t.Fatal(err)
	}
	defer rr.drop()
	copy(m.Bytes[5000:], "at offset 5000")
	if got, err := rr.span(4096, 14, verbs.AccessRemoteRead); err != nil || string(got) != "at offset 5000" {
		t.Fatalf("span = %q, %v", got, err)
	}
	if _, err := rr.span(4096, 1, verbs.AccessRemoteWrite); err == nil {
		t.Fatal("a read-only mapping allowed a write")
	}
}

// TestReceiverNotReady sends with no Recv posted: the Send fails with
// StatusReceiverNotReady after the RNR timeout, the sender's queue pair is
// in error, and the receiver's follows it there (the error is fatal to the
// connection): a Recv posted at the receiver is flushed, not left hanging.
func TestReceiverNotReady(t *testing.T) {
	defer leakcheck.Check(t)
	const rnr = 50 * time.Millisecond
	a, b, closeAll := connected(t, 4096, WithRNRTimeout(rnr))
	defer closeAll()
	start := time.Now()
	if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Length: 16}}); err != nil {
		t.Fatal(err)
	}
	c := waitOne(t, a.cq)
	if c.Status != verbs.StatusReceiverNotReady || c.Err == nil {
		t.Fatalf("send without a Recv: %+v, want receiver not ready", c)
	}
	if d := time.Since(start); d < rnr {
		t.Fatalf("receiver not ready after %v, before the %v RNR timeout", d, rnr)
	}
	if st := a.qp.State(); st != verbs.QPError {
		t.Fatalf("sender is %v, want ERR", st)
	}
	// The receiver learns it from the connection, a moment later.
	deadline := time.Now().Add(10 * time.Second)
	for b.qp.State() != verbs.QPError {
		if time.Now().After(deadline) {
			t.Fatalf("receiver is %v 10 s after its peer failed, want ERR", b.qp.State())
		}
		time.Sleep(time.Millisecond)
	}
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 9, Local: verbs.Local{Region: b.mr, Length: 16}}); err == nil {
		if c := waitOne(t, b.cq); c.Status != verbs.StatusFlushed {
			t.Fatalf("a Recv posted after the connection failed: %+v, want flushed", c)
		}
	}
}

// TestLargeSendInChunks sends messages larger than the staging buffer.
func TestLargeSendInChunks(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 1<<20 + 123
	a, b, closeAll := connected(t, 2*size, WithStagingSize(16<<10))
	defer closeAll()
	pattern(a.mr.Bytes(), 3)
	for i, n := range []int{size, 16 << 10, 16<<10 + 1, 1} {
		off := i * 7
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: uint64(i), Local: verbs.Local{Region: b.mr, Offset: size, Length: size}}); err != nil {
			t.Fatal(err)
		}
		wr := verbs.SendRequest{ID: uint64(i), Op: verbs.OpSend, Imm: 77, HasImm: true, Local: verbs.Local{Region: a.mr, Offset: off, Length: n}}
		if err := a.qp.PostSend(wr); err != nil {
			t.Fatal(err)
		}
		if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess || c.Len != n || c.Imm != 77 || !c.HasImm {
			t.Fatalf("receive of %d bytes: %+v", n, c)
		}
		if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess || c.Len != n {
			t.Fatalf("send of %d bytes: %+v", n, c)
		}
		if string(b.mr.Bytes()[size:size+n]) != string(a.mr.Bytes()[off:off+n]) {
			t.Fatalf("message of %d bytes arrived corrupted", n)
		}
	}
}

// TestSocketDir uses a socket file instead of the abstract namespace; the
// file goes away with the domain.
func TestSocketDir(t *testing.T) {
	defer leakcheck.Check(t)
	dir := t.TempDir()
	a, b, closeAll := connected(t, 4096, WithSocketDir(dir))
	if !strings.HasPrefix(a.pd.addr, dir) {
		closeAll()
		t.Fatalf("socket %s is not in %s", a.pd.addr, dir)
	}
	copy(a.mr.Bytes(), "via a socket file")
	b.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: b.mr, Length: 64}})
	a.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Length: 17}})
	if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess || string(b.mr.Bytes()[:17]) != "via a socket file" {
		closeAll()
		t.Fatalf("receive: %+v %q", c, b.mr.Bytes()[:17])
	}
	closeAll()
	if left, _ := filepath.Glob(filepath.Join(dir, "*")); len(left) != 0 {
		t.Fatalf("socket files left after Close: %v", left)
	}
}

// TestWriteAfterPeerClose checks that once the peer's Close returned, a
// Write never succeeds, even before our receiver has read the EOF.
func TestWriteAfterPeerClose(t *testing.T) {
	defer leakcheck.Check(t)
	for i := range 50 {
		a, b, closeAll := connected(t, 4096)
		wr := verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 64}, Remote: verbs.Remote{Addr: b.mr.Addr(), Key: b.mr.RemoteKey()}}
		if err := a.qp.PostSend(wr); err != nil {
			closeAll()
			t.Fatal(err)
		}
		if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess {
			closeAll()
			t.Fatal(verbs.CompletionError(c))
		}
		b.qp.Close()
		err := a.qp.PostSend(wr)
		if err == nil {
			if c := waitOne(t, a.cq); c.Status != verbs.StatusTransport && c.Status != verbs.StatusFlushed {
				closeAll()
				t.Fatalf("round %d: write after the peer closed: %+v, want a transport error", i, c)
			}
		} else if !errors.Is(err, verbs.ErrQPError) {
			closeAll()
			t.Fatalf("round %d: PostSend after the peer closed: %v", i, err)
		}
		closeAll()
	}
}

// TestUnrequestedAnnouncement plays a peer that pushes a region we did not
// ask for: we must not map it, and must drop the peer.
func TestUnrequestedAnnouncement(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	ann := message{typ: msgMapReply, flags: flagFound, key: 99, seq: 12345, access: allRemote, addr: 1 << 20, length: 4096}
	if err := b.qp.send(&ann, b.mem.FD); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for a.qp.State() != verbs.QPError {
		if time.Now().After(deadline) {
			t.Fatal("the queue pair kept talking to a peer that pushed an unrequested region")
		}
		time.Sleep(time.Millisecond)
	}
	a.qp.remoteMu.RLock()
	defer a.qp.remoteMu.RUnlock()
	if len(a.qp.remote) != 0 {
		t.Fatalf("an unrequested region was mapped: %v", a.qp.remote)
	}
}

// unresponsivePeer connects a fake peer to acc's queue pair that maps key
// (a region's or a grant's) and then never answers again.
func unresponsivePeer(t *testing.T, acc *end, key uint32) *net.UnixConn {
	t.Helper()
	// The fake peer's info: the smallest secret an info may carry makes the
	// real side accept.
	fakeSecret := softrc.Secret{softrc.SecretSize - 1: 1}
	fakeInfo := softrc.Info{Host: acc.pd.hostID, Secret: fakeSecret, QPID: 1, Addr: "@tensorrpc-shm-test-nobody"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- acc.qp.Connect(ctx, fakeInfo.Encode(infoMagic)) }()

	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: acc.pd.addr, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	fd, staging, err := newSealedMemfd("fake-staging", stagingHeader+4096)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(staging); unix.Close(fd) })
	wordAt(staging, 0).Store(stateUp)
	m := message{typ: msgHello, seq: acc.qp.ID, length: uint64(len(staging))}
	m.secret[0], m.secret[1] = acc.qp.Secret, fakeSecret
	if err := writeMessage(c, &m, fd); err != nil {
		t.Fatal(err)
	}
	bufs := newMsgBuffers()
	reply, rfd, err := readMessage(c, bufs)
	closeFD(rfd)
	if err != nil || reply.typ != msgWelcome {
		t.Fatalf("handshake: %+v %v", reply, err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("Connect to the fake peer: %v", err)
	}

	// Map the key, as a peer about to use it would.
	req := message{typ: msgMapRequest, seq: 1, key: key}
	if err := writeMessage(c, &req, -1); err != nil {
		t.Fatal(err)
	}
	reply, rfd, err = readMessage(c, bufs)
	closeFD(rfd)
	if err != nil || reply.typ != msgMapReply || reply.flags&flagFound == 0 || rfd < 0 {
		t.Fatalf("map reply: %+v fd %d %v", reply, rfd, err)
	}
	return c
}

// TestRevokeAsyncUnresponsivePeer: a grant the peer mapped and never
// confirms unmapping ends its RevokeAsync after the deregister timeout
// (done runs) and fails the queue pair, as Revoke would.
func TestRevokeAsyncUnresponsivePeer(t *testing.T) {
	defer leakcheck.Check(t)
	const timeout = 100 * time.Millisecond
	acc := newEnd(t, New(WithDeregisterTimeout(timeout)), 4096, allRemote)
	defer acc.pd.Close()
	g, err := acc.qp.Grant(acc.mr, 0, 64, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	c := unresponsivePeer(t, acc, g.Remote().Key)
	defer c.Close()
	done := make(chan struct{})
	start := time.Now()
	g.(verbs.AsyncRevoker).RevokeAsync(func() { close(done) })
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("RevokeAsync's done never ran for a peer that does not confirm")
	}
	if d := time.Since(start); d < timeout {
		t.Fatalf("done ran after %v without the peer's confirmation", d)
	}
	if st := acc.qp.State(); st != verbs.QPError {
		t.Fatalf("queue pair is %v after the peer ignored an unmap, want ERR", st)
	}
	acc.qp.Close()
}

// TestDeregisterUnresponsivePeer plays a peer that maps a region and then
// ignores the request to unmap it: Deregister gives up after the deregister
// timeout and fails the queue pair.
func TestDeregisterUnresponsivePeer(t *testing.T) {
	defer leakcheck.Check(t)
	const timeout = 100 * time.Millisecond
	acc := newEnd(t, New(WithDeregisterTimeout(timeout)), 4096, allRemote)
	defer acc.pd.Close()
	c := unresponsivePeer(t, acc, acc.mr.RemoteKey())
	defer c.Close()

	start := time.Now()
	if err := acc.mr.Deregister(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < timeout {
		t.Fatalf("Deregister returned after %v without the peer's confirmation", d)
	}
	if st := acc.qp.State(); st != verbs.QPError {
		t.Fatalf("queue pair is %v after the peer ignored an unmap, want ERR", st)
	}
	acc.qp.Close()
}

// TestRevokeAsyncPeerGone: when the connection ends while a RevokeAsync
// waits for the peer's confirmation, done runs then, not at the
// deregister timeout.
func TestRevokeAsyncPeerGone(t *testing.T) {
	defer leakcheck.Check(t)
	acc := newEnd(t, New(WithDeregisterTimeout(time.Hour)), 4096, allRemote)
	defer acc.pd.Close()
	g, err := acc.qp.Grant(acc.mr, 0, 64, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	c := unresponsivePeer(t, acc, g.Remote().Key)
	done := make(chan struct{})
	g.(verbs.AsyncRevoker).RevokeAsync(func() { close(done) })
	c.Close()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("RevokeAsync's done did not run when the peer went away")
	}
	acc.qp.Close()
}
