package tcp

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"sync"
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

// queuePair implements verbs.QueuePair over one TCP connection, with one
// goroutine writing frames in posting order and one reading and applying
// them in order.
type queuePair struct {
	pd               *domain
	id               uint64
	secret           secret
	role             verbs.ConnectRole
	advertise        string // the listener address in info; "" for RoleDial
	info             []byte
	sendCQ, recvCQ   *completionQueue
	maxSend, maxRecv int
	maxInline        int
	sendQ, recvQ     *softrc.WorkQueue // outstanding requests, until polled

	incoming   chan offered   // connections accepted for this queue pair
	errored    chan struct{}  // closed on entering ERR
	wakeWriter chan struct{}  // one slot
	ctrlTaken  chan struct{}  // one slot: the writer took the queued control frames
	recvPosted chan struct{}  // one slot
	wg         sync.WaitGroup // writer and receiver

	// writeMu is held by whoever writes frames to the connection: the
	// writer goroutine or, on the direct path, a poster. batch belongs to
	// its holder.
	writeMu sync.Mutex
	batch   frameBatch

	mu            sync.Mutex
	state         verbs.QPState
	connecting    bool
	closed        bool
	conn          net.Conn
	cause         error        // why the queue pair is in ERR
	flushStatus   verbs.Status // status of sent requests flushed in ERR
	nextSeq       uint64
	sendq         []*sendWR // posted, not yet taken by the writer
	inflight      []*sendWR // taken by the writer, waiting for the response
	ctrl          []ctrlFrame
	recvq         []*recvWR
	spareReqs     []*sendWR   // recycled by writeQueued
	spareCtrls    []ctrlFrame // recycled by writeQueued
	sendqBytes    int         // payload bytes in sendq
	ctrlBytes     int         // payload bytes in ctrl
	unackedBytes  int         // payload bytes in inflight
	readsInflight int         // Reads in inflight, for Fence
	delayedAcks   int         // acknowledgements queued without waking the writer
	ackYield      bool        // delayable acknowledgements are queued (queueAck)
	active        int         // goroutines that may still touch memory
	running       int         // goroutines still using the connection
}

// sendWR is a posted send queue request.
type sendWR struct {
	id         uint64
	op         verbs.Opcode
	imm        uint32
	hasImm     bool
	unsignaled bool
	fence      bool
	remote     verbs.Remote
	vec        softrc.Vec // the local segments
	n          int        // their length
	seg        [1]softrc.Seg
	seq        uint64
	// localErr says the region was deregistered before the request was
	// sent; the flush completes it with StatusLocalProtection.
	localErr bool
}

// recvWR is a posted receive.
type recvWR struct {
	id  uint64
	vec softrc.Vec
	n   int
	seg [1]softrc.Seg
}

// ctrlFrame is a response the receiver queues for the writer: an
// acknowledgement or a read response whose payload is region memory.
type ctrlFrame struct {
	hdr     header
	payload []byte
	use     softrc.Use // held while payload points into a region (a Read response)
}

// offered is an accepted connection and the hello it presented.
type offered struct {
	conn  net.Conn
	hello hello
}

func newQueuePair(pd *domain, sendCQ, recvCQ *completionQueue, maxSend, maxRecv, maxInline int) *queuePair {
	return &queuePair{
		pd:         pd,
		sendCQ:     sendCQ,
		recvCQ:     recvCQ,
		maxSend:    maxSend,
		maxRecv:    maxRecv,
		maxInline:  maxInline,
		sendQ:      softrc.NewWorkQueue(maxSend),
		recvQ:      softrc.NewWorkQueue(maxRecv),
		incoming:   make(chan offered, 4),
		errored:    make(chan struct{}),
		wakeWriter: make(chan struct{}, 1),
		ctrlTaken:  make(chan struct{}, 1),
		recvPosted: make(chan struct{}, 1),
		state:      verbs.QPReset,
	}
}

// LocalInfo returns the queue pair's connection information.
func (q *queuePair) LocalInfo() []byte { return bytes.Clone(q.info) }

// State returns the queue pair's state.
func (q *queuePair) State() verbs.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.state
}

// offer hands an accepted connection to the queue pair; it fails when the
// queue pair already has connections waiting or is no longer connecting.
func (q *queuePair) offer(c net.Conn, h hello) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed || q.state != verbs.QPReset && q.state != verbs.QPInit {
		return false
	}
	select {
	case q.incoming <- offered{c, h}:
		return true
	default:
		return false
	}
}

