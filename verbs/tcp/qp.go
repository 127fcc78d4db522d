package tcp

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// defaultMaxInline is the largest payload the sender copies next to its
// frame header instead of handing the kernel a separate slice.
const defaultMaxInline = 1024

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
	sendOutstanding  atomic.Int64 // posted sends not yet polled
	recvOutstanding  atomic.Int64 // posted receives not yet polled

	incoming   chan offered   // connections accepted for this queue pair
	errored    chan struct{}  // closed on entering ERR
	wakeWriter chan struct{}  // one slot
	recvPosted chan struct{}  // one slot
	wg         sync.WaitGroup // writer and receiver

	// writeMu is held by whoever writes frames to the connection: the
	// writer goroutine or, on the direct path, a poster. batch belongs to
	// its holder.
	writeMu sync.Mutex
	batch   frameBatch

	mu           sync.Mutex
	state        verbs.QPState
	connecting   bool
	closed       bool
	conn         net.Conn
	cause        error        // why the queue pair is in ERR
	flushStatus  verbs.Status // status of sent requests flushed in ERR
	nextSeq      uint64
	sendq        []*sendWR // posted, not yet taken by the writer
	inflight     []*sendWR // taken by the writer, waiting for the response
	ctrl         []ctrlFrame
	recvq        []*recvWR
	spareReqs    []*sendWR   // recycled by writeQueued
	spareCtrls   []ctrlFrame // recycled by writeQueued
	sendqBytes   int         // payload bytes in sendq
	ctrlBytes    int         // payload bytes in ctrl
	unackedBytes int         // payload bytes in inflight
	delayedAcks  int         // acknowledgements queued without waking the writer
	ackTimer     *time.Timer // wakes the writer for delayed acknowledgements
	active       int         // goroutines that may still touch memory
	running      int         // goroutines still using the connection
}

// sendWR is a posted send queue request.
type sendWR struct {
	id     uint64
	op     verbs.Opcode
	imm    uint32
	hasImm bool
	remote verbs.Remote
	region *memoryRegion // nil for an empty buffer
	buf    []byte
	seq    uint64
	// localErr says the region was deregistered before the request was
	// sent; the flush completes it with StatusLocalProtection.
	localErr bool
}

// recvWR is a posted receive.
type recvWR struct {
	id     uint64
	region *memoryRegion
	buf    []byte
}

