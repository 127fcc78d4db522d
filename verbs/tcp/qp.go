package tcp

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// defaultMaxInline is the largest payload the sender copies next to its
// frame header instead of handing the kernel a separate slice.
const defaultMaxInline = 1024

// maxInline is the largest MaxInline a queue pair may ask for.
const maxInline = 64 << 10

// readBufferSize is the connection's read-ahead buffer. Headers and small
// payloads are read through it; at most this much of a large payload passes
// through it, the rest is read by the kernel straight into the region.
const readBufferSize = 16 << 10

// queuePair implements verbs.QueuePair with the soft-RC core's queue pair
// (package softrc: state, work queues, checks, flush, Close) over one TCP
// connection, its wire: one goroutine writes frames in posting order and
// one reads and applies them in order.
type queuePair struct {
	*softrc.QP
	pd        *domain
	role      verbs.ConnectRole
	advertise string // the listener address in info; "" for RoleDial
	maxInline int

	wakeWriter chan struct{} // one slot
	ctrlTaken  chan struct{} // one slot: the writer took the queued control frames

	// writeMu is held by whoever writes frames to the connection: the
	// writer goroutine, on the direct path a poster, or the receiver
	// (writeQueued's rx). batch belongs to its holder.
	writeMu sync.Mutex
	batch   frameBatch
	// partial: the receiver or a poster wrote batch in part
	// (writeQueued's try); the writer finishes it, and ends written,
	// before anything else is written. writerGone: the writer has
	// returned; nobody writes without blocking any more. Guarded by
	// writeMu.
	partial    bool
	written    written
	writerGone bool
	// raw is the connection's, for writes that do not block (set by
	// start under Mu; nil where the connection has none).
	raw syscall.RawConn

	// Guarded by Mu. The core's Sendq holds the requests posted and not
	// yet taken by the writer, its Inflight those taken and waiting for
	// their response.
	nextSeq       uint64
	ctrl          []ctrlFrame
	spareReqs     []*softrc.SendWR // recycled by writeQueued
	spareCtrls    []ctrlFrame      // recycled by writeQueued
	sendqBytes    int              // payload bytes in Sendq
	ctrlBytes     int              // payload bytes in ctrl
	unackedBytes  int              // payload bytes in Inflight
	readsInflight int              // Reads in Inflight, for Fence
	delayedAcks   int              // acknowledgements queued without waking the writer (queueAck)
	urgentAcks    int              // how many of them are not lazy (flagLazyAck)
	lazyArmed     bool             // on the lazy-ack sweeper's list (armLazyAcks)
	holding       bool             // the receiver writes Early requests itself before it next waits (holdEarly)
	held          bool             // an Early request was posted while holding
	// rxBusy: the receiver is between reading a frame's header and its
	// next look at whether the connection has more (set without q.Mu,
	// cleared under it by releaseHeld): an Early request posted
	// meanwhile may be held for it, as it will write what is held
	// before it next waits.
	rxBusy    atomic.Bool
	lazyMark  uint64 // ctrlTakes at the sweeper's previous look
	ctrlTakes uint64 // how many times the queued responses were taken to be written
	active    int    // goroutines that may still touch memory

	compressOK atomic.Bool // AllowCompression
}

// AllowCompression lets the peer's Reads ask for their data compressed
// (verbs.Compressor); until it is called they come as they are.
func (q *queuePair) AllowCompression(on bool) { q.compressOK.Store(on) }

// ctrlFrame is a response the receiver queues for the writer: an
// acknowledgement or a read response whose payload is region memory.
type ctrlFrame struct {
	hdr     header
	payload []byte
	use     softrc.Use // held while payload points into a region (a Read response)
	// compress is, for a Read response, what the requester asked for
	// (flagCompress) when this side allows compression.
	compress verbs.Compression
}

// offered is an accepted connection and the hello it presented.
type offered struct {
	conn  net.Conn
	hello hello
}

func (o offered) Hello() softrc.Hello { return o.hello }

// Close refuses the connection.
func (o offered) Close() {
	o.conn.Write(replyBytes(handshakeRefused))
	o.conn.Close()
}

func newQueuePair(pd *domain, core *softrc.QP, maxInline int) *queuePair {
	q := &queuePair{
		QP:         core,
		pd:         pd,
		maxInline:  maxInline,
		wakeWriter: make(chan struct{}, 1),
		ctrlTaken:  make(chan struct{}, 1),
	}
	return q
}

