package shm

// Attacks by a hostile peer that speaks the shm protocol: forged and
// malformed control messages, forged region announcements, floods and a
// peer that stops reading. Each attack the provider once failed keeps
// its test (a forged WriteImm doorbell, a ring flood during Close, a peer
// that stops reading its socket).

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/testenv"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

// fakePeer is a hand-driven peer of a real queue pair: it does the
// handshake itself and then sends and reads raw control messages, through
// the control rings (ring) or on the socket.
type fakePeer struct {
	t         testing.TB
	c         *net.UnixConn
	stagingFD int
	staging   []byte
	rx        *ringRx // the ring the real queue pair produces into; nil on the socket
	tx        *ringTx // the real queue pair's ring
	bufs      *msgBuffers
}

// newFakePeer connects a fake peer to acc's queue pair, which accepts (the
// fake's secret, the smallest but the all-zero one that no info may carry,
// is the smaller one).
func newFakePeer(t testing.TB, acc *end, ring bool) *fakePeer {
	t.Helper()
	return newFakePeerWith(t, acc, ring, false)
}

// newFakePeerWith is newFakePeer, taking part in cross-memory attach
// when cma is set: its probe is testProbe, in this process, which the
// queue pair reaches, and it tells the queue pair that it reaches it too.
func newFakePeerWith(t testing.TB, acc *end, ring, cma bool) *fakePeer {
	t.Helper()
	small := softrc.Secret{softrc.SecretSize - 1: 1}
	info := softrc.Info{Host: acc.pd.hostID, Secret: small, QPID: 1, Addr: "@tensorrpc-shm-attack-nobody"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- acc.qp.Connect(ctx, info.Encode(infoMagic)) }()
	f := &fakePeer{t: t, bufs: newMsgBuffers(), stagingFD: -1}
	fail := func(format string, args ...any) {
		t.Helper()
		cancel()
		<-errc
		f.close()
		t.Fatalf(format, args...)
	}
	var err error
	if f.stagingFD, f.staging, err = newSealedMemfd("attack-staging", stagingHeader+4096); err != nil {
		fail("%v", err)
	}
	wordAt(f.staging, 0).Store(stateUp)
	if f.c, err = net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: acc.pd.addr, Net: "unixpacket"}); err != nil {
		fail("%v", err)
	}
	hello := message{typ: msgHello, seq: acc.qp.ID, length: uint64(len(f.staging))}
	hello.secret[0], hello.secret[1] = acc.qp.Secret, small
	if cma {
		hello.flags |= flagCMA
		hello.addr = uint64(addrOf(testProbe[:]))
	}
	ringFD := -1
	if ring {
		if f.rx, err = newRingRx(); err != nil {
			fail("%v", err)
		}
		hello.flags |= flagRing
		ringFD = f.rx.fd
	}
	if err := writeMessage(f.c, &hello, f.stagingFD, ringFD); err != nil {
		fail("hello: %v", err)
	}
	f.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	welcome, fds, err := readMessageFDs(f.c, f.bufs)
	f.c.SetReadDeadline(time.Time{})
	if err != nil || welcome.typ != msgWelcome {
		fds.close()
		fail("welcome: %+v %v", welcome, err)
	}
	closeFD(fds[0])
	if ring {
		f.tx, err = attachRingTx(fds[1])
		closeFD(fds[1])
		if err != nil {
			fail("%v", err)
		}
	} else {
		closeFD(fds[1])
	}
	if cma {
		if welcome.flags&flagCMA == 0 || cmaCode(welcome.imm) != cmaUsable {
			fail("welcome %+v: want flagCMA and a usable probe", welcome)
		}
		if err := writeMessage(f.c, &message{typ: msgCMA, imm: uint32(cmaUsable)}); err != nil {
			fail("msgCMA: %v", err)
		}
	}
	if err := <-errc; err != nil {
		fail("Connect to the fake peer: %v", err)
	}
	return f
}

func (f *fakePeer) close() {
	if f.c != nil {
		f.c.Close()
	}
	if f.staging != nil {
		unix.Munmap(f.staging)
		f.staging = nil
	}
	closeFD(f.stagingFD)
	f.stagingFD = -1
	f.rx.release()
	f.rx = nil
	f.tx.release()
	f.tx = nil
}

// putRecord commits one raw record into the real queue pair's ring and
// wakes it if it sleeps. It reports false if the ring stayed full.
func (f *fakePeer) putRecord(rec []byte) bool {
	f.t.Helper()
	return f.tryPut(rec, 5*time.Second)
}