// Connect connects to the peer. One side dials the other's listener and
// presents both secrets; the other accepts only that connection. The roles
// decide which (see shouldDial). Connect fails with ErrInvalidInfo for
// malformed info or roles that cannot meet, leaving the queue pair in
// RESET, and honours ctx.
func (q *queuePair) Connect(ctx context.Context, remote []byte) error {
	peer, err := parseInfo(remote)
	if err != nil {
		return err
	}
	if peer.secret == q.secret {
		return fmt.Errorf("tcp: queue pair %d: connection info is the queue pair's own: %w", q.id, verbs.ErrInvalidInfo)
	}
	dial, err := q.shouldDial(peer)
	if err != nil {
		return err
	}
	q.mu.Lock()
	switch {
	case q.closed:
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: connect: %w", q.id, verbs.ErrClosed)
	case q.state != verbs.QPReset || q.connecting:
		st := q.state
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: connect in state %v", q.id, st)
	}
	q.connecting = true
	q.state = verbs.QPInit
	q.mu.Unlock()

	// Close ends a Connect in progress.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-q.errored:
			cancel()
		case <-ctx.Done():
		}
	}()
	var conn net.Conn
	if dial {
		conn, err = q.dial(ctx, peer)
	} else {
		conn, err = q.accept(ctx, peer)
	}

	q.mu.Lock()
	defer q.mu.Unlock()
	q.connecting = false
	if q.closed {
		if err == nil {
			conn.Close()
		}
		err = fmt.Errorf("tcp: queue pair %d: closed while connecting: %w", q.id, verbs.ErrClosed)
	}
	if err != nil {
		if !q.closed {
			q.state = verbs.QPReset
		}
		return err
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		if n := q.pd.opts.socketBuffer; n > 0 {
			tc.SetReadBuffer(n)
			tc.SetWriteBuffer(n)
		}
	}
	q.conn = conn
	q.state = verbs.QPReadyToSend
	q.active, q.running = 2, 2
	q.wg.Add(2)
	go q.writer(conn)
	go q.receiver(conn, bufio.NewReaderSize(conn, readBufferSize))
	q.pd.forget(q)
	return nil
}

// shouldDial says whether this queue pair dials the peer (see
// softrc.ShouldDial).
func (q *queuePair) shouldDial(peer info) (bool, error) {
	dial, err := softrc.ShouldDial(q.role, peer.role, q.secret, peer.secret)
	if err != nil {
		return false, fmt.Errorf("tcp: queue pair %d: %w", q.id, err)
	}
	return dial, nil
}

