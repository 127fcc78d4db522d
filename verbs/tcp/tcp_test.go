package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc/infotest"
)

// newTestQP opens a domain with one queue pair on a shared CQ.
func newTestQP(t *testing.T, opts ...Option) (*domain, *queuePair, *softrc.CQ) {
	t.Helper()
	pd, err := New(opts...).Open("")
	if err != nil {
		t.Fatal(err)
	}
	cq, err := pd.NewCompletionQueue(4096)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	return pd.(*domain), qp.(*queuePair), cq.(*softrc.CQ)
}

// dialWith dials the queue pair's listener and presents a hello.
func dialWith(t *testing.T, qp *queuePair, h hello) (net.Conn, byte, error) {
	t.Helper()
	in, err := parseInfo(qp.LocalInfo())
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", in.Addr)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(encodeHello(h)); err != nil {
		c.Close()
		return nil, 0, err
	}
	status, err := readReply(c)
	if err != nil {
		c.Close()
		return nil, 0, err
	}
	return c, status, nil
}

// refused reports whether a handshake attempt was refused: by a refusal
// reply or by the connection being closed.
func refused(c net.Conn, status byte, err error) bool {
	if c != nil {
		c.Close()
	}
	return err != nil || status == handshakeRefused
}

func TestHandshakeRejectsWrongSecret(t *testing.T) {
	defer leakcheck.Check(t)
	pd, qp, _ := newTestQP(t)
	defer pd.Close()

	var wrong secret
	wrong[0] = 1
	if c, st, err := dialWith(t, qp, hello{Acceptor: wrong, Dialer: wrong, QPID: qp.ID}); !refused(c, st, err) {
		t.Fatal("a connection presenting a wrong secret was accepted")
	}
	if c, st, err := dialWith(t, qp, hello{Acceptor: qp.Secret, Dialer: wrong, QPID: qp.ID + 1}); !refused(c, st, err) {
		t.Fatal("a connection naming the wrong queue pair was accepted")
	}

	// The right acceptor secret but not the dialer the peer's info names:
	// refused once the queue pair's Connect knows the peer.
	// The smallest nonzero secret: the queue pair under test accepts.
	peer := softrc.Info{Secret: secret{secretSize - 1: 1}, QPID: 7, Addr: "127.0.0.1:9"}
	var forged secret
	forged[0] = 0xfe
	forgedDone := make(chan bool, 1)
	go func() {
		c, st, err := dialWith(t, qp, hello{Acceptor: qp.Secret, Dialer: forged, QPID: qp.ID})
		forgedDone <- refused(c, st, err)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err := qp.Connect(ctx, peer.Encode(infoMagic))
	cancel()
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Connect with only a forged dialer: %v, want a deadline error", err)
	}
	if !<-forgedDone {
		t.Fatal("a connection presenting a forged dialer secret was accepted")
	}
	if st := qp.State(); st != verbs.QPReset {
		t.Fatalf("after a failed Connect the queue pair is in %v", st)
	}
}

func TestHandshakeSecretIsOneTime(t *testing.T) {
	defer leakcheck.Check(t)
	pdA, a, _ := newTestQP(t)
	defer pdA.Close()
	pdB, b, _ := newTestQP(t)
	defer pdB.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- b.Connect(ctx, a.LocalInfo()) }()
	if err := a.Connect(ctx, b.LocalInfo()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// Replaying the handshake that connected the pair is refused by
	// whichever side accepted it.
	acceptor, dialer := a, b
	if bytes.Compare(a.Secret[:], b.Secret[:]) < 0 {
		acceptor, dialer = b, a
	}
	if c, st, err := dialWith(t, acceptor, hello{Acceptor: acceptor.Secret, Dialer: dialer.Secret, QPID: acceptor.ID}); !refused(c, st, err) {
		t.Fatal("a replayed handshake was accepted")
	}
	if err := a.Connect(ctx, b.LocalInfo()); err == nil {
		t.Fatal("a second Connect succeeded")
	}
}

func TestParseInfoRoundTrip(t *testing.T) {
	for _, in := range []softrc.Info{
		{Secret: secret{1, 2, 3}, QPID: 42, Addr: "[::1]:1234"},
		{Role: verbs.RoleAccept, Secret: secret{1, 2, 3}, QPID: 42, Addr: "10.0.0.1:1234"},
		{Role: verbs.RoleDial, Secret: secret{4}, QPID: 43},
	} {
		got, err := parseInfo(in.Encode(infoMagic))
		if err != nil || got != in {
			t.Fatalf("parseInfo(encode(%+v)) = %+v, %v", in, got, err)
		}
	}
}

func TestParseInfoRejectsGarbage(t *testing.T) {
	good := softrc.Info{Secret: secret{9}, QPID: 1, Addr: "127.0.0.1:80"}.Encode(infoMagic)
	bad := [][]byte{
		nil, {}, []byte(infoMagic), good[:len(good)-1], append(bytes.Clone(good), 0),
		softrc.Info{Secret: secret{9}, Addr: "127.0.0.1"}.Encode(infoMagic),
		softrc.Info{Secret: secret{9}, Addr: "127.0.0.1:0"}.Encode(infoMagic),
		softrc.Info{Secret: secret{9}, Addr: ":80"}.Encode(infoMagic),
		softrc.Info{Secret: secret{9}, Addr: "127.0.0.1:99999"}.Encode(infoMagic),
		softrc.Info{Addr: "127.0.0.1:80"}.Encode(infoMagic),
		// Only a dialing queue pair has no address, and it has none.
		softrc.Info{Secret: secret{9}}.Encode(infoMagic),
		softrc.Info{Role: verbs.RoleAccept, Secret: secret{9}}.Encode(infoMagic),
		softrc.Info{Role: verbs.RoleDial, Secret: secret{9}, Addr: "127.0.0.1:80"}.Encode(infoMagic),
		softrc.Info{Role: verbs.RoleAccept + 1, Secret: secret{9}, Addr: "127.0.0.1:80"}.Encode(infoMagic),
		softrc.Info{Role: 0xff, Secret: secret{9}}.Encode(infoMagic),
		softrc.Info{Role: verbs.RoleDial}.Encode(infoMagic),
	}
	for _, v := range []byte{0, 1, 2, 0xff} {
		old := bytes.Clone(good)
		old[4] = v // the version
		bad = append(bad, old)
	}
	// Version 2 had no magic and the role right after the version.
	v2 := append([]byte{2, 0}, good[22:]...)
	bad = append(bad, v2)
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		b := make([]byte, r.IntN(80))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		bad = append(bad, b)
	}
	for _, b := range bad {
		if _, err := parseInfo(b); !errors.Is(err, verbs.ErrInvalidInfo) {
			// Random bytes may, very rarely, be well formed.
			if len(b) >= 48 && string(b[:4]) == infoMagic {
				continue
			}
			t.Fatalf("parseInfo(%x) = %v, want ErrInvalidInfo", b, err)
		}
	}
}