// tryPut is putRecord giving up after d.
func (f *fakePeer) tryPut(rec []byte, d time.Duration) bool {
	f.t.Helper()
	for deadline := time.Now().Add(d); ; {
		buf, err := f.tx.ring.Reserve(len(rec))
		if err == nil {
			copy(buf, rec)
			if err := f.tx.ring.Commit(len(rec)); err != nil {
				f.t.Fatal(err)
			}
			break
		}
		if !errors.Is(err, mempool.ErrRingFull) {
			f.t.Fatal(err)
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Microsecond)
	}
	if f.tx.sleeping.CompareAndSwap(1, 0) {
		writeMessage(f.c, &message{typ: msgWake}, -1)
	}
	return true
}

// send sends m with fds attached (a ring record marked flagFD and a msgFD
// on the socket, or one socket message). More than one fd is a protocol
// violation; the attacks use it on purpose.
func (f *fakePeer) send(m message, fds ...int) {
	f.t.Helper()
	if f.tx == nil {
		if err := writeMessage(f.c, &m, fds...); err != nil {
			f.t.Fatalf("send: %v", err)
		}
		return
	}
	if len(fds) > 0 {
		m.flags |= flagFD
	}
	if !f.putRecord(encoded(m)) {
		f.t.Fatal("the real queue pair's ring stayed full")
	}
	if len(fds) > 0 {
		if err := writeMessage(f.c, &message{typ: msgFD, seq: m.seq}, fds...); err != nil {
			f.t.Fatalf("send fd: %v", err)
		}
	}
}

