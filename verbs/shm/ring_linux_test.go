package shm

import (
	"context"
	"errors"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
)

// The conformance suite on the other control paths: the socket, as before
// the rings, and the rings without polling, where every message that finds
// the receiver asleep goes through the wake-up.
func TestConformanceSocketControl(t *testing.T) {
	verbstest.Run(t, testEnv(withSocketControl()))
}

func TestConformanceRingNoSpin(t *testing.T) {
	verbstest.Run(t, testEnv(withRingSpin(0)))
}

func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// sendRecv sends n bytes from a to b and checks both completions.
func sendRecv(t testing.TB, a, b *end, n int) {
	t.Helper()
	if err := b.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: b.mr, Length: n}}); err != nil {
		t.Fatal(err)
	}
	if err := a.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Length: n}}); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess || c.Len != n {
		t.Fatalf("receive: %+v", c)
	}
	if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess {
		t.Fatalf("send: %+v", c)
	}
}

// TestControlRingNegotiation: the rings are used only when both ends want
// them, whichever end dials; a queue pair leaves no fd behind.
func TestControlRingNegotiation(t *testing.T) {
	defer leakcheck.Check(t)
	before := openFDs(t)
	for _, tc := range []struct {
		name     string
		a, b     []Option
		wantRing bool
	}{
		{"both rings", nil, nil, true},
		{"socket and ring", []Option{withSocketControl()}, nil, false},
		{"ring and socket", nil, []Option{withSocketControl()}, false},
		{"both sockets", []Option{withSocketControl()}, []Option{withSocketControl()}, false},
	} {
		// The dialer is the end with the smaller secret: several rounds
		// let each end dial.
		for range 6 {
			a := newEnd(t, New(tc.a...), 4096, allRemote)
			b := newEnd(t, New(tc.b...), 4096, allRemote)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			errc := make(chan error, 1)
			go func() { errc <- b.qp.Connect(ctx, a.qp.LocalInfo()) }()
			err := a.qp.Connect(ctx, b.qp.LocalInfo())
			if err2 := <-errc; err == nil {
				err = err2
			}
			cancel()
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			for _, e := range []*end{a, b} {
				if got := e.qp.rx != nil && e.qp.tx != nil; got != tc.wantRing {
					t.Fatalf("%s: rings in use: %v, want %v", tc.name, got, tc.wantRing)
				}
			}
			sendRecv(t, a, b, 64)
			sendRecv(t, b, a, 100)
			a.pd.Close()
			b.pd.Close()
			a.mr.Deregister()
			b.mr.Deregister()
		}
	}
	// The test's memory is freed by t.Cleanup, after us: count it out.
	if after := openFDs(t); after > before+2*4*6 {
		t.Fatalf("%d fds open after the queue pairs closed, %d before", after, before)
	}
}

// TestControlRingWakeups bounces Sends and WriteImms with no polling, so
// that nearly every message finds the receiver asleep: a lost wake-up hangs
// a round trip.
func TestControlRingWakeups(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096, withRingSpin(0))
	defer closeAll()
	rounds := 2000
	if testing.Short() {
		rounds = 200
	}
	for i := range rounds {
		if i%2 == 0 {
			sendRecv(t, a, b, 64)
			continue
		}
		writeImmRound(t, a, b, i)
	}
}

// writeImmRound has b WriteImm 8 bytes into a with imm i, and checks both
// completions.
func writeImmRound(t *testing.T, a, b *end, i int) {
	t.Helper()
	if err := a.qp.PostRecv(verbs.RecvRequest{ID: 3}); err != nil {
		t.Fatal(err)
	}
	if err := b.qp.PostSend(verbs.SendRequest{ID: 4, Op: verbs.OpWriteImm, Imm: uint32(i), Local: verbs.Local{Region: b.mr, Length: 8}, Remote: verbs.Remote{Addr: a.mr.Addr(), Key: a.mr.RemoteKey()}}); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess || c.Imm != uint32(i) {
		_, ea := a.qp.Failure()
		_, eb := b.qp.Failure()
		t.Fatalf("round %d: receive %+v (a: %v; b: %v)", i, c, ea, eb)
	}
	if c := waitOne(t, b.cq); c.Status != verbs.StatusSuccess {
		t.Fatalf("round %d: WriteImm %+v", i, c)
	}
}