func FuzzParseInfo(f *testing.F) {
	f.Add(softrc.Info{Secret: secret{9}, QPID: 1, Addr: "127.0.0.1:80"}.Encode(infoMagic))
	f.Add(softrc.Info{Role: verbs.RoleDial, Secret: secret{9}, QPID: 1}.Encode(infoMagic))
	f.Add(softrc.Info{Role: verbs.RoleAccept, Secret: secret{9}, QPID: 1, Addr: "[::1]:80"}.Encode(infoMagic))
	f.Add([]byte(infoMagic + "\x03\x00"))
	f.Add([]byte{})
	infotest.Fuzz(f, infoMagic, parseInfo)
}

func FuzzParseHeader(f *testing.F) {
	var b [headerSize]byte
	(&header{op: frameWrite, key: 1, seq: 2, addr: 3, length: 4}).put(b[:])
	f.Add(b[:])
	f.Add(make([]byte, headerSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseHeader(b)
		if err != nil {
			return
		}
		var out [headerSize]byte
		h.put(out[:])
		if !bytes.Equal(out[:], b[:headerSize]) {
			t.Fatalf("parseHeader(%x) = %+v, which encodes as %x", b, h, out)
		}
	})
}

// fakePeer connects a queue pair to a test-controlled socket that speaks
// the handshake and then whatever the test writes.
func fakePeer(t *testing.T, qp *queuePair) net.Conn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var s secret
	for i := range s {
		s[i] = 0xff // larger than any real secret but all-ones: the queue pair dials
	}
	peer := softrc.Info{Secret: s, QPID: 99, Addr: ln.Addr().String()}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		h, err := readHello(c)
		if err != nil || h.Acceptor != s || h.Dialer != qp.Secret || h.QPID != 99 {
			c.Close()
			accepted <- nil
			return
		}
		c.Write(replyBytes(handshakeOK))
		accepted <- c
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := qp.Connect(ctx, peer.Encode(infoMagic)); err != nil {
		t.Fatal(err)
	}
	c := <-accepted
	if c == nil {
		t.Fatal("the fake peer did not see a valid handshake")
	}
	return c
}

func frame(h header, payload []byte) []byte {
	b := make([]byte, headerSize, headerSize+len(payload))
	h.put(b)
	return append(b, payload...)
}

// TestHostilePeer feeds a queue pair malformed and malicious frames: each
// moves it to ERR and flushes its receives; none panics or touches memory.
func TestHostilePeer(t *testing.T) {
	cases := []struct {
		name  string
		bytes func(key uint32, addr uint64) []byte
	}{
		{"UnknownOpcode", func(uint32, uint64) []byte { return frame(header{op: 77}, nil) }},
		{"ReservedBits", func(uint32, uint64) []byte {
			b := frame(header{op: frameWrite}, nil)
			b[3] = 1
			return b
		}},
		{"HugeLength", func(key uint32, addr uint64) []byte {
			return frame(header{op: frameWrite, key: key, addr: addr, length: 1 << 63}, nil)
		}},
		{"OutOfBoundsWithPayload", func(key uint32, addr uint64) []byte {
			return frame(header{op: frameWrite, key: key, addr: addr + 60, seq: 1, length: 8}, bytes.Repeat([]byte{0xee}, 8))
		}},
		{"AckOfNothing", func(uint32, uint64) []byte { return frame(header{op: frameAck, seq: 5}, nil) }},
		{"ReadResponseOfNothing", func(uint32, uint64) []byte {
			return frame(header{op: frameReadResp, seq: 1, length: 4}, []byte{1, 2, 3, 4})
		}},
		{"TruncatedPayload", func(key uint32, addr uint64) []byte {
			return frame(header{op: frameWrite, key: key, addr: addr, seq: 1, length: 64}, []byte{1, 2, 3})
		}},
		{"TruncatedHeader", func(uint32, uint64) []byte { return []byte{frameWrite, 0, 0} }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			pd, qp, cq := newTestQP(t, WithLingerTimeout(200*time.Millisecond))
			defer pd.Close()
			mr, err := pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 64)}, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
			if err != nil {
				t.Fatal(err)
			}
			if err := qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: mr, Length: 64}}); err != nil {
				t.Fatal(err)
			}
			c := fakePeer(t, qp)
			defer c.Close()
			c.Write(tc.bytes(mr.RemoteKey(), mr.Addr()))
			if tc.name == "TruncatedPayload" || tc.name == "TruncatedHeader" {
				c.(*net.TCPConn).CloseWrite()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			out := make([]verbs.Completion, 1)
			if n, err := cq.Wait(ctx, out); err != nil || n != 1 || out[0].ID != 1 || out[0].Status == verbs.StatusSuccess {
				t.Fatalf("receive completion %v, %v: want the receive flushed", out[:n], err)
			}
			if st := qp.State(); st != verbs.QPError {
				t.Fatalf("queue pair in %v, want ERR", st)
			}
			if !bytes.Equal(mr.Bytes(), make([]byte, 64)) && tc.name != "TruncatedPayload" {
				t.Fatalf("region changed: %x", mr.Bytes())
			}
			io.Copy(io.Discard, c) // the queue pair closes its side
		})
	}
}