// dial connects to the peer's listener and presents both secrets.
func (q *queuePair) dial(ctx context.Context, peer info) (net.Conn, error) {
	d := net.Dialer{Timeout: q.pd.opts.dialTimeout}
	conn, err := d.DialContext(ctx, "tcp", peer.addr)
	if err != nil {
		return nil, fmt.Errorf("tcp: queue pair %d: dialing the peer at %s: %w", q.id, peer.addr, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	h := hello{acceptor: peer.secret, dialer: q.secret, qpID: peer.qpID}
	if _, err := conn.Write(h.encode()); err != nil {
		conn.Close()
		return nil, fmt.Errorf("tcp: queue pair %d: handshake with %s: %w", q.id, peer.addr, ctxErr(ctx, err))
	}
	status, err := readReply(conn)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("tcp: queue pair %d: handshake with %s: %w", q.id, peer.addr, ctxErr(ctx, err))
	}
	if status != handshakeOK {
		conn.Close()
		return nil, fmt.Errorf("tcp: queue pair %d: the peer at %s refused the handshake (status %d)", q.id, peer.addr, status)
	}
	if !stop() {
		conn.Close()
		return nil, fmt.Errorf("tcp: queue pair %d: handshake with %s: %w", q.id, peer.addr, ctx.Err())
	}
	conn.SetDeadline(time.Time{})
	return conn, nil
}

// ctxErr prefers the context's error to the I/O error it caused.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// accept waits for the peer's connection, checks that it presents the
// peer's secret as well as ours, and accepts it.
func (q *queuePair) accept(ctx context.Context, peer info) (net.Conn, error) {
	for {
		select {
		case in := <-q.incoming:
			if !in.hello.dialer.Equal(peer.secret) {
				in.conn.Write(replyBytes(handshakeRefused))
				in.conn.Close()
				continue
			}
			if _, err := in.conn.Write(replyBytes(handshakeOK)); err != nil {
				in.conn.Close()
				return nil, fmt.Errorf("tcp: queue pair %d: answering the handshake: %w", q.id, err)
			}
			in.conn.SetDeadline(time.Time{})
			return in.conn, nil
		case <-ctx.Done():
			select {
			case <-q.errored:
				return nil, fmt.Errorf("tcp: queue pair %d: closed while waiting for the peer to connect: %w", q.id, verbs.ErrClosed)
			default:
			}
			return nil, fmt.Errorf("tcp: queue pair %d: waiting for the peer to connect: %w", q.id, ctx.Err())
		}
	}
}

// PostSend posts work requests in order. It checks them all first and posts
// all or none: an error means no request of this call was posted.
func (q *queuePair) PostSend(wrs ...verbs.SendRequest) error {
	if len(wrs) == 0 {
		return nil
	}
	ws, err := softrc.CheckSends(q.pd, limits, wrs, func(w *sendWR) softrc.Vec { return w.seg[:0] }, func(w *sendWR, wr *verbs.SendRequest, vec softrc.Vec) {
		w.id, w.op, w.imm, w.hasImm = wr.ID, wr.Op, wr.Imm, wr.HasImm || wr.Op == verbs.OpWriteImm
		w.unsignaled, w.fence, w.remote, w.vec, w.n = wr.Unsignaled, wr.Fence, wr.Remote, vec, vec.Len()
	})
	if err != nil {
		return fmt.Errorf("tcp: queue pair %d: %w", q.id, err)
	}
	q.mu.Lock()
	if err := q.postableLocked(true); err != nil {
		q.mu.Unlock()
		return err
	}
	if err := q.sendQ.Take(len(ws)); err != nil {
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: PostSend of %w", q.id, err)
	}
	for i := range ws {
		w := &ws[i]
		q.nextSeq++
		w.seq = q.nextSeq
		q.sendqBytes += payloadBytes(w)
		q.sendq = append(q.sendq, w)
	}
	conn := q.conn
	q.mu.Unlock()
	if q.writeMu.TryLock() {
		wrote, _, err := q.writeQueued(conn, true)
		q.writeMu.Unlock()
		if err != nil {
			// The requests are posted; the flush completes them.
			q.enterError(verbs.StatusTransport, fmt.Errorf("tcp: queue pair %d: writing to the peer: %w", q.id, err))
			conn.Close()
			return nil
		}
		if wrote {
			return nil
		}
	}
	signal(q.wakeWriter)
	return nil
}

// postableLocked says why nothing can be posted now, or nil.
func (q *queuePair) postableLocked(send bool) error {
	if err := softrc.PostError(q.closed, q.state, q.cause, send); err != nil {
		return fmt.Errorf("tcp: queue pair %d: %w", q.id, err)
	}
	return nil
}

// PostRecv posts receives. Receives may be posted before Connect. Like
// PostSend it posts all or none.
func (q *queuePair) PostRecv(wrs ...verbs.RecvRequest) error {
	if len(wrs) == 0 {
		return nil
	}
	rs, err := softrc.CheckRecvs(q.pd, limits, wrs, func(r *recvWR) softrc.Vec { return r.seg[:0] }, func(r *recvWR, wr *verbs.RecvRequest, vec softrc.Vec) {
		r.id, r.vec, r.n = wr.ID, vec, vec.Len()
	})
	if err != nil {
		return fmt.Errorf("tcp: queue pair %d: %w", q.id, err)
	}
	q.mu.Lock()
	if err := q.postableLocked(false); err != nil {
		q.mu.Unlock()
		return err
	}
	if err := q.recvQ.Take(len(rs)); err != nil {
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: PostRecv of %w", q.id, err)
	}
	for i := range rs {
		q.recvq = append(q.recvq, &rs[i])
	}
	q.mu.Unlock()
	signal(q.recvPosted)
	return nil
}

// Grant opens length bytes at offset of region to this queue pair's peer
// with one right; see verbs.QueuePair.
func (q *queuePair) Grant(region verbs.MemoryRegion, offset, length int, access verbs.Access) (verbs.Grant, error) {
	return q.pd.table.GrantFor("tcp", q.id, q, &q.mu, &q.closed, region, offset, length, access, nil, func() {
		// A Write through the grant is still arriving, or a Read response
		// from it still leaving, RevokeWait after Revoke: end them with the
		// connection.
		q.enterError(verbs.StatusTransport, fmt.Errorf("tcp: queue pair %d: a transfer through a revoked grant did not end within %v", q.id, softrc.RevokeWait))
		q.mu.Lock()
		conn := q.conn
		q.mu.Unlock()
		if conn != nil {
			conn.Close()
		}
	})
}

// Close moves the queue pair to ERR, closes its connection, waits for its
// goroutines and completes every outstanding request with StatusFlushed.
func (q *queuePair) Close() error {
	if !softrc.BeginClose(&q.mu, &q.closed) {
		return nil
	}
	q.mu.Unlock()
	q.enterError(verbs.StatusFlushed, fmt.Errorf("tcp: queue pair %d closed", q.id))
	q.mu.Lock()
	conn := q.conn
	q.mu.Unlock()
	if conn != nil {
		conn.Close()
	}
	q.wg.Wait()
	for {
		select {
		case in := <-q.incoming:
			in.conn.Close()
			continue
		default:
		}
		break
	}
	q.flush()
	q.pd.table.RevokeAll(q)
	q.sendCQ.Unreserve(q.maxSend)
	q.recvCQ.Unreserve(q.maxRecv)
	q.pd.removeQP(q)
	return nil
}

// signal wakes whoever waits on a one-slot channel.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}