// inject commits rec into the peer's control ring as e, bypassing the
// encoder, and wakes the peer.
func inject(t *testing.T, e *end, rec []byte) {
	t.Helper()
	tx := e.qp.tx
	tx.mu.Lock()
	defer tx.mu.Unlock()
	buf, err := tx.ring.Reserve(len(rec))
	if err != nil {
		t.Fatal(err)
	}
	copy(buf, rec)
	if err := tx.ring.Commit(len(rec)); err != nil {
		t.Fatal(err)
	}
	e.qp.wakePeerLocked()
}

func encoded(m message) []byte {
	var b [messageSize]byte
	m.encode(&b)
	return b[:]
}

// waitFailed waits for qp to enter the error state and returns the cause.
func waitFailed(t *testing.T, qp *queuePair) error {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for qp.State() != verbs.QPError {
		if time.Now().After(deadline) {
			t.Fatal("the queue pair kept talking to a peer that broke the protocol")
		}
		time.Sleep(time.Millisecond)
	}
	_, err := qp.Failure()
	return err
}

// ringTail and ringHead are the producer's and the consumer's counters in
// the ring's header (mempool's layout).
func ringTail(mapping []byte) *uint64 {
	return (*uint64)(unsafe.Pointer(&mapping[ringOffset+64]))
}

func ringHead(mapping []byte) *uint64 {
	return (*uint64)(unsafe.Pointer(&mapping[ringOffset+128]))
}

// misalign sets both counters of the ring in mapping to 3 bytes short of
// its end, as a hostile consumer could.
func misalign(mapping []byte, capacity int) {
	atomic.StoreUint64(ringHead(mapping), uint64(capacity-3))
	atomic.StoreUint64(ringTail(mapping), uint64(capacity-3))
}

// TestControlRingHostilePeer plays a peer that abuses the ring or the
// socket: the queue pair fails with a reason, and nothing panics.
func TestControlRingHostilePeer(t *testing.T) {
	defer leakcheck.Check(t)
	for _, tc := range []struct {
		name string
		act  func(t *testing.T, a, b *end)
		want string
	}{
		{"corrupt header", func(t *testing.T, a, b *end) {
			atomic.StoreUint64(ringTail(b.qp.tx.mapping), 1<<40+5)
			writeMessage(b.qp.conn, &message{typ: msgWake}, -1)
		}, "ring corrupt"},
		{"short record", func(t *testing.T, a, b *end) {
			inject(t, b, make([]byte, 10))
		}, "control record of 10 bytes"},
		{"garbage record", func(t *testing.T, a, b *end) {
			inject(t, b, make([]byte, messageSize))
		}, "unknown control message type 0"},
		{"hello in the ring", func(t *testing.T, a, b *end) {
			inject(t, b, encoded(message{typ: msgHello}))
		}, "unexpected message type"},
		{"socket message instead of a wake-up", func(t *testing.T, a, b *end) {
			writeMessage(b.qp.conn, &message{typ: msgAck, seq: 1}, -1)
		}, "while waiting for a wake-up"},
		{"fd of another record", func(t *testing.T, a, b *end) {
			inject(t, b, encoded(message{typ: msgMapReply, flags: flagFD | flagFound, seq: 5}))
			writeMessage(b.qp.conn, &message{typ: msgFD, seq: 6}, b.mem.FD)
		}, "want the fd of record 5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b, closeAll := connected(t, 4096)
			defer closeAll()
			tc.act(t, a, b)
			err := waitFailed(t, a.qp)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("failed with %v, want a reason naming %q", err, tc.want)
			}
		})
	}
}