func TestRNRTimeout(t *testing.T) {
	defer leakcheck.Check(t)
	p := New(WithRNRTimeout(50 * time.Millisecond))
	a, b := openPair(t, p)
	defer a.pd.Close()
	defer b.pd.Close()
	mr, _ := a.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 8)}, verbs.AccessLocalWrite)
	if err := a.qp.PostSend(verbs.SendRequest{ID: 3, Op: verbs.OpSend, Local: verbs.Local{Region: mr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := make([]verbs.Completion, 1)
	if n, err := a.cq.Wait(ctx, out); err != nil || n != 1 || out[0].Status != verbs.StatusReceiverNotReady {
		t.Fatalf("send completion %v, %v: want receiver not ready", out[:n], err)
	}
	if a.qp.State() != verbs.QPError {
		t.Fatalf("sender in %v after RNR, want ERR", a.qp.State())
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.qp.State() != verbs.QPError && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if b.qp.State() != verbs.QPError {
		t.Fatalf("receiver in %v after RNR, want ERR", b.qp.State())
	}
}

func TestCompletionQueueReservation(t *testing.T) {
	defer leakcheck.Check(t)
	pd, err := New().Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	cq, _ := pd.NewCompletionQueue(100)
	if _, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq}); !errors.Is(err, verbs.ErrQueueFull) {
		t.Fatalf("NewQueuePair with 2048 requests on a queue of 100: %v, want ErrQueueFull", err)
	}
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 50, MaxRecv: 50})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 1, MaxRecv: 1}); !errors.Is(err, verbs.ErrQueueFull) {
		t.Fatalf("NewQueuePair on a fully reserved queue: %v, want ErrQueueFull", err)
	}
	qp.Close()
	if qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 1, MaxRecv: 1}); err != nil {
		t.Fatalf("NewQueuePair after the reservation was released: %v", err)
	} else {
		qp.Close()
	}
}

func TestAdvertiseAddress(t *testing.T) {
	defer leakcheck.Check(t)
	p := New(WithAdvertiseAddress("localhost"))
	devs, err := p.Devices()
	if err != nil || len(devs) != 1 || !strings.Contains(devs[0].Description, "localhost") {
		t.Fatalf("Devices() = %v, %v", devs, err)
	}
	a, b := openPair(t, p)
	defer a.pd.Close()
	defer b.pd.Close()
	in, _ := parseInfo(a.qp.LocalInfo())
	if !strings.HasPrefix(in.Addr, "localhost:") {
		t.Fatalf("advertised address %q, want localhost:port", in.Addr)
	}
	if _, err := p.Open("mlx5_0"); !errors.Is(err, verbs.ErrNoDevice) {
		t.Fatalf("Open(mlx5_0) = %v, want ErrNoDevice", err)
	}
}

// end is one side of a connected pair in these tests.
type end struct {
	pd verbs.ProtectionDomain
	cq verbs.CompletionQueue
	qp verbs.QueuePair
}

func openPair(t *testing.T, p verbs.Provider) (a, b end) {
	t.Helper()
	for _, e := range []*end{&a, &b} {
		var err error
		if e.pd, err = p.Open(""); err != nil {
			t.Fatal(err)
		}
		if e.cq, err = e.pd.NewCompletionQueue(4096); err != nil {
			t.Fatal(err)
		}
		if e.qp, err = e.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: e.cq, RecvCQ: e.cq}); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- b.qp.Connect(ctx, a.qp.LocalInfo()) }()
	if err := a.qp.Connect(ctx, b.qp.LocalInfo()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return a, b
}

func TestHeaderLayout(t *testing.T) {
	var b [headerSize]byte
	(&header{op: frameWriteImm, status: 0, flags: flagImm, key: 0x01020304, imm: 0x0a0b0c0d, seq: 5, addr: 6, length: 7}).put(b[:])
	if b[0] != frameWriteImm || b[2] != flagImm || binary.LittleEndian.Uint32(b[4:]) != 0x01020304 ||
		binary.LittleEndian.Uint32(b[8:]) != 0x0a0b0c0d || binary.LittleEndian.Uint64(b[12:]) != 5 ||
		binary.LittleEndian.Uint64(b[20:]) != 6 || binary.LittleEndian.Uint64(b[28:]) != 7 {
		t.Fatalf("header bytes %x", b)
	}
}

// TestDeregisterWithPostedReceive checks that Deregister does not wait for
// work that is merely posted: the receive fails when a message reaches it.
func TestDeregisterWithPostedReceive(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	src, _ := a.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 64)}, verbs.AccessLocalWrite)
	dst, _ := b.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 64)}, verbs.AccessLocalWrite)
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: dst, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	deregistered := make(chan error, 1)
	go func() { deregistered <- dst.Deregister() }()
	select {
	case err := <-deregistered:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Deregister waited for a posted receive")
	}
	if err := a.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: src, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := make([]verbs.Completion, 1)
	if n, err := b.cq.Wait(ctx, out); err != nil || n != 1 || out[0].Status != verbs.StatusLocalProtection {
		t.Fatalf("receive completion %v, %v: want local protection error", out[:n], err)
	}
	if n, err := a.cq.Wait(ctx, out); err != nil || n != 1 || out[0].Status != verbs.StatusRemoteOperation {
		t.Fatalf("send completion %v, %v: want remote operation error", out[:n], err)
	}
	if !bytes.Equal(dst.Bytes(), make([]byte, 64)) {
		t.Fatal("a deregistered receive buffer was written")
	}
}

// FuzzReadHello decodes the first bytes a dialer sends an accepting queue
// pair, before any secret is checked.
func FuzzReadHello(f *testing.F) {
	f.Add(encodeHello(hello{Acceptor: secret{1}, Dialer: secret{2}, QPID: 3}))
	f.Add([]byte{})
	f.Add(make([]byte, helloSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := readHello(bytes.NewReader(b))
		if err != nil {
			return
		}
		if enc := encodeHello(h); !bytes.Equal(enc, b[:len(enc)]) {
			t.Fatalf("readHello(%x) = %+v, which encodes as %x", b, h, enc)
		}
	})
}