// recv returns the next control message from the real queue pair and the
// fd that came with it (-1 if none; the caller closes it).
func (f *fakePeer) recv(timeout time.Duration) (message, int, error) {
	deadline := time.Now().Add(timeout)
	if f.rx == nil {
		f.c.SetReadDeadline(deadline)
		defer f.c.SetReadDeadline(time.Time{})
		return readMessage(f.c, f.bufs)
	}
	for {
		if b, ok := f.rx.ring.Read(); ok {
			var rec [messageSize]byte
			copy(rec[:], b)
			f.rx.ring.Release()
			m, err := decodeMessage(rec[:])
			if err != nil || m.flags&flagFD == 0 {
				return m, -1, err
			}
			f.c.SetReadDeadline(deadline)
			defer f.c.SetReadDeadline(time.Time{})
			for {
				s, fd, err := readMessage(f.c, f.bufs)
				if err != nil || s.typ == msgFD {
					return m, fd, err
				}
				closeFD(fd)
			}
		}
		if err := f.rx.ring.Err(); err != nil {
			return message{}, -1, err
		}
		if time.Now().After(deadline) {
			return message{}, -1, os.ErrDeadlineExceeded
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// expect returns the next message of type typ, skipping others.
func (f *fakePeer) expect(typ msgType) (message, int) {
	f.t.Helper()
	for {
		m, fd, err := f.recv(5 * time.Second)
		if err != nil {
			f.t.Fatalf("waiting for message type %d: %v", typ, err)
		}
		if m.typ == typ {
			return m, fd
		}
		closeFD(fd)
	}
}

// waitState waits up to timeout for qp to reach want.
func waitState(qp *queuePair, want verbs.QPState, timeout time.Duration) bool {
	for deadline := time.Now().Add(timeout); qp.State() != want; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

// returnsWithin runs f in a goroutine and reports whether it returned
// within d. If it did not, unstick is called and f is waited for, so that
// no goroutine is left behind.
func returnsWithin(d time.Duration, f func(), unstick func()) (time.Duration, bool) {
	start := time.Now()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
		return time.Since(start), true
	case <-time.After(d):
		unstick()
		<-done
		return time.Since(start), false
	}
}

// TestAttackRingFloodCloseHangs: a peer that keeps our control ring
// non-empty keeps our receiver from ever sleeping on the socket, where it
// would notice that Close closed it; Close must still return promptly.
// The peer fills its ring with harmless records (confirmations of unmaps
// never asked for; 680 of them tile the ring exactly) once, and then only
// moves the producer's counter a ring ahead of the consumer's, from a few
// threads so that one of them always runs. (On this two-core machine the
// attacker loses the race now and then, so Close comes back after a second
// or three; a peer process with a core of its own holds it forever.)
func TestAttackRingFloodCloseHangs(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	tx := b.qp.tx
	tx.mu.Lock() // b's own sends stay out of the ring
	defer tx.mu.Unlock()
	capacity := uint64(tx.ring.Cap())
	if capacity%(recordHeaderSize+messageSize) != 0 {
		t.Fatalf("ring of %d bytes is not tiled by records", capacity)
	}
	rec := encoded(message{typ: msgUnmapAck, seq: 1 << 60})
	data := tx.mapping[ringOffset+ringHeaderSize:]
	for off := uint64(0); off+recordHeaderSize+messageSize <= capacity; off += recordHeaderSize + messageSize {
		binary.LittleEndian.PutUint64(data[off:], messageSize|1<<32)
		copy(data[off+recordHeaderSize:], rec)
	}
	sleeping := wordAt(tx.mapping, sleepingWord)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var wakeMu sync.Mutex
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			for {
				select {
				case <-stop:
					return
				default:
				}
				for range 1000 {
					head := atomic.LoadUint64(ringHead(tx.mapping))
					if atomic.LoadUint64(ringTail(tx.mapping)) < head+capacity {
						atomic.StoreUint64(ringTail(tx.mapping), head+capacity)
					}
					if sleeping.Load() == 1 {
						wakeMu.Lock()
						b.qp.wakePeerLocked()
						wakeMu.Unlock()
					}
				}
			}
		}()
	}
	time.Sleep(50 * time.Millisecond)
	took, ok := returnsWithin(500*time.Millisecond, func() { a.qp.Close() }, func() { close(stop) })
	if ok {
		close(stop)
	}
	wg.Wait()
	if !ok {
		t.Fatalf("Close of a queue pair whose peer floods its ring took %v (returned only when the flood stopped)", took)
	}
}

// recordHeaderSize and ringHeaderSize are mempool.Ring's record and ring
// headers.
const (
	recordHeaderSize = 8
	ringHeaderSize   = 192
)

// mapAtFake maps a region of acc at the fake peer f (it asks for
// it, as a peer about to write it would).
func mapAtFake(t *testing.T, acc *end, f *fakePeer) {
	t.Helper()
	f.send(message{typ: msgMapRequest, seq: 1, key: acc.mr.RemoteKey()})
	reply, fd := f.expect(msgMapReply)
	closeFD(fd)
	if reply.flags&flagFound == 0 || fd < 0 {
		t.Fatalf("map reply: %+v fd %d", reply, fd)
	}
}

// TestAttackDeregisterPeerNotReading: a peer that maps a region, then
// stops reading its socket while it keeps asking for things, fills the
// socket; Deregister must still give up after WithDeregisterTimeout, as it
// does for a peer that reads but never confirms.
func TestAttackDeregisterPeerNotReading(t *testing.T) {
	defer leakcheck.Check(t)
	const timeout = 100 * time.Millisecond
	acc := newEnd(t, New(WithDeregisterTimeout(timeout)), 4096, allRemote)
	defer acc.pd.Close()
	f := newFakePeer(t, acc, false)
	defer f.close()
	mapAtFake(t, acc, f)
	// Ask for unmaps of keys we never held until our socket is full of
	// confirmations we do not read: the acceptor's receiver blocks writing
	// one.
	f.c.SetWriteDeadline(time.Now().Add(2 * time.Second))
	for i := range 20000 {
		if err := writeMessage(f.c, &message{typ: msgUnmap, seq: uint64(i), key: 7}, -1); err != nil {
			break // our own socket is full too: the receiver stopped reading
		}
	}
	f.c.SetWriteDeadline(time.Time{})
	took, ok := returnsWithin(10*timeout+2*time.Second, func() { acc.mr.Deregister() }, func() { acc.qp.Close() })
	if !ok {
		t.Fatalf("Deregister with a peer that stopped reading did not return (returned %v after Close), want about %v", took, timeout)
	}
	if !waitState(acc.qp, verbs.QPError, time.Second) {
		t.Fatalf("queue pair is %v, want ERR", acc.qp.State())
	}
}

// TestAttackDeregisterPeerNotReadingRing is the same attack on the control
// rings: the peer drains its ring but keeps saying it sleeps, so every
// record we put costs a wake-up on a socket it does not read.
func TestAttackDeregisterPeerNotReadingRing(t *testing.T) {
	defer leakcheck.Check(t)
	const timeout = 100 * time.Millisecond
	acc := newEnd(t, New(WithDeregisterTimeout(timeout)), 4096, allRemote)
	defer acc.pd.Close()
	f := newFakePeer(t, acc, true)
	defer f.close()
	mapAtFake(t, acc, f)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	drained := make(chan struct{})
	go func() {
		// Drain our ring and say we sleep, never reading the socket.
		defer close(drained)
		for ctx.Err() == nil {
			f.rx.sleeping.Store(1)
			for {
				if _, ok := f.rx.ring.Read(); !ok {
					break
				}
				f.rx.ring.Release()
			}
			runtime.Gosched()
		}
	}()
	for i := range 50000 {
		if !f.tryPut(encoded(message{typ: msgUnmap, seq: uint64(i), key: 7}), 200*time.Millisecond) {
			break // the receiver stopped reading its ring: it is stuck
		}
	}
	took, ok := returnsWithin(10*timeout+2*time.Second, func() { acc.mr.Deregister() }, func() { acc.qp.Close() })
	cancel()
	<-drained
	if !ok {
		t.Fatalf("Deregister with a peer that stopped reading did not return (returned %v after Close), want about %v", took, timeout)
	}
	if !waitState(acc.qp, verbs.QPError, time.Second) {
		t.Fatalf("queue pair is %v, want ERR", acc.qp.State())
	}
}

// moreQP makes another queue pair, with its own completion queue, in e's
// domain; it shares e's region.
func moreQP(t *testing.T, e *end) *end {
	t.Helper()
	cq, err := e.pd.NewCompletionQueue(256)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := e.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 128, MaxRecv: 128})
	if err != nil {
		t.Fatal(err)
	}
	return &end{pd: e.pd, cq: cq, qp: qp.(*queuePair), mem: e.mem, mr: e.mr}
}