// TestControlRingHostileConsumer: the consumer can write the producer's
// counter (they share a page). A counter that would make mempool.Ring index
// out of range is reported as corruption, not a panic, and fails the queue
// pair.
func TestControlRingHostileConsumer(t *testing.T) {
	defer leakcheck.Check(t)
	rx, err := newRingRx()
	if err != nil {
		t.Fatal(err)
	}
	defer rx.release()
	tx, err := attachRingTx(rx.fd)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.release()
	var rec [messageSize]byte
	if err := tx.put(&rec); err != nil {
		t.Fatal(err)
	}
	misalign(rx.mapping, rx.ring.Cap())
	if err := tx.put(&rec); !errors.Is(err, mempool.ErrRingCorrupt) {
		t.Fatalf("put over a misaligned counter: %v, want ErrRingCorrupt", err)
	}

	// End to end: a queue pair whose peer scribbles so fails.
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	misalign(a.qp.rx.mapping, a.qp.rx.ring.Cap())
	b.qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: b.mr, Length: 64}})
	a.qp.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: a.mr, Length: 64}}) // a produces into b's ring: fine
	b.qp.PostSend(verbs.SendRequest{ID: 3, Op: verbs.OpSend, Local: verbs.Local{Region: b.mr, Length: 64}}) // b produces into a's: corrupt
	// Either side may notice first: b when it produces into the corrupt
	// ring (ring corruption), or a when its consumer reads it and fails,
	// which b then sees as its peer in the error state or as the lost
	// connection. Both queue pairs must fail either way; the exact check of
	// the corruption is the put above.
	if err := waitFailed(t, b.qp); err == nil {
		t.Fatal("the producer's queue pair failed without a reason")
	}
	waitFailed(t, a.qp) // fails the test unless a reaches the error state
}

// TestAttachRingRefusesBadMemory: the peer's ring memfd must be sealed, big
// enough and formatted.
func TestAttachRingRefusesBadMemory(t *testing.T) {
	for name, m := range map[string]verbs.Memory{
		"unsealed":  memfdMemory(t, ringFileSize, 0),
		"too small": sealedMemory(t, ringFileSize/2),
		"garbage":   sealedMemory(t, ringFileSize),
	} {
		if tx, err := attachRingTx(m.FD); err == nil {
			tx.release()
			t.Errorf("%s: attached", name)
		}
	}
	if _, err := attachRingTx(-1); err == nil {
		t.Error("attached no fd")
	}
}

// pollers calls Poll on each queue pair in a loop of its own until stop.
func pollers(qps ...*queuePair) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, qp := range qps {
		wg.Go(func() {
			if !qp.BeginPoll() {
				panic("a second poller of one queue pair")
			}
			defer qp.EndPoll()
			for {
				select {
				case <-done:
					return
				default:
				}
				if !qp.Poll() {
					runtime.Gosched()
				}
			}
		})
	}
	return func() { close(done); wg.Wait() }
}

// TestPeerInProcess: both ends of an in-process connection know their
// peer is this process (TestOtherProcess: not so for a child's).
func TestPeerInProcess(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	for name, qp := range map[string]verbs.QueuePair{"dialer": a.qp, "acceptor": b.qp} {
		if l, ok := qp.(verbs.PeerLocator); !ok || !l.PeerInProcess() {
			t.Errorf("%s: PeerInProcess false (or no verbs.PeerLocator) with the peer in this process", name)
		}
	}
}