// lazyPair opens two connected queue pairs, each with a receive of 8
// bytes posted, and the memory for a Send of 8 bytes.
func lazyPair(t *testing.T) (a, b end, amr, bmr verbs.MemoryRegion) {
	t.Helper()
	a, b = openPair(t, New())
	var err error
	for _, e := range []struct {
		end end
		mr  *verbs.MemoryRegion
	}{{a, &amr}, {b, &bmr}} {
		if *e.mr, err = e.end.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 16)}, verbs.AccessLocalWrite); err != nil {
			t.Fatal(err)
		}
		if err := e.end.qp.PostRecv(verbs.RecvRequest{ID: 100, Local: verbs.Local{Region: *e.mr, Offset: 8, Length: 8}}); err != nil {
			t.Fatal(err)
		}
	}
	return a, b, amr, bmr
}

func waitCompletion(t *testing.T, cq verbs.CompletionQueue, within time.Duration) (verbs.Completion, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	out := make([]verbs.Completion, 1)
	n, err := cq.Wait(ctx, out)
	if n == 0 || err != nil {
		return verbs.Completion{}, false
	}
	return out[0], true
}

// TestLazyAckRidesTheFrameBack: the acknowledgement of a request marked
// LazyCompletion is not written on its own while the receiver waits: it
// goes with the next frame the receiver's side sends.
func TestLazyAckRidesTheFrameBack(t *testing.T) {
	defer leakcheck.Check(t)
	old := lazyAckDelay.Load()
	defer lazyAckDelay.Store(old)
	lazyAckDelay.Store(int64(time.Hour)) // the sweeper never sends it here
	// A sweeper from an earlier test still sleeps the old delay; let it end.
	deadline := time.Now().Add(10 * time.Second)
	for lazyAcks.isRunning() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if lazyAcks.isRunning() {
		t.Fatal("the lazy-ack sweeper kept running with nothing to do")
	}
	a, b, amr, bmr := lazyPair(t)
	defer a.pd.Close()
	defer b.pd.Close()
	// A first exchange the other way, so that whatever b sends once
	// connected (which would carry the acknowledgement) has gone.
	if err := b.qp.PostSend(verbs.SendRequest{ID: 7, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if c, ok := waitCompletion(t, a.cq, 10*time.Second); !ok || c.ID != 100 {
		t.Fatalf("a's first receive: %+v, %v", c, ok)
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != 7 {
		t.Fatalf("b's first Send: %+v, %v", c, ok)
	}
	if err := a.qp.PostRecv(verbs.RecvRequest{ID: 101, Local: verbs.Local{Region: amr, Offset: 8, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	// b's writer goroutine writes whatever acknowledgements are queued
	// when it runs, lazy ones too, as it should; and it runs once when it
	// starts, which on a loaded machine can be after the lazy Send's
	// acknowledgement was queued (b's first Send went the direct way,
	// without it). So a Send that came back early is tried again: the
	// acknowledgement must ride the frame back on one of a few tries,
	// which it never does if the receiver writes lazy acknowledgements on
	// its own.
	const tries = 5
	var lazyID uint64
	for try := range tries {
		lazyID = uint64(1 + try)
		if try > 0 {
			if err := b.qp.PostRecv(verbs.RecvRequest{ID: 100, Local: verbs.Local{Region: bmr, Offset: 8, Length: 8}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := a.qp.PostSend(verbs.SendRequest{ID: lazyID, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Length: 8}, LazyCompletion: true}); err != nil {
			t.Fatal(err)
		}
		if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != 100 || c.Status != verbs.StatusSuccess {
			t.Fatalf("b's receive: %+v, %v", c, ok)
		}
		c, ok := waitCompletion(t, a.cq, 50*time.Millisecond)
		if !ok {
			break
		}
		if try == tries-1 {
			t.Fatalf("a's lazy Send completed (%+v) before b sent anything back, %d times in %d: its acknowledgement was written on its own", c, tries, tries)
		}
		t.Logf("try %d: a's lazy Send completed (%+v) before b sent anything back; b's writer was still running", try, c)
	}
	if err := b.qp.PostSend(verbs.SendRequest{ID: 200, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	got := map[uint64]bool{}
	for range 2 {
		c, ok := waitCompletion(t, a.cq, 10*time.Second)
		if !ok || c.Status != verbs.StatusSuccess {
			t.Fatalf("a's completions: %+v, %v (have %v)", c, ok, got)
		}
		got[c.ID] = true
	}
	if !got[lazyID] || !got[101] {
		t.Fatalf("a's completions %v: want its Send (%d) and its receive (101)", got, lazyID)
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != 200 || c.Status != verbs.StatusSuccess {
		t.Fatalf("b's Send: %+v, %v", c, ok)
	}
}

// TestLazySendInADeliveryCompletesAsWritten: a request marked
// LazyCompletion that is posted while the queue's completions are being
// delivered (a handler answering in the receiver that delivered its
// request) completes once written, with nothing coming back and the
// sweeper never sending; the peer owes no acknowledgement for it. Posted
// outside a delivery, the same request still waits for one.
func TestLazySendInADeliveryCompletesAsWritten(t *testing.T) {
	defer leakcheck.Check(t)
	old := lazyAckDelay.Load()
	defer lazyAckDelay.Store(old)
	lazyAckDelay.Store(int64(time.Hour)) // the sweeper never sends here
	deadline := time.Now().Add(10 * time.Second)
	for lazyAcks.isRunning() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	a, b, amr, bmr := lazyPair(t)
	defer a.pd.Close()
	defer b.pd.Close()
	got := make(chan verbs.Completion, 16)
	postErr := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() {
		ran <- a.cq.(verbs.CompletionRunner).Run(ctx, func(cs []verbs.Completion) {
			for _, c := range cs {
				if c.Op == verbs.OpRecv && c.ID == 100 {
					// The answer, posted where its request was delivered.
					postErr <- a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Length: 8}, LazyCompletion: true})
				}
				got <- c
			}
		})
	}()
	defer func() {
		cancel()
		<-ran
	}()
	if err := b.qp.PostSend(verbs.SendRequest{ID: 7, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if err := <-postErr; err != nil {
		t.Fatal(err)
	}
	want := map[uint64]bool{100: true, 1: true}
	timeout := time.After(10 * time.Second)
	for len(want) > 0 {
		select {
		case c := <-got:
			if c.Status != verbs.StatusSuccess {
				t.Fatalf("a's completion %+v", c)
			}
			delete(want, c.ID)
		case <-timeout:
			t.Fatalf("a's completions %v never came: the lazy Send posted in a delivery waited for an acknowledgement", want)
		}
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.Status != verbs.StatusSuccess {
		t.Fatalf("b's first completion: %+v, %v", c, ok)
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.Status != verbs.StatusSuccess {
		t.Fatalf("b's second completion: %+v, %v", c, ok)
	}
	if any, _ := b.qp.(*queuePair).owedAcks(); any {
		t.Fatal("b owes an acknowledgement of a request sent without one")
	}
	// Outside a delivery: the lazy Send waits for what b sends back. (The
	// delivery above may still be ending after its handler's last call:
	// a Send posted before it has is Early, as in the delivery.)
	for aq := a.qp.(*queuePair); aq.SendCQ.Delivering(); {
		if time.Now().After(deadline) {
			t.Fatal("a's delivery of the first exchange never ended")
		}
		time.Sleep(time.Millisecond)
	}
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 100, Local: verbs.Local{Region: bmr, Offset: 8, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if err := a.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Length: 8}, LazyCompletion: true}); err != nil {
		t.Fatal(err)
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != 100 {
		t.Fatalf("b's receive: %+v, %v", c, ok)
	}
	select {
	case c := <-got:
		t.Fatalf("a's lazy Send posted outside a delivery completed (%+v) before b sent anything back", c)
	case <-time.After(50 * time.Millisecond):
	}
	if any, _ := b.qp.(*queuePair).owedAcks(); !any {
		t.Fatal("b owes no acknowledgement of a lazy Send sent with flagLazyAck")
	}
	if err := a.qp.PostRecv(verbs.RecvRequest{ID: 101, Local: verbs.Local{Region: amr, Offset: 8, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if err := b.qp.PostSend(verbs.SendRequest{ID: 8, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	want = map[uint64]bool{2: true, 101: true}
	for len(want) > 0 {
		select {
		case c := <-got:
			delete(want, c.ID)
		case <-time.After(10 * time.Second):
			t.Fatalf("a's completions %v never came after b's Send", want)
		}
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != 8 {
		t.Fatalf("b's Send: %+v, %v", c, ok)
	}
}

// TestAnswersToABurstGoInOneWrite: requests that arrive together are
// delivered one by one, and the lazy answers posted in those deliveries
// are held until the receiver has delivered the burst, then written in
// one batch, and complete without anything coming back.
func TestAnswersToABurstGoInOneWrite(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	reg := func(e end, n int) verbs.MemoryRegion {
		mr, err := e.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, n)}, verbs.AccessLocalWrite)
		if err != nil {
			t.Fatal(err)
		}
		return mr
	}
	const burst = 4
	amr, bmr := reg(a, 16*burst), reg(b, 16*burst)
	bq := b.qp.(*queuePair)
	held := make(chan bool, 64)
	done, stop := runDelivering(b.cq, func(c verbs.Completion) {
		// Answer it where it was delivered.
		if err := b.qp.PostSend(verbs.SendRequest{ID: 1000 + c.ID, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Offset: int(c.ID) * 8, Length: 8}, LazyCompletion: true}); err != nil {
			t.Error(err)
		}
		bq.Mu.Lock()
		holding, h := bq.holding, bq.held
		bq.Mu.Unlock()
		if holding {
			held <- h
		}
	})
	defer stop()
	sawHold := false
	for try := 0; try < 20 && !sawHold; try++ {
		for i := range burst {
			if err := b.qp.PostRecv(verbs.RecvRequest{ID: uint64(i), Local: verbs.Local{Region: bmr, Offset: 8 * burst, Length: 8}}); err != nil {
				t.Fatal(err)
			}
			if err := a.qp.PostRecv(verbs.RecvRequest{ID: uint64(100 + i), Local: verbs.Local{Region: amr, Offset: 8 * burst, Length: 8}}); err != nil {
				t.Fatal(err)
			}
		}
		// One post, so that the burst goes out in one write.
		var reqs []verbs.SendRequest
		for i := range burst {
			reqs = append(reqs, verbs.SendRequest{ID: uint64(10 + i), Op: verbs.OpSend, Local: verbs.Local{Region: amr, Offset: 8 * i, Length: 8}})
		}
		if err := a.qp.PostSend(reqs...); err != nil {
			t.Fatal(err)
		}
		// a: its Sends and the receives of the answers; b: its receives and
		// its answers' Sends, completed as written, nothing coming back.
		for n := 0; n < 2*burst; n++ {
			if c, ok := waitCompletion(t, a.cq, 10*time.Second); !ok || c.Status != verbs.StatusSuccess {
				t.Fatalf("try %d: a's completion %d: %+v, %v", try, n, c, ok)
			}
		}
		for n := 0; n < 2*burst; n++ {
			select {
			case c := <-done:
				if c.Status != verbs.StatusSuccess {
					t.Fatalf("try %d: b's completion %+v", try, c)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("try %d: b has %d of its %d completions", try, n, 2*burst)
			}
		}
		for len(held) > 0 {
			if !<-held {
				t.Fatalf("try %d: an answer posted while the receiver held the burst's answers was not held", try)
			}
			sawHold = true
		}
	}
	if !sawHold {
		t.Fatal("in 20 bursts the receiver never had the next request read while it delivered one")
	}
	if any, _ := a.qp.(*queuePair).owedAcks(); any {
		t.Fatal("a owes acknowledgements of answers sent without one")
	}
}

// TestLazyAckArrivesWithNothingBack: when nothing goes back, the sweeper
// sends the lazy acknowledgement on its own, and the Send completes.
func TestLazyAckArrivesWithNothingBack(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, amr, bmr := lazyPair(t)
	defer a.pd.Close()
	defer b.pd.Close()
	for i := range 3 {
		if i > 0 {
			if err := b.qp.PostRecv(verbs.RecvRequest{ID: 100, Local: verbs.Local{Region: bmr, Length: 8}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Length: 8}, LazyCompletion: true}); err != nil {
			t.Fatal(err)
		}
		if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.ID != 100 || c.Status != verbs.StatusSuccess {
			t.Fatalf("b's receive %d: %+v, %v", i, c, ok)
		}
		if c, ok := waitCompletion(t, a.cq, 10*time.Second); !ok || c.ID != 1 || c.Status != verbs.StatusSuccess {
			t.Fatalf("a's lazy Send %d never completed: %+v, %v", i, c, ok)
		}
	}
}

// TestNoAckFlag: flagNoAck is accepted on the requests that carry bytes
// and refused on Read requests, Read responses and acknowledgements.
func TestNoAckFlag(t *testing.T) {
	for _, tc := range []struct {
		op uint8
		ok bool
	}{{frameSend, true}, {frameWrite, true}, {frameWriteImm, true}, {frameReadReq, false}, {frameReadResp, false}, {frameAck, false}} {
		var b [headerSize]byte
		h := header{op: tc.op, flags: flagNoAck, seq: 1}
		h.put(b[:])
		got, err := parseHeader(b[:])
		if (err == nil) != tc.ok {
			t.Errorf("frame %d with flagNoAck: err %v, want ok=%v", tc.op, err, tc.ok)
		}
		if err == nil && got.flags != flagNoAck {
			t.Errorf("frame %d: flags %#x after parsing", tc.op, got.flags)
		}
	}
}

// TestHandshakeWireVersion: a peer whose handshake carries another tcp
// wire version (one that would not know flagNoAck) is refused at the
// handshake, saying so, not mid-session.
func TestHandshakeWireVersion(t *testing.T) {
	h := encodeHello(hello{QPID: 7})
	if got, err := readHello(bytes.NewReader(h)); err != nil || got.QPID != 7 {
		t.Fatalf("our own hello: %+v, %v", got, err)
	}
	h[7] = 1
	_, err := readHello(bytes.NewReader(h))
	if err == nil || !strings.Contains(err.Error(), "tcp wire version 1, this side 2") {
		t.Fatalf("a version-1 hello: %v", err)
	}
	r := replyBytes(handshakeOK)
	r[7] = 1
	if _, err := readReply(bytes.NewReader(r)); err == nil || !strings.Contains(err.Error(), "tcp wire version 1") {
		t.Fatalf("a version-1 reply: %v", err)
	}
}

// TestLargeEarlyWriteGoesWithTheAnswer: a Write past the direct path's
// bound, posted with its answer where the request was delivered by the
// receiver (a Fetch's landing), is held for the receiver, which writes
// both before it next waits, instead of waking the writer; the bytes are
// in place when the answer arrives, and nothing is owed an
// acknowledgement. (Posted in a delivery by the queue's Run goroutine,
// with the receiver waiting for the connection, they go as any other: a
// request held for a receiver that waits would wait with it.)
func TestLargeEarlyWriteGoesWithTheAnswer(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	const n = 4 * directMaxQueued
	w := writeThenAnswer(t, a, b, n, 8)
	defer w.close()
	src, dst, bmr, amr, held, done := w.src, w.dst, w.bmr, w.amr, w.held, w.done
	sawHold := false
	for try := 0; try < 20 && !sawHold; try++ {
		for i := range src[:n] {
			src[i] = byte(i*7 + try)
		}
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: 9, Local: verbs.Local{Region: bmr, Offset: n, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		if err := a.qp.PostRecv(verbs.RecvRequest{ID: 8, Local: verbs.Local{Region: amr, Offset: n, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		if err := a.qp.PostSend(verbs.SendRequest{ID: 7, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Offset: n, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		for range 2 { // a's Send, and the answer's receive
			c, ok := waitCompletion(t, a.cq, 10*time.Second)
			if !ok || c.Status != verbs.StatusSuccess {
				t.Fatalf("try %d: a's completion: %+v, %v", try, c, ok)
			}
			if c.Op == verbs.OpRecv && !bytes.Equal(dst[:n], src[:n]) {
				t.Fatalf("try %d: the answer arrived before the bytes Written ahead of it", try)
			}
		}
		sawHold = <-held
		for range 3 { // b's receive, Write and answer
			select {
			case c := <-done:
				if c.Status != verbs.StatusSuccess {
					t.Fatalf("try %d: b's completion %+v", try, c)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("try %d: b's Write and answer did not complete", try)
			}
		}
	}
	if !sawHold {
		t.Error("in 20 tries a Write past the direct path's bound, posted in the receiver's delivery, was never held for it")
	}
	if any, _ := a.qp.(*queuePair).owedAcks(); any {
		t.Fatal("a owes acknowledgements of requests sent without one")
	}
}

// writeThenAnswer registers n+extra bytes on each end, grants a's first n
// to b, and runs b's completions in the provider's delivery, where each
// receive posts a Lazy Write of b's first n bytes into a's and, behind it,
// a Lazy Send of the 8 bytes after them (the answer): Early requests,
// held for the receiver while it is busy. held says, for each, whether
// they were held.
type earlyWrites struct {
	src, dst []byte
	bmr, amr verbs.MemoryRegion
	held     chan bool
	done     <-chan verbs.Completion
	close    func()
}

func writeThenAnswer(t *testing.T, a, b end, n, extra int) *earlyWrites {
	t.Helper()
	w := &earlyWrites{held: make(chan bool, 1)}
	var g verbs.Grant
	w.src, w.dst, w.bmr, w.amr, g = writable(t, a, b, n, extra)
	bq := b.qp.(*queuePair)
	done, stop := runDelivering(b.cq, func(verbs.Completion) {
		err := b.qp.PostSend(
			verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: w.bmr, Length: n}, Remote: g.Remote(), LazyCompletion: true},
			verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: w.bmr, Offset: n, Length: 8}, LazyCompletion: true})
		if err != nil {
			t.Error(err)
		}
		bq.Mu.Lock()
		h := bq.held
		bq.Mu.Unlock()
		w.held <- h
	})
	w.done = done
	w.close = func() {
		stop()
		g.Revoke()
	}
	return w
}

// writable registers n+extra bytes on each end (src on b, dst on a) and
// grants a's first n to b, writable.
func writable(t *testing.T, a, b end, n, extra int) (src, dst []byte, bmr, amr verbs.MemoryRegion, g verbs.Grant) {
	t.Helper()
	src, dst = make([]byte, n+extra), make([]byte, n+extra)
	var err error
	if bmr, err = b.pd.RegisterMemory(verbs.Memory{Bytes: src}, verbs.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	if amr, err = a.pd.RegisterMemory(verbs.Memory{Bytes: dst}, verbs.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	if g, err = a.qp.Grant(amr, 0, n, verbs.AccessRemoteWrite); err != nil {
		t.Fatal(err)
	}
	return src, dst, bmr, amr, g
}

// capWrites makes the kernel's send queue take at most max bytes of each
// write without blocking (writeNowCap) for the rest of the test, and
// counts the writes it cut short.
func capWrites(t *testing.T, max int) *atomic.Int64 {
	var cut atomic.Int64
	writeNowCap = func(asked int) int {
		if asked > max {
			cut.Add(1)
		}
		return max
	}
	t.Cleanup(func() { writeNowCap = nil })
	return &cut
}

// runDelivering runs cq's completions (verbs.CompletionRunner) in the
// provider's delivery, calling onRecv there for each receive, and sends
// every completion to the channel it returns; stop ends the run.
func runDelivering(cq verbs.CompletionQueue, onRecv func(verbs.Completion)) (<-chan verbs.Completion, func()) {
	done := make(chan verbs.Completion, 64)
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() {
		ran <- cq.(verbs.CompletionRunner).Run(ctx, func(cs []verbs.Completion) {
			for _, c := range cs {
				if c.Op == verbs.OpRecv {
					onRecv(c)
				}
				done <- c
			}
		})
	}()
	return done, func() {
		cancel()
		<-ran
	}
}

// TestReadAnsweredBeforeAnEarlyRequestCompletes: a Read posted behind an
// Early request in one batch may be answered before whoever wrote the
// batch has completed the Early request (a writer the host does not run
// on yet): the Read's response finds the Early request still in flight,
// which the peer acknowledges nothing of, and completes it first (it
// read it) instead of failing the queue pair for a response out of turn.
func TestReadAnsweredBeforeAnEarlyRequestCompletes(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	amem, bmem := make([]byte, 4096), make([]byte, 4096)
	for i := range bmem {
		bmem[i] = byte(i*5 + 1)
	}
	amr, err := a.pd.RegisterMemory(verbs.Memory{Bytes: amem}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	bmr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: bmem}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	g, err := b.qp.Grant(bmr, 0, 1024, verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Revoke()
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: bmr, Offset: 2048, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	written := make(chan struct{})
	release := make(chan struct{})
	afterEarlyWrite = func() {
		close(written)
		<-release // the writer stalls before it completes what it wrote
	}
	defer func() { afterEarlyWrite = nil }()
	// a: a delivery under way (its Run handler, on a receive of its own)
	// during which another goroutine posts a Lazy Send (Early) and a Read
	// in one batch.
	if err := a.qp.PostRecv(verbs.RecvRequest{ID: 2, Local: verbs.Local{Region: amr, Offset: 2048, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	posted := make(chan error, 1)
	done, stop := runDelivering(a.cq, func(verbs.Completion) {
		go func() {
			posted <- a.qp.PostSend(
				verbs.SendRequest{ID: 10, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Offset: 3072, Length: 8}, LazyCompletion: true},
				verbs.SendRequest{ID: 11, Op: verbs.OpRead, Local: verbs.Local{Region: amr, Length: 1024}, Remote: g.Remote()})
		}()
		<-written // the batch is out; the delivery ends, and a's receiver reads on
	})
	defer stop()
	if err := b.qp.PostSend(verbs.SendRequest{ID: 20, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Offset: 1024, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	got := map[uint64]verbs.Completion{}
	deadline := time.After(10 * time.Second)
	for len(got) < 3 { // a's receive, its Send and its Read
		select {
		case c := <-done:
			got[c.ID] = c
		case <-deadline:
			close(release)
			t.Fatalf("a's completions: %v", got)
		}
	}
	close(release)
	if err := <-posted; err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint64{10, 11} {
		if c := got[id]; c.Status != verbs.StatusSuccess {
			t.Errorf("a's request %d: %+v", id, c)
		}
	}
	if !bytes.Equal(amem[:1024], bmem[:1024]) {
		t.Error("the Read brought other bytes")
	}
}

// TestReceiverWritesInPart: the receiver writes what it holds without
// blocking, and when the kernel's send queue takes only part of it (here
// 1,000 bytes of each write, writeNowCap), the writer finishes the rest
// before anything posted after it: the Written bytes arrive whole, before
// the answer posted behind them, and a Send posted meanwhile from another
// goroutine (the direct path) after both.
func TestReceiverWritesInPart(t *testing.T) {
	defer leakcheck.Check(t)
	partial := capWrites(t, 1000)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	const n = 4 * directMaxQueued
	// src: the Write's bytes, the answer, the Send after it, b's receive;
	// dst: the Write's bytes, a's two receives, a's Send.
	w := writeThenAnswer(t, a, b, n, 24)
	defer w.close()
	src, dst, bmr, amr, held, done := w.src, w.dst, w.bmr, w.amr, w.held, w.done
	for try := 0; try < 20 && partial.Load() == 0; try++ {
		for i := range src[:n] {
			src[i] = byte(i*7 + try)
		}
		copy(src[n:], fmt.Sprintf("answer%02d", try))
		copy(src[n+8:], fmt.Sprintf("after %02d", try))
		if err := b.qp.PostRecv(verbs.RecvRequest{ID: 9, Local: verbs.Local{Region: bmr, Offset: n + 16, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		for i := range 2 {
			if err := a.qp.PostRecv(verbs.RecvRequest{ID: uint64(20 + i), Local: verbs.Local{Region: amr, Offset: n + 8*i, Length: 8}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := a.qp.PostSend(verbs.SendRequest{ID: 7, Op: verbs.OpSend, Local: verbs.Local{Region: amr, Offset: n + 16, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		<-held
		// Posted as the receiver writes the held Write and answer, or
		// after: it must arrive after them either way.
		if err := b.qp.PostSend(verbs.SendRequest{ID: 3, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Offset: n + 8, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		for range 3 { // a's Send, and its two receives
			c, ok := waitCompletion(t, a.cq, 10*time.Second)
			if !ok || c.Status != verbs.StatusSuccess {
				t.Fatalf("try %d: a's completion: %+v, %v", try, c, ok)
			}
			if c.Op != verbs.OpRecv {
				continue
			}
			if !bytes.Equal(dst[:n], src[:n]) {
				t.Fatalf("try %d: a receive completed before the bytes Written ahead of it", try)
			}
			i := int(c.ID - 20)
			want := []string{"answer", "after "}[i]
			if got := string(dst[n+8*i : n+8*i+6]); got != want {
				t.Fatalf("try %d: receive %d got %q, want %q (out of order)", try, i, got, want)
			}
		}
		for range 4 { // b's receive, Write, answer and Send
			select {
			case c := <-done:
				if c.Status != verbs.StatusSuccess {
					t.Fatalf("try %d: b's completion %+v", try, c)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("try %d: b's requests did not complete", try)
			}
		}
	}
	if partial.Load() == 0 {
		t.Error("in 20 tries the receiver never wrote a held Write in part")
	}
}

// TestNothingWrittenPastAPartialBatch: while the receiver's batch is
// written in part, neither a poster (the direct path) nor the receiver
// writes anything: the writer finishes the batch first.
func TestNothingWrittenPastAPartialBatch(t *testing.T) {
	defer leakcheck.Check(t)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	bq := b.qp.(*queuePair)
	mem := make([]byte, 8)
	bmr, err := b.pd.RegisterMemory(verbs.Memory{Bytes: mem}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	amr, err := a.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 8)}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: amr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	bq.writeMu.Lock()
	bq.Mu.Lock()
	bq.Sendq = append(bq.Sendq, &softrc.SendWR{}) // stands for a posted request
	queued := len(bq.Sendq)
	conn, raw := bq.ConnLocked(), bq.raw
	bq.Mu.Unlock()
	bq.partial = true
	for _, c := range []struct {
		name   string
		direct bool
		rx     *receiving
	}{{"a poster", true, nil}, {"the receiver", false, &receiving{q: bq, conn: conn}}, {"the receiver's acks", true, &receiving{q: bq, conn: conn}}} {
		if wrote, _, _ := bq.writeQueued(conn, c.direct, c.rx, raw); wrote {
			t.Errorf("%s wrote past a batch written in part", c.name)
		}
	}
	bq.Mu.Lock()
	if len(bq.Sendq) != queued {
		t.Errorf("the send queue went from %d requests to %d", queued, len(bq.Sendq))
	}
	bq.Sendq = bq.Sendq[:queued-1]
	bq.Mu.Unlock()
	bq.partial = false
	bq.writeMu.Unlock()
	// The queue pair still works.
	if err := b.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if c, ok := waitCompletion(t, a.cq, 10*time.Second); !ok || c.Status != verbs.StatusSuccess {
		t.Fatalf("a's receive: %+v, %v", c, ok)
	}
	if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.Status != verbs.StatusSuccess {
		t.Fatalf("b's Send: %+v, %v", c, ok)
	}
}

// TestPosterWritesInPart: a poster on the direct path (an idle
// connection, a goroutine of its own) writes without blocking too: with
// the kernel taking 1,000 bytes a write (writeNowCap), its Write goes out
// in part, the writer finishes it, and a Send posted behind it arrives
// after its bytes.
func TestPosterWritesInPart(t *testing.T) {
	defer leakcheck.Check(t)
	partial := capWrites(t, 1000)
	a, b := openPair(t, New())
	defer a.pd.Close()
	defer b.pd.Close()
	const n = 4 * directMaxQueued
	src, dst, bmr, amr, g := writable(t, a, b, n, 8)
	defer g.Revoke()
	for try := range 3 {
		for i := range src[:n] {
			src[i] = byte(i*5 + try)
		}
		if err := a.qp.PostRecv(verbs.RecvRequest{ID: 8, Local: verbs.Local{Region: amr, Offset: n, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		if err := b.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: bmr, Length: n}, Remote: g.Remote()}); err != nil {
			t.Fatal(err)
		}
		if err := b.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: bmr, Offset: n, Length: 8}}); err != nil {
			t.Fatal(err)
		}
		c, ok := waitCompletion(t, a.cq, 10*time.Second)
		if !ok || c.Status != verbs.StatusSuccess {
			t.Fatalf("try %d: a's receive: %+v, %v", try, c, ok)
		}
		if !bytes.Equal(dst[:n], src[:n]) {
			t.Fatalf("try %d: the Send arrived before the bytes Written ahead of it", try)
		}
		for range 2 {
			if c, ok := waitCompletion(t, b.cq, 10*time.Second); !ok || c.Status != verbs.StatusSuccess {
				t.Fatalf("try %d: b's completion: %+v, %v", try, c, ok)
			}
		}
	}
	if partial.Load() == 0 {
		t.Error("the poster's Write was never written in part")
	}
}