// ctrlFrame is a response the receiver queues for the writer: an
// acknowledgement or a read response whose payload is region memory.
type ctrlFrame struct {
	hdr     header
	payload []byte
	region  *memoryRegion
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
		incoming:   make(chan offered, 4),
		errored:    make(chan struct{}),
		wakeWriter: make(chan struct{}, 1),
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

// shouldDial says whether this queue pair dials the peer: a RoleDial side
// dials and a RoleAccept side accepts; a RoleAny side does the opposite of
// a peer with a role, and of two RoleAny sides the one with the smaller
// secret dials. Two RoleDial or two RoleAccept sides cannot connect.
func (q *queuePair) shouldDial(peer info) (bool, error) {
	if q.role != verbs.RoleAny && q.role == peer.role {
		return false, fmt.Errorf("tcp: queue pair %d: both sides have role %s, so neither would %s: %w",
			q.id, q.role, map[verbs.ConnectRole]string{verbs.RoleDial: "accept", verbs.RoleAccept: "dial"}[q.role], verbs.ErrInvalidInfo)
	}
	switch {
	case q.role == verbs.RoleDial:
		return true, nil
	case q.role == verbs.RoleAccept:
		return false, nil
	case peer.role == verbs.RoleAccept:
		return true, nil
	case peer.role == verbs.RoleDial:
		return false, nil
	}
	return bytes.Compare(q.secret[:], peer.secret[:]) < 0, nil
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
			if !in.hello.dialer.equal(peer.secret) {
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
	ws := make([]*sendWR, len(wrs))
	for i := range wrs {
		w, err := q.prepareSend(&wrs[i])
		if err != nil {
			return fmt.Errorf("tcp: queue pair %d: PostSend request %d (id %d): %w", q.id, i, wrs[i].ID, err)
		}
		ws[i] = w
	}
	q.mu.Lock()
	if err := q.postableLocked(true); err != nil {
		q.mu.Unlock()
		return err
	}
	if n := q.sendOutstanding.Load(); n+int64(len(ws)) > int64(q.maxSend) {
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: PostSend of %d requests with %d of %d outstanding: %w", q.id, len(ws), n, q.maxSend, verbs.ErrQueueFull)
	}
	q.sendOutstanding.Add(int64(len(ws)))
	for _, w := range ws {
		q.nextSeq++
		w.seq = q.nextSeq
	}
	for _, w := range ws {
		q.sendqBytes += payloadBytes(w)
	}
	q.sendq = append(q.sendq, ws...)
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
	switch {
	case q.closed:
		return fmt.Errorf("tcp: queue pair %d: %w", q.id, verbs.ErrClosed)
	case q.state == verbs.QPError:
		return fmt.Errorf("tcp: queue pair %d: %w: %v", q.id, verbs.ErrQPError, q.cause)
	case send && q.state != verbs.QPReadyToSend:
		return fmt.Errorf("tcp: queue pair %d in %v: %w", q.id, q.state, verbs.ErrNotConnected)
	}
	return nil
}

// prepareSend checks a request's local side.
func (q *queuePair) prepareSend(wr *verbs.SendRequest) (*sendWR, error) {
	w := &sendWR{id: wr.ID, op: wr.Op, imm: wr.Imm, remote: wr.Remote}
	switch wr.Op {
	case verbs.OpSend:
		w.hasImm = wr.HasImm
	case verbs.OpWriteImm:
		w.hasImm = true
	case verbs.OpWrite, verbs.OpRead:
	default:
		return nil, fmt.Errorf("opcode %v cannot be posted to a send queue: %w", wr.Op, verbs.ErrUnsupported)
	}
	need := verbs.Access(0)
	if wr.Op == verbs.OpRead {
		need = verbs.AccessLocalWrite
	}
	r, buf, err := q.localSpan(wr.Local, need)
	if err != nil {
		return nil, err
	}
	w.region, w.buf = r, buf
	return w, nil
}

// localSpan checks a local buffer; an empty buffer needs no region. The
// region is checked again, and referenced, while the data moves.
func (q *queuePair) localSpan(l verbs.Local, need verbs.Access) (*memoryRegion, []byte, error) {
	if l.Offset < 0 || l.Length < 0 {
		return nil, nil, fmt.Errorf("local buffer at offset %d of length %d: %w", l.Offset, l.Length, verbs.ErrInvalidMemory)
	}
	if l.Region == nil {
		if l.Length == 0 {
			return nil, nil, nil
		}
		return nil, nil, fmt.Errorf("local buffer of %d bytes has no region: %w", l.Length, verbs.ErrInvalidMemory)
	}
	r, ok := l.Region.(*memoryRegion)
	if !ok || r.pd != q.pd {
		return nil, nil, fmt.Errorf("local region does not belong to the queue pair's domain: %w", verbs.ErrInvalidMemory)
	}
	if r.access&need != need {
		return nil, nil, fmt.Errorf("local region %#x grants %v, the request needs %v: %w", r.key, r.access, need, verbs.ErrInvalidMemory)
	}
	buf, ok := r.span(uint64(l.Offset), uint64(l.Length))
	if !ok {
		return nil, nil, fmt.Errorf("local buffer [%d, +%d) lies outside region %#x of %d bytes: %w", l.Offset, l.Length, r.key, len(r.bytes), verbs.ErrInvalidMemory)
	}
	if r.isDead() {
		return nil, nil, fmt.Errorf("local region %#x is deregistered: %w", r.key, verbs.ErrInvalidMemory)
	}
	return r, buf, nil
}

// PostRecv posts receives. Receives may be posted before Connect. Like
// PostSend it posts all or none.
func (q *queuePair) PostRecv(wrs ...verbs.RecvRequest) error {
	if len(wrs) == 0 {
		return nil
	}
	rs := make([]*recvWR, len(wrs))
	for i := range wrs {
		region, buf, err := q.localSpan(wrs[i].Local, verbs.AccessLocalWrite)
		if err != nil {
			return fmt.Errorf("tcp: queue pair %d: PostRecv request %d (id %d): %w", q.id, i, wrs[i].ID, err)
		}
		rs[i] = &recvWR{id: wrs[i].ID, region: region, buf: buf}
	}
	q.mu.Lock()
	if err := q.postableLocked(false); err != nil {
		q.mu.Unlock()
		return err
	}
	if n := q.recvOutstanding.Load(); n+int64(len(rs)) > int64(q.maxRecv) {
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: PostRecv of %d requests with %d of %d outstanding: %w", q.id, len(rs), n, q.maxRecv, verbs.ErrQueueFull)
	}
	q.recvOutstanding.Add(int64(len(rs)))
	q.recvq = append(q.recvq, rs...)
	q.mu.Unlock()
	signal(q.recvPosted)
	return nil
}

// Close moves the queue pair to ERR, closes its connection, waits for its
// goroutines and completes every outstanding request with StatusFlushed.
func (q *queuePair) Close() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return fmt.Errorf("tcp: queue pair %d: %w", q.id, verbs.ErrClosed)
	}
	q.closed = true
	q.mu.Unlock()
	q.enterError(verbs.StatusFlushed, fmt.Errorf("tcp: queue pair %d closed", q.id))
	q.mu.Lock()
	conn := q.conn
	q.mu.Unlock()
	if conn != nil {
		conn.Close()
	}
	q.wg.Wait()
	q.mu.Lock()
	if q.ackTimer != nil {
		q.ackTimer.Stop()
	}
	q.mu.Unlock()
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
	q.sendCQ.unreserve(q.maxSend)
	q.recvCQ.unreserve(q.maxRecv)
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