// TestPollRacesTheReceiver: goroutines that poll both queue pairs all the
// time compete with the receivers (which sleep as soon as the ring is
// empty) for every message, those whose fd follows on the socket
// included (map replies, as a's Writes reach regions of b it has not
// mapped yet): nothing is lost, doubled or reordered, and nothing hangs.
func TestPollRacesTheReceiver(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096, withRingSpin(0))
	defer closeAll()
	stop := pollers(a.qp, b.qp)
	defer stop()
	rounds := 1000
	if testing.Short() {
		rounds = 200
	}
	for i := range rounds {
		if i%50 == 49 {
			// A region of b that a has never mapped: the Write waits for
			// a map reply, whose fd comes on the socket.
			mr, err := b.pd.RegisterMemory(sealedMemory(t, 4096), allRemote)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.qp.PostSend(verbs.SendRequest{ID: 5, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 8}, Remote: verbs.Remote{Addr: mr.Addr(), Key: mr.RemoteKey()}}); err != nil {
				t.Fatal(err)
			}
			if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess || c.ID != 5 {
				t.Fatalf("round %d: Write to a new region: %+v", i, c)
			}
			continue
		}
		writeImmRound(t, a, b, i)
	}
}

// TestPollSavesWakeups: with the receiver asleep between messages, a
// message that a polling goroutine handles costs the sender no wake-up:
// over a run of round trips with both sides polled, the wake-ups sent are
// fewer than the messages (without a poller every one wakes a receiver,
// see TestControlRingWakeups).
func TestPollSavesWakeups(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096, withRingSpin(0))
	defer closeAll()
	stop := pollers(a.qp, b.qp)
	defer stop()
	const rounds = 500
	before := a.qp.tx.wakes.Load() + b.qp.tx.wakes.Load()
	for range rounds {
		sendRecv(t, a, b, 64)
	}
	// Each round is a Send and its acknowledgement: two messages.
	if wakes := a.qp.tx.wakes.Load() + b.qp.tx.wakes.Load() - before; wakes >= 2*rounds {
		t.Fatalf("%d wake-ups for %d messages handled with pollers running", wakes, 2*rounds)
	}
}

// TestAdaptSpin: a sleep the peer ended within maxRingSpin doubles the
// receiver's spin, up to maxRingSpin; a long one halves it, down to the
// configured spin; a receiver configured not to spin never does.
func TestAdaptSpin(t *testing.T) {
	base := 20 * time.Microsecond
	spin := base
	for range 8 {
		spin = adaptSpin(spin, base, 60*time.Microsecond)
	}
	if spin != maxRingSpin {
		t.Fatalf("after short sleeps: spin %v, want %v", spin, maxRingSpin)
	}
	if got := adaptSpin(spin, base, 2*maxRingSpin); got != spin {
		t.Fatalf("after a middling sleep: spin %v, want it kept (%v)", got, spin)
	}
	for range 8 {
		spin = adaptSpin(spin, base, 10*time.Millisecond)
	}
	if spin != base {
		t.Fatalf("after long sleeps: spin %v, want the configured %v", spin, base)
	}
	if got := adaptSpin(0, 0, time.Microsecond); got != 0 {
		t.Fatalf("configured not to spin: spin %v", got)
	}
}

// TestRingSpinnersBounded: with more than shmFewProcs Ps, at most a
// quarter of the Ps' worth of ring receivers spin at once; the others
// sleep at once (their peers wake them), and a receiver that stops
// spinning makes room for another.
func TestRingSpinnersBounded(t *testing.T) {
	if n := ringSpinners.Load(); n != 0 {
		t.Fatalf("%d receivers spinning with no queue pair open", n)
	}
	// Each call claims a spinner's place: the first two of 8 Ps' worth.
	first, second := mayRingSpin(8), mayRingSpin(8)
	if !first || !second {
		t.Fatal("a receiver within the limit may not spin")
	}
	if mayRingSpin(8) {
		t.Fatal("a third receiver may spin with 8 Ps")
	}
	ringSpun()
	if !mayRingSpin(8) {
		t.Fatal("a receiver may not spin after another stopped")
	}
	if !mayRingSpin(16) {
		t.Fatal("a third receiver may not spin with 16 Ps")
	}
	for range 3 {
		ringSpun()
	}
	if n := ringSpinners.Load(); n != 0 {
		t.Fatalf("%d spinning after all stopped", n)
	}
	if !mayRingSpin(2) {
		t.Fatal("the one receiver of 2 Ps may not spin")
	}
	ringSpun()
}