func (e *end) closeQP() {
	e.qp.Close()
	e.cq.Close()
}

// connectEnds connects the queue pairs of x and y.
func connectEnds(t *testing.T, x, y *end) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- y.qp.Connect(ctx, x.qp.LocalInfo()) }()
	err := x.qp.Connect(ctx, y.qp.LocalInfo())
	if err2 := <-errc; err == nil {
		err = err2
	}
	if err != nil {
		t.Fatal(err)
	}
}

// pollNone reports a completion that arrives on cq within d, if any.
func pollNone(cq verbs.CompletionQueue, d time.Duration) (verbs.Completion, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cs := make([]verbs.Completion, 1)
	if n, err := cq.Wait(ctx, cs); err == nil && n == 1 {
		return cs[0], true
	}
	return verbs.Completion{}, false
}

// TestAttackMalformedControlMessages plays a peer that sends malformed or
// out-of-place control messages, each on a queue pair of its own in one
// domain: each fails only its queue pair (ERR, nothing written outside the
// Recv), leaves no fd behind, and a queue pair of the same domain with an
// honest peer keeps working. Well-formed messages from the same fake peer
// are served, which shows the harness speaks the protocol.
func TestAttackMalformedControlMessages(t *testing.T) {
	defer leakcheck.Check(t)
	p := New(WithRNRTimeout(50 * time.Millisecond))
	acc := newEnd(t, p, 4096, allRemote)
	defer acc.pd.Close()
	honest := newEnd(t, p, 4096, allRemote)
	defer honest.pd.Close()
	steady := moreQP(t, acc)
	connectEnds(t, steady, honest)
	sendRecv(t, steady, honest, 64)

	recv := func(t *testing.T, q *end, n int) {
		t.Helper()
		if err := q.qp.PostRecv(verbs.RecvRequest{ID: 77, Local: verbs.Local{Region: q.mr, Length: n}}); err != nil {
			t.Fatal(err)
		}
	}
	ack := func(t *testing.T, f *fakePeer, seq uint64, want verbs.Status) {
		t.Helper()
		m, fd := f.expect(msgAck)
		closeFD(fd)
		if m.seq != seq || m.status != want {
			t.Fatalf("ack %d %v, want %d %v", m.seq, m.status, seq, want)
		}
	}
	completion := func(t *testing.T, q *end, want verbs.Status) verbs.Completion {
		t.Helper()
		c := waitOne(t, q.cq)
		if c.Status != want {
			t.Fatalf("completion %+v, want status %v", c, want)
		}
		return c
	}
	memfd := sealedMemory(t, 1<<16)
	raw := func(b0, b3 byte) []byte {
		b := encoded(message{typ: msgUnmapAck, seq: 1})
		b[0], b[3] = b0, b3
		return b
	}
	for _, tc := range []struct {
		name   string
		ring   bool
		broken bool // the queue pair must go to ERR
		act    func(t *testing.T, q *end, f *fakePeer)
	}{
		{"good Send in two chunks", true, false, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 64)
			copy(f.staging[stagingHeader:], "0123456789")
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 20})
			ack(t, f, 1, verbs.StatusSuccess)
			copy(f.staging[stagingHeader:], "abcdefghij")
			f.send(message{typ: msgSend, seq: 2, flags: flagLast | flagHasImm, imm: 5, offset: 10, length: 10, total: 20})
			ack(t, f, 2, verbs.StatusSuccess)
			if c := completion(t, q, verbs.StatusSuccess); c.Len != 20 || !c.HasImm || c.Imm != 5 || string(q.mr.Bytes()[:20]) != "0123456789abcdefghij" {
				t.Fatalf("receive %+v %q", c, q.mr.Bytes()[:20])
			}
		}},
		{"good WriteImm", true, false, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 0)
			f.send(message{typ: msgWriteImm, seq: 1, imm: 9, key: q.mr.RemoteKey(), length: 64})
			ack(t, f, 1, verbs.StatusSuccess)
			if c := completion(t, q, verbs.StatusSuccess); c.Op != verbs.OpRecvImm || c.Len != 64 || c.Imm != 9 || c.Key != q.mr.RemoteKey() {
				t.Fatalf("receive %+v", c)
			}
		}},
		{"WriteImm without a Recv", true, false, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgWriteImm, seq: 1, imm: 9, key: q.mr.RemoteKey(), length: 64})
			ack(t, f, 1, verbs.StatusReceiverNotReady)
		}},
		{"unrequested acks and unmap confirmations", true, false, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgUnmapAck, seq: 12345})
			f.send(message{typ: msgAck, seq: 999}) // parked for a request that will not come
			time.Sleep(20 * time.Millisecond)
		}},
		{"second unrequested ack", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgAck, seq: 999})
			f.send(message{typ: msgAck, seq: 1000})
		}},
		{"Send chunk past the staging buffer", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, flags: flagLast, length: 4097, total: 4097})
		}},
		{"Send chunk past its message", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, flags: flagLast, offset: 0, length: 100, total: 50})
		}},
		{"Send chunk offset wraps", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, flags: flagLast, offset: ^uint64(0) - 5, length: 10, total: 4})
		}},
		{"Send of a huge message", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 1 << 63})
		}},
		{"Send last flag lies", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, flags: flagLast, length: 10, total: 20})
		}},
		{"empty middle chunk", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 20})
			ack(t, f, 1, verbs.StatusSuccess)
			f.send(message{typ: msgSend, seq: 2, offset: 10, length: 0, total: 20})
		}},
		{"chunk that skips ahead", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 30})
			ack(t, f, 1, verbs.StatusSuccess)
			f.send(message{typ: msgSend, seq: 2, offset: 20, length: 10, total: 30, flags: flagLast})
		}},
		{"chunk of another total", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 64)
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 20})
			ack(t, f, 1, verbs.StatusSuccess)
			f.send(message{typ: msgSend, seq: 2, offset: 10, length: 4000, total: 4010, flags: flagLast})
		}},
		{"continuation without a start", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, offset: 10, length: 10, total: 20, flags: flagLast})
		}},
		{"new Send while one is incomplete", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 20})
			ack(t, f, 1, verbs.StatusSuccess)
			f.send(message{typ: msgWriteImm, seq: 2, key: q.mr.RemoteKey(), length: 1})
		}},
		{"Send larger than the Recv", true, true, func(t *testing.T, q *end, f *fakePeer) {
			for i := range q.mr.Bytes() {
				q.mr.Bytes()[i] = 0xaa
			}
			recv(t, q, 64)
			for i := range f.staging[stagingHeader:] {
				f.staging[stagingHeader+i] = 0x55
			}
			f.send(message{typ: msgSend, seq: 1, flags: flagLast, length: 100, total: 100})
			ack(t, f, 1, verbs.StatusRemoteInvalidRequest)
			completion(t, q, verbs.StatusLocalLength)
			for i, b := range q.mr.Bytes() {
				if b != 0xaa {
					t.Fatalf("byte %d of the region was written by a refused Send", i)
				}
			}
		}},
		{"unrequested map reply with an fd", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgMapReply, flags: flagFound, seq: 1, key: 5, addr: 1 << 20, length: 4096, access: allRemote}, memfd.FD)
		}},
		{"unrequested map reply on the socket", false, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgMapReply, flags: flagFound, seq: 0, key: 0, addr: 1 << 20, length: 4096, access: allRemote}, memfd.FD)
		}},
		{"ack carrying fds", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgAck, seq: 1}, memfd.FD, memfd.FD)
		}},
		{"unmap carrying an fd on the socket", false, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgUnmap, seq: 1, key: 5}, memfd.FD)
		}},
		{"grant announcement with flagFD", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgGrant, flags: flagFound | flagRegion, key: 5}, memfd.FD)
		}},
		{"grant announcement with bad flags", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgGrant, flags: flagFound, key: 5})
		}},
		{"hello in the ring", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgHello})
		}},
		{"wake-up in the ring", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgWake})
		}},
		{"fd record in the ring", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.send(message{typ: msgFD, seq: 3})
		}},
		{"unknown type", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.putRecord(raw(200, 0))
		}},
		{"reserved byte", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.putRecord(raw(byte(msgUnmapAck), 1))
		}},
		{"long record", true, true, func(t *testing.T, q *end, f *fakePeer) {
			f.putRecord(append(encoded(message{typ: msgUnmapAck}), 0, 0, 0, 0, 0, 0, 0, 0))
		}},
		{"long socket message", false, true, func(t *testing.T, q *end, f *fakePeer) {
			f.c.Write(make([]byte, 4*messageSize))
		}},
		{"empty socket message", false, true, func(t *testing.T, q *end, f *fakePeer) {
			f.c.Write(nil)
		}},
		{"socket message with too many fds", false, true, func(t *testing.T, q *end, f *fakePeer) {
			b := encoded(message{typ: msgUnmapAck, seq: 1})
			fds := make([]int, 8)
			for i := range fds {
				fds[i] = memfd.FD
			}
			f.c.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
			// The queue pair may have broken on the fds already and, its
			// goroutines ended, closed the connection: no error to check.
			writeMessage(f.c, &message{typ: msgHello})
		}},
		{"fd message without a record", true, true, func(t *testing.T, q *end, f *fakePeer) {
			time.Sleep(10 * time.Millisecond) // let the receiver fall asleep
			writeMessage(f.c, &message{typ: msgFD, seq: 1}, memfd.FD)
		}},
		{"peer shuts down mid-Send", true, true, func(t *testing.T, q *end, f *fakePeer) {
			recv(t, q, 4096)
			f.send(message{typ: msgSend, seq: 1, length: 10, total: 20})
			ack(t, f, 1, verbs.StatusSuccess)
			f.c.CloseWrite()
			completion(t, q, verbs.StatusFlushed)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := openFDs(t)
			q := moreQP(t, acc)
			f := newFakePeer(t, q, tc.ring)
			tc.act(t, q, f)
			if tc.broken {
				if !waitState(q.qp, verbs.QPError, 5*time.Second) {
					t.Fatalf("the queue pair is %v after the attack, want ERR", q.qp.State())
				}
			} else if st := q.qp.State(); st != verbs.QPReadyToSend {
				t.Fatalf("the queue pair is %v after well-formed messages, want RTS", st)
			}
			f.close()
			q.closeQP()
			if after := openFDs(t); after != before {
				t.Errorf("%d fds open before the attack, %d after", before, after)
			}
		})
	}
	if st := steady.qp.State(); st != verbs.QPReadyToSend {
		t.Fatalf("a queue pair of the attacked domain is %v, want RTS", st)
	}
	sendRecv(t, steady, honest, 64)
	sendRecv(t, honest, steady, 64)
}