// Connect connects to the peer. One side dials the other's listener and
// presents both secrets; the other accepts only that connection. The roles
// decide which (see softrc.ShouldDial). Connect fails with ErrInvalidInfo
// for malformed info or roles that cannot meet, leaving the queue pair in
// RESET, and honours ctx.
func (q *queuePair) Connect(ctx context.Context, remote []byte) error {
	peer, err := parseInfo(remote)
	if err != nil {
		return err
	}
	return q.QP.Connect(ctx, peer.Secret, q.role, peer.Role, func(ctx context.Context, dial bool) (start, abort func(), err error) {
		var conn net.Conn
		if dial {
			conn, err = q.dial(ctx, peer)
		} else {
			conn, err = q.accept(ctx, peer)
		}
		if err != nil {
			return nil, nil, err
		}
		return func() { q.start(conn) }, func() { conn.Close() }, nil
	})
}

// start starts the writer and the receiver on conn; the caller holds Mu.
func (q *queuePair) start(conn net.Conn) {
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		if n := q.pd.opts.socketBuffer; n > 0 {
			tc.SetReadBuffer(n)
			tc.SetWriteBuffer(n)
		}
	}
	if sc, ok := conn.(syscall.Conn); ok {
		q.raw, _ = sc.SyscallConn()
	}
	q.active = 2
	q.Start(conn, func() { q.writer(conn) }, func() { q.receiver(conn, bufio.NewReaderSize(newLowatConn(conn, q.raw), readBufferSize)) })
}

// dial connects to the peer's listener and presents both secrets.
func (q *queuePair) dial(ctx context.Context, peer softrc.Info) (net.Conn, error) {
	return q.Dial(ctx, "tcp", peer.Addr, q.pd.opts.dialTimeout, func(conn net.Conn) error {
		if _, err := conn.Write(encodeHello(hello{Acceptor: peer.Secret, Dialer: q.Secret, QPID: peer.QPID})); err != nil {
			return err
		}
		status, err := readReply(conn)
		if err == nil && status != handshakeOK {
			err = fmt.Errorf("the peer refused it (status %d)", status)
		}
		return err
	})
}

// accept waits for the peer's connection, checks that it presents the
// peer's secret as well as ours, and accepts it.
func (q *queuePair) accept(ctx context.Context, peer softrc.Info) (net.Conn, error) {
	o, err := q.AcceptOffer(ctx, peer.Secret)
	if err != nil {
		return nil, err
	}
	in := o.(offered)
	if _, err := in.conn.Write(replyBytes(handshakeOK)); err != nil {
		in.conn.Close()
		return nil, q.Errorf("answering the handshake: %w", err)
	}
	in.conn.SetDeadline(time.Time{})
	return in.conn, nil
}

// PostSendUnlock queues checked requests for the writer, or writes them
// itself when the connection is nearly idle (the direct path, see
// writeQueued). Lazy requests posted while the queue's completions are
// being delivered are Early (see earlyLocked); while the receiver holds
// such requests back (holdEarly) they wait for it.
func (q *queuePair) PostSendUnlock(ws []softrc.SendWR) {
	allEarly := q.earlyLocked(ws)
	for i := range ws {
		w := &ws[i]
		q.nextSeq++
		w.Seq = q.nextSeq
		q.sendqBytes += payloadBytes(w)
		q.Sendq = append(q.Sendq, w)
	}
	if allEarly && (q.holding || q.sendqBytes > directMaxQueued && q.rxBusy.Load()) {
		// Held for the receiver, which delivers the completions these
		// answer and writes what was held before it next waits: within
		// a burst (holdEarly), with the rest of the burst's answers;
		// past the direct path's bound (a Fetch's landing Written with
		// its answer) while it is busy with what it read, without
		// waking the writer, as the direct path would for a small
		// answer. (Not while it waits for the connection: Early
		// requests of a delivery by the queue's Run goroutine go as
		// any other.)
		q.held = true
		q.Mu.Unlock()
		return
	}
	conn, raw := q.ConnLocked(), q.raw
	q.Mu.Unlock()
	if q.writeMu.TryLock() {
		wrote, _, _ := q.writeQueued(conn, true, nil, raw)
		q.writeMu.Unlock()
		if wrote {
			return // or failed: the requests are posted, the flush completes them
		}
	}
	softrc.Signal(q.wakeWriter)
}

// PostRecvUnlock: the receiver takes receives from the core's Recvq.
func (q *queuePair) PostRecvUnlock() { q.Mu.Unlock() }

// Grant opens length bytes at offset of region to this queue pair's peer
// with one right; see verbs.QueuePair.
func (q *queuePair) Grant(region verbs.MemoryRegion, offset, length int, access verbs.Access) (verbs.Grant, error) {
	return q.QP.Grant(region, offset, length, access, nil, func() {
		// A Write through the grant is still arriving, or a Read response
		// from it still leaving, RevokeWait after Revoke: end them with the
		// connection.
		q.Fail(verbs.StatusTransport, q.Errorf("a transfer through a revoked grant did not end within %v", softrc.RevokeWait))
		q.CloseConn()
	})
}

// Shutdown drops the control frames still queued (Close; the writer and
// the receiver have returned).
func (q *queuePair) Shutdown() { q.releaseCtrl() }