// rawMemfd makes a memfd of size bytes with seals, not mapped (so that
// F_SEAL_WRITE can be added); the test closes it.
func rawMemfd(t *testing.T, size int, seals int) int {
	t.Helper()
	fd, err := unix.MemfdCreate("attack", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		t.Fatal(err)
	}
	return fd
}

// TestAttackForgedMapReplies plays a peer that answers our question for a
// region with forged bounds, rights, offsets and fds: each is refused
// (StatusRemoteAccess, or StatusTransport for a protocol violation), the
// queue pair goes to ERR, nothing stays mapped and no fd is left. A good
// answer is served, and then only within its bounds and rights.
func TestAttackForgedMapReplies(t *testing.T) {
	defer leakcheck.Check(t)
	acc := newEnd(t, New(), 4096, allRemote)
	defer acc.pd.Close()
	const key, addr = 0x1234, 1 << 20
	good := sealedMemory(t, 1<<16)
	rdonly, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", good.FD), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rdonly)
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	writeSealed := rawMemfd(t, 1<<16, unix.F_SEAL_SHRINK|unix.F_SEAL_WRITE)
	unsealed := memfdMemory(t, 1<<16, 0)
	short := sealedMemory(t, 4096)
	region := func(acc verbs.Access, off, n uint64) message {
		return message{flags: flagFound, access: acc, addr: addr, offset: off, length: n}
	}
	grant := func(acc verbs.Access, off, n, regOff, regLen uint64) message {
		m := message{flags: flagFound | flagRegion, access: acc, addr: addr, offset: off, length: n, total: 1}
		m.setRegionRange(regOff, regLen)
		return m
	}
	const rw = verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	for _, tc := range []struct {
		name   string
		reply  message
		fds    []int
		want   verbs.Status
		cached int // announcements kept: a good one that does not allow the Write
	}{
		{"not found", message{}, nil, verbs.StatusRemoteAccess, 0},
		{"found without an fd", region(rw, 0, 4096), nil, verbs.StatusRemoteAccess, 0},
		{"a pipe", region(rw, 0, 4096), []int{pipe[0]}, verbs.StatusRemoteAccess, 0},
		{"an unsealed memfd", region(rw, 0, 4096), []int{unsealed.FD}, verbs.StatusRemoteAccess, 0},
		{"past the end of the memfd", region(rw, 0, 8192), []int{short.FD}, verbs.StatusRemoteAccess, 0},
		{"offset past the end", region(rw, 1<<16, 4096), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"offset near 2^64", region(rw, ^uint64(0)-100, 4096), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"offset 2^63", region(rw, 1<<63, 4096), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"length 2^62", region(rw, 0, 1<<62), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"empty", region(rw, 0, 0), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"address wraps", func() message { m := region(rw, 0, 4096); m.addr = ^uint64(0) - 10; return m }(), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"unknown rights", region(rw|1<<20, 0, 4096), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"read-only region", region(verbs.AccessRemoteRead, 0, 4096), []int{good.FD}, verbs.StatusRemoteAccess, 1},
		{"writable region, write-sealed memfd", region(rw, 0, 4096), []int{writeSealed}, verbs.StatusRemoteAccess, 0},
		{"writable region, read-only fd", region(rw, 0, 4096), []int{rdonly}, verbs.StatusRemoteAccess, 0},
		{"two fds", region(rw, 0, 4096), []int{good.FD, good.FD}, verbs.StatusTransport, 0},
		{"grant with two rights", grant(rw, 0, 4096, 0, 1<<16), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"grant past its region", grant(verbs.AccessRemoteWrite, 4000, 4096, 0, 8000), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"grant in a region past the memfd", grant(verbs.AccessRemoteWrite, 0, 4096, 4096, 1<<16), []int{good.FD}, verbs.StatusRemoteAccess, 0},
		{"grant of a region never exposed", grant(verbs.AccessRemoteWrite, 0, 4096, 0, 1<<16), nil, verbs.StatusRemoteAccess, 0},
		{"grant, read right", grant(verbs.AccessRemoteRead, 0, 4096, 0, 1<<16), []int{good.FD}, verbs.StatusRemoteAccess, 2},
		{"grant too short for the write", grant(verbs.AccessRemoteWrite, 0, 63, 0, 1<<16), []int{good.FD}, verbs.StatusRemoteAccess, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(good.Bytes)
			before := openFDs(t)
			q := moreQP(t, acc)
			defer q.closeQP()
			f := newFakePeer(t, q, true)
			defer f.close()
			copy(q.mr.Bytes(), "forged replies must not get this")
			if err := q.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: q.mr, Length: 64}, Remote: verbs.Remote{Addr: addr, Key: key}}); err != nil {
				t.Fatal(err)
			}
			req, fd := f.expect(msgMapRequest)
			closeFD(fd)
			if req.key != key {
				t.Fatalf("asked for key %#x, want %#x", req.key, key)
			}
			reply := tc.reply
			reply.typ, reply.seq, reply.key = msgMapReply, req.seq, req.key
			f.send(reply, tc.fds...)
			if c := waitOne(t, q.cq); c.Status != tc.want {
				t.Fatalf("the Write completed with %v (%v), want %v", c.Status, c.Err, tc.want)
			}
			if !waitState(q.qp, verbs.QPError, 5*time.Second) {
				t.Fatalf("queue pair is %v, want ERR", q.qp.State())
			}
			if strings.Contains(string(good.Bytes), "forged replies") {
				t.Fatal("a refused Write landed in the peer's memory")
			}
			q.qp.remoteMu.RLock()
			n := len(q.qp.remote) + len(q.qp.peerRegions)
			q.qp.remoteMu.RUnlock()
			if n != tc.cached {
				t.Fatalf("%d announcements cached after the refusal, want %d", n, tc.cached)
			}
			f.close()
			q.closeQP()
			if after := openFDs(t); after != before {
				t.Errorf("%d fds open before the attack, %d after", before, after)
			}
		})
	}

	// A good answer: a Write lands where it says, and one past its end
	// is refused.
	q := moreQP(t, acc)
	defer q.closeQP()
	f := newFakePeer(t, q, true)
	defer f.close()
	copy(q.mr.Bytes(), "a good reply gets this")
	write := func(at uint64, n int) verbs.Completion {
		t.Helper()
		if err := q.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: q.mr, Length: n}, Remote: verbs.Remote{Addr: at, Key: key}}); err != nil {
			t.Fatal(err)
		}
		return waitOne(t, q.cq)
	}
	go func() {
		req, fd := f.expect(msgMapRequest)
		closeFD(fd)
		reply := region(rw, 8192, 4096)
		reply.typ, reply.seq, reply.key = msgMapReply, req.seq, req.key
		f.send(reply, good.FD)
	}()
	if c := write(addr+100, 22); c.Status != verbs.StatusSuccess {
		t.Fatalf("Write to a well-announced region: %v", verbs.CompletionError(c))
	}
	if string(good.Bytes[8192+100:8192+122]) != "a good reply gets this" {
		t.Fatal("the Write did not land at the announced offset")
	}
	if c := write(addr+4096-10, 11); c.Status != verbs.StatusRemoteAccess {
		t.Fatalf("Write past the announced region: %v, want StatusRemoteAccess", c.Status)
	}
	if !waitState(q.qp, verbs.QPError, 5*time.Second) {
		t.Fatalf("queue pair is %v, want ERR", q.qp.State())
	}
}

// TestAttackPeerAsksForKeys plays a peer that asks for keys it may not
// have: an unknown key, a region without remote rights, a grant made on
// another queue pair of the domain and a revoked grant are not found; the
// grant made on its own queue pair is, with its bounds and its region's
// fd. The queue pair stays usable.
func TestAttackPeerAsksForKeys(t *testing.T) {
	defer leakcheck.Check(t)
	acc := newEnd(t, New(), 1<<16, allRemote)
	defer acc.pd.Close()
	q := moreQP(t, acc)
	defer q.closeQP()
	f := newFakePeer(t, q, true)
	defer f.close()
	other := moreQP(t, acc)
	defer other.closeQP()
	theirs, err := other.qp.Grant(acc.mr, 0, 4096, verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	local, err := acc.pd.RegisterMemory(sealedMemory(t, 4096), verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := q.qp.Grant(acc.mr, 8192, 100, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	seq := uint64(0)
	ask := func(key uint32) (message, int) {
		t.Helper()
		seq++
		f.send(message{typ: msgMapRequest, seq: seq, key: key})
		m, fd := f.expect(msgMapReply)
		if m.seq != seq || m.key != key {
			closeFD(fd)
			t.Fatalf("reply %+v to request %d for key %#x", m, seq, key)
		}
		return m, fd
	}
	notFound := func(what string, key uint32) {
		t.Helper()
		m, fd := ask(key)
		closeFD(fd)
		if m.flags&flagFound != 0 || fd >= 0 {
			t.Errorf("%s: found (%+v, fd %d)", what, m, fd)
		}
	}
	notFound("an unknown key", mine.Remote().Key^theirs.Remote().Key^local.RemoteKey()^0x5a5a5a5a)
	notFound("a region without remote rights", local.RemoteKey())
	notFound("a grant of another queue pair", theirs.Remote().Key)
	m, fd := ask(mine.Remote().Key)
	closeFD(fd)
	if m.flags&^flagFD != flagFound|flagRegion || fd < 0 || m.access != verbs.AccessRemoteRead || m.length != 100 || m.addr != acc.mr.Addr()+8192 {
		t.Fatalf("own grant: %+v fd %d", m, fd)
	}
	revoked := make(chan error, 1)
	go func() { revoked <- mine.Revoke() }()
	u, fd := f.expect(msgUnmap)
	closeFD(fd)
	f.send(message{typ: msgUnmapAck, seq: u.seq})
	if err := <-revoked; err != nil {
		t.Fatal(err)
	}
	notFound("a revoked grant", mine.Remote().Key)
	if st := q.qp.State(); st != verbs.QPReadyToSend {
		t.Fatalf("queue pair is %v, want RTS", st)
	}
}

// TestAttackWriteImmForgedKey plays a peer that rings a WriteImm doorbell
// naming a key it holds no write right to (a grant made on another queue
// pair of the domain) and a length past that grant. Completion.Key is
// documented as the key the WriteImm wrote through, which a receiver may
// check (tcp checks key, rights and bounds at the target before it takes
// the Recv); shm must refuse such a doorbell too, not complete the Recv
// with the forged key and length.
func TestAttackWriteImmForgedKey(t *testing.T) {
	defer leakcheck.Check(t)
	acc := newEnd(t, New(), 4096, allRemote)
	defer acc.pd.Close()
	q := moreQP(t, acc)
	defer q.closeQP()
	f := newFakePeer(t, q, true)
	defer f.close()
	other := moreQP(t, acc)
	defer other.closeQP()
	theirs, err := other.qp.Grant(acc.mr, 0, 100, verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := q.qp.PostRecv(verbs.RecvRequest{ID: 1}); err != nil {
		t.Fatal(err)
	}
	f.send(message{typ: msgWriteImm, seq: 1, imm: 7, key: theirs.Remote().Key, length: 1 << 40})
	if c, ok := pollNone(q.cq, time.Second); ok && c.Status == verbs.StatusSuccess {
		t.Fatalf("a doorbell with a key of another queue pair's grant and %d bytes completed the Recv: %+v", uint64(1<<40), c)
	}
}

// TestAttackHugetlbMemfdRefused: a memfd on hugetlbfs maps and unmaps
// only in whole huge pages, so a window of it at any offset could not be
// mapped, or stay mapped; such a memfd from a peer (or given to
// RegisterMemory) is refused before anything maps it.
func TestAttackHugetlbMemfdRefused(t *testing.T) {
	fd, err := unix.MemfdCreate("shm-test-huge", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_HUGETLB)
	if err != nil {
		testenv.Need(t, "a kernel with hugetlbfs memfds (memfd_create MFD_HUGETLB: %v)", err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 2<<20); err != nil {
		t.Fatalf("ftruncate: %v", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		t.Fatalf("F_ADD_SEALS: %v", err)
	}
	if err := checkSealedFD(fd, 4096); err == nil || !strings.Contains(err.Error(), "hugetlbfs") {
		t.Fatalf("checkSealedFD of a sealed hugetlbfs memfd: %v, want a refusal naming hugetlbfs", err)
	}
	if _, err := mapPeerMemory(fd, 4096, 4096, false); err == nil {
		t.Fatal("a peer's hugetlbfs memfd was mapped")
	}
}
