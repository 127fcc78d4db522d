package shm

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

// queuePair is a reliable connected queue pair: the soft-RC core's queue
// pair (package softrc: state, work queues, checks, flush, Close) over its
// wire, one SOCK_SEQPACKET unix connection and, usually, a pair of shared
// control rings. Two goroutines run while it is connected: the sender
// executes the send queue in order (copies straight into or out of the
// peer's mapped regions, Send payloads through the staging buffer), and
// the receiver handles control messages (doorbells, acks, region
// announcements) from the ring or the socket. Close stops both.
type queuePair struct {
	*softrc.QP
	pd          *domain
	inlineLimit int
	// asleepAt (under asleep.mu) is this queue pair's index in asleep.qps
	// while its receiver sleeps on the socket.
	asleepAt int
	// runningInline (under Mu) is set while PostSendUnlock ends a request
	// it ran in the poster's goroutine, and queuedInline once that queued
	// a completion for it to deliver before it returns.
	runningInline, queuedInline bool
	// runningQueued (under Mu) is set while runQueuedLocked runs: the
	// completions it queues are for the calling goroutine (the receiver,
	// a caller polling, or with runningInline PostSendUnlock) to deliver,
	// and the sender is not woken for the requests behind them.
	runningQueued bool

	// Guarded by Mu. The core's Sendq holds the requests posted and not
	// yet done: Sendq[0] is executing when the sender set executing.
	conn *net.UnixConn
	// executing is set while a request runs, either Sendq[0] in the
	// sender goroutine or one that PostSend runs inline (until its ack
	// arrives, for a Send or WriteImm): requests run one at a time, in
	// posting order.
	executing bool
	// runningOp is the opcode of the request executing.
	runningOp verbs.Opcode
	// early holds the Reads run ahead of their turn, as they were posted
	// (readEarlyLocked), while they wait in Sendq for it: done once the
	// copy ended, with its outcome. ackHeld is set while an ack's
	// completion is on its way to the queue (onAck): nothing starts, and
	// no completion is queued ahead of it.
	early     map[*softrc.SendWR]earlyRead
	ackHeld   bool
	ranQueued int // requests runQueuedLocked ran, for tests
	ranEarly  int // Reads run early, for tests
	// owed holds the acks FailedLocked owes the peer, for failLocked to
	// return.
	owed []message
	// inline counts PostSend calls copying outside mu; Close waits for
	// them before it unmaps the staging buffer.
	inline sync.WaitGroup

	inbound *inbound // a Send or WriteImm being received
	// heldRecv is a successful receive completion held back until the
	// ack of its request is on the wire (see releaseRecv).
	heldRecv verbs.Completion // when held (a value: no allocation a receive)
	held     bool

	// mapWanted is the request id and key of the sender's outstanding
	// msgMapRequest; any other msgMapReply is a protocol violation.
	mapWanted    mapRequest
	unmapWaiters map[uint64]*unmapWaiter
	receiverGone bool // the receiver has ended: no confirmation comes any more
	nextToken    uint64
	readerDone   chan struct{} // closed as the receiver returns; nil until connected

	sqSignal chan struct{} // a token when the send queue may be non-empty

	// Set by Connect before the goroutines start, released by Close after
	// they stop.
	stagingMapping     []byte         // ours, read-write: header, then payload
	staging            []byte         // the payload part of stagingMapping
	localState         *atomic.Uint32 // in our header
	peerStaging        []byte         // the peer's payload area, read-only
	peerStagingMapping []byte
	peerState          *atomic.Uint32 // in the peer's header
	// The control rings, when both ends use them (nil otherwise): rx is
	// ours, which the peer produces into; tx is the peer's.
	rx *ringRx
	tx *ringTx

	// Owned by whoever is executing (see executing).
	nextSeq uint64
	ackCh   chan message // acks of msgSend and msgWriteImm

	mapCh chan mapResult // answers to msgMapRequest, for the holder of fetchMu

	// remote caches what the peer announced, by key: its regions we
	// mapped and its grants. peerRegions holds the peer's regions exposed
	// to us by grants, each mapped whole once, by exposure id; a grant is
	// a window on one of them. regionMaps counts the mappings made for
	// exposed regions (for tests). Copies hold the read lock; the receiver
	// changes the caches with the write lock.
	remoteMu    sync.RWMutex
	remote      map[uint32]*remoteRegion
	peerRegions map[uint64]*peerMemory
	regionMaps  int

	// fetchMu serializes asking the peer for regions (the sender's
	// requests and MapRemote's); mapSeq, the request ids, is guarded by it.
	fetchMu sync.Mutex
	mapSeq  uint64

	// announceMu orders our region announcements to the peer before the
	// matching revocations. announced (guarded by pd.Mu) holds the keys
	// of our regions and grants the peer may have mapped; exposures
	// (guarded by pd.Mu too) the regions the peer mapped whole for our
	// grants, with their exposure ids, taken from nextExposure.
	announceMu   sync.Mutex
	announced    map[uint32]*region
	exposures    map[*region]uint64
	nextExposure uint64

	// probe holds the queue pair's secret, for the peer to read by
	// cross-memory attach in the handshake (see cma_linux.go).
	probe [16]byte
	// cma is what the handshake decided about cross-memory attach; set
	// by Connect (under Mu) before the goroutines start, its pidfd closed
	// by Shutdown.
	cma cmaLink
	// inProcess: the connected peer is this process (SO_PEERCRED), set
	// when the connection starts.
	inProcess atomic.Bool
}

func newQueuePair(pd *domain, core *softrc.QP, cfg verbs.QueuePairConfig) *queuePair {
	qp := &queuePair{
		QP:           core,
		pd:           pd,
		inlineLimit:  pd.opts.inlineLimit,
		unmapWaiters: make(map[uint64]*unmapWaiter),
		early:        make(map[*softrc.SendWR]earlyRead),
		sqSignal:     make(chan struct{}, 1),
		ackCh:        make(chan message, 1),
		mapCh:        make(chan mapResult, 1),
		remote:       make(map[uint32]*remoteRegion),
		peerRegions:  make(map[uint64]*peerMemory),
		announced:    make(map[uint32]*region),
		exposures:    make(map[*region]uint64),
		probe:        core.Secret,
		cma:          cmaLink{pidfd: -1},
	}
	if cfg.MaxInline > 0 {
		qp.inlineLimit = cfg.MaxInline
	}
	return qp
}

// PostSendUnlock posts checked requests: an idle queue pair runs the
// first ones inline (see executeInlineLocked), and a Read behind others
// may run at once too (readEarlyLocked).
func (qp *queuePair) PostSendUnlock(ws []softrc.SendWR) {
	posted := 0
	for i := range ws {
		wr := &ws[i]
		if qp.StateLocked() != verbs.QPError && qp.inlineable(wr) {
			if !qp.executing && len(qp.Sendq) == 0 && !qp.ackHeld && qp.executeInlineLocked(wr) {
				continue
			}
			if qp.canReadEarlyLocked(wr) {
				qp.Sendq = append(qp.Sendq, wr) // its turn, for its completion
				qp.readEarlyLocked(wr)
				continue
			}
		}
		// Behind a running request, or the queue pair failed under an
		// inline request of this call: the sender runs or flushes it.
		qp.Sendq = append(qp.Sendq, wr)
		posted++
	}
	deliver := qp.queuedInline
	qp.queuedInline = false
	// What we queued waits for the request running (whoever ends it goes
	// on with the queue: its sender, its ack's goroutine, a poster ending
	// a Read run early) unless the queue pair is free: then the sender
	// runs it. Waking the sender to find a request running was a
	// hand-off per queued request, with several streams on one lane.
	wake := posted > 0 && !qp.executing && !qp.ackHeld
	if wake && len(qp.Sendq) > 0 {
		if _, copying := qp.early[qp.Sendq[0]]; copying {
			wake = false
		}
	}
	qp.Mu.Unlock()
	if wake {
		softrc.Signal(qp.sqSignal)
	}
	if deliver {
		// Completions of requests run here went to the queue without
		// waking anyone (finishSendLocked): hand them over in this
		// goroutine, which waits for them, usually (a Read).
		qp.Deliver()
	}
}

// earlyRead is the outcome of a Read run ahead of its turn, once done.
type earlyRead struct {
	done bool
	st   verbs.Status
	err  error
}

// maxEarly bounds the Reads of a queue pair run ahead of their turn.
const maxEarly = 64

// canReadEarlyLocked reports whether wr, a Read about to be queued behind
// a running request or queued ones, may copy at once, in the poster's
// goroutine, ahead of its turn: it is not fenced, its peer region is
// mapped already (asking the peer for it is the sender's job), and
// nothing ahead of it writes: what runs is a Send or a Read, or a Send or
// WriteImm whose data is placed and that awaits the peer's ack (on
// Inflight), and only Sends and Reads are queued. Before, such a Read
// waited for the requests ahead (a Send for its ack), then for the sender
// goroutine: with several streams on one lane, each of their Fetches'
// Reads queued behind the others' requests.
func (qp *queuePair) canReadEarlyLocked(wr *softrc.SendWR) bool {
	if wr.Op != verbs.OpRead || wr.Fence || wr.N == 0 || len(qp.early) >= maxEarly {
		return false
	}
	if qp.executing && len(qp.Inflight) == 0 && qp.runningOp != verbs.OpSend && qp.runningOp != verbs.OpRead {
		return false // a Write's copy runs
	}
	for _, q := range qp.Sendq {
		if q.Op != verbs.OpSend && q.Op != verbs.OpRead {
			return false
		}
	}
	qp.remoteMu.RLock()
	_, mapped := qp.remote[wr.Remote.Key]
	qp.remoteMu.RUnlock()
	return mapped
}

// readEarlyLocked runs the Read wr, queued last on Sendq, in the poster's
// goroutine, with qp.Mu released during the copy (see
// canReadEarlyLocked). Its outcome waits on early for its turn, when the
// goroutine running the queue completes it in its place (runQueuedLocked,
// or the sender); if its turn came while it copied, the poster goes on
// with the queue itself. Should the queue pair fail meanwhile, the
// sender's flush completes it, after the copy ended.
//
// What it departs from: the Read may copy before the peer placed a Send
// posted ahead of it in the peer's receive buffer, so a Read of that
// buffer could find the bytes from before the Send (a fenced Read does
// not run so). Its completion still comes in posting order.
func (qp *queuePair) readEarlyLocked(wr *softrc.SendWR) {
	qp.early[wr] = earlyRead{}
	qp.ranEarly++
	qp.inline.Add(1)
	qp.Mu.Unlock()
	st, err, ran := qp.read(wr, false)
	if !ran {
		// Revoked between the look and the copy: the peer deregistered it.
		st, err = verbs.StatusRemoteAccess, fmt.Errorf("shm: remote key %#x was deregistered by the peer", wr.Remote.Key)
	}
	qp.Mu.Lock()
	qp.inline.Done()
	if _, ok := qp.early[wr]; !ok {
		return // flushed
	}
	qp.early[wr] = earlyRead{done: true, st: st, err: err}
	qp.runningInline = true // completions for PostSendUnlock to deliver
	qp.runQueuedLocked()
	qp.runningInline = false
}

// runQueuedLimit is the largest request that runQueuedLocked runs in the
// goroutine that handled an ack; larger ones are the sender's, so that
// no large copy holds up the messages behind the ack.
const runQueuedLimit = 64 << 10

// maxRunQueued bounds the requests one runQueuedLocked runs.
const maxRunQueued = 8

// runQueuedLocked goes on with the queue in the calling goroutine, which
// handled an ack (the receiver, or a caller polling the queue pair) or
// ended a Read run early (its poster), while the queue pair is free: it
// completes the Reads run early at the front, whose copies ended, and
// runs small requests (runQueuedLimit) as the sender would, until one
// awaits its ack. The sender's wake-up for each was, with several streams
// on one lane, about one hand-off per call (a Fetch's request queued
// behind another stream's). For the rest (a larger request, one whose
// peer region is not mapped yet, more than maxRunQueued) it wakes the
// sender. The caller holds Mu, which runQueuedLocked releases while it
// copies, and delivers the completions it queued (CQ.Queue, with
// runningInline or runningQueued set) once it has unlocked.
func (qp *queuePair) runQueuedLocked() {
	qp.runningQueued = true
	defer func() { qp.runningQueued = false }()
	for n := 0; ; {
		if qp.StateLocked() == verbs.QPError || qp.executing || qp.ackHeld || len(qp.Sendq) == 0 {
			return
		}
		wr := qp.Sendq[0]
		if qp.completeEarlyLocked(wr) {
			continue
		}
		if _, ok := qp.early[wr]; ok {
			return // still copying: its poster goes on when it ends
		}
		if n == maxRunQueued || wr.N > runQueuedLimit || !qp.inlineable(wr) {
			softrc.Signal(qp.sqSignal)
			return
		}
		n++
		// wr stays at the front of Sendq while it runs, as it does when
		// the sender runs it.
		st, err, ran, doorbell, ring := qp.startAsideLocked(wr)
		if !ran {
			qp.executing = false
			softrc.Signal(qp.sqSignal) // the sender asks the peer for the region
			return
		}
		qp.Sendq = softrc.TakeFront(qp.Sendq, 1)
		if ring && qp.StateLocked() == verbs.QPError {
			st, err = qp.FailureLocked()
			ring = false
		}
		qp.ranQueued++
		qp.ringLocked(wr, st, err, doorbell, ring)
	}
}

// completeEarlyLocked completes wr, the front of Sendq, if it is a Read
// run early whose copy ended, and reports whether it did. The caller
// holds Mu, which a failure releases for a while (finishSendLocked).
func (qp *queuePair) completeEarlyLocked(wr *softrc.SendWR) bool {
	e, ok := qp.early[wr]
	if !ok || !e.done {
		return false
	}
	delete(qp.early, wr)
	qp.Sendq = softrc.TakeFront(qp.Sendq, 1)
	qp.finishSendLocked(wr, e.st, e.err)
	return true
}

func (qp *queuePair) inlineable(wr *softrc.SendWR) bool {
	if wr.N > qp.inlineLimit {
		return false
	}
	switch wr.Op {
	case verbs.OpWrite, verbs.OpRead, verbs.OpWriteImm:
		return true
	case verbs.OpSend:
		return wr.N <= len(qp.staging)
	}
	return false
}

// executeInlineLocked runs a request in the caller's goroutine, with qp.Mu
// released during the copy (see start): all of a Write or Read; the copy
// and doorbell of a Send or WriteImm, whose completion the receiver queues
// when the ack comes. It reports false, having done nothing, when the
// peer's region is not mapped yet.
func (qp *queuePair) executeInlineLocked(wr *softrc.SendWR) bool {
	st, err, ran, doorbell, ring := qp.startAsideLocked(wr)
	qp.runningInline = true
	defer func() { qp.runningInline = false }()
	if !ran {
		qp.executing = false
		return false
	}
	if qp.StateLocked() == verbs.QPError {
		// Failed or closed while we copied; the peer never heard of it.
		st, err = qp.FailureLocked()
		ring = false
	}
	qp.ringLocked(wr, st, err, doorbell, ring)
	return true
}

// startAsideLocked marks wr executing and runs its start (see start)
// outside the sender, with qp.Mu released, counted in inline so that the
// sender's flush and Close wait for it. The caller holds Mu.
func (qp *queuePair) startAsideLocked(wr *softrc.SendWR) (st verbs.Status, err error, ran bool, doorbell message, ring bool) {
	qp.executing, qp.runningOp = true, wr.Op
	qp.inline.Add(1)
	qp.Mu.Unlock()
	st, err, ran, doorbell, ring = qp.start(wr, false)
	qp.Mu.Lock()
	qp.inline.Done()
	return st, err, ran, doorbell, ring
}

// ringLocked ends the start of wr, the request executing: with a doorbell
// to ring, wr waits on the core's Inflight for the ack that the receiver
// completes it with (onAck); otherwise it completes now (finishSendLocked).
// The caller holds Mu, which ringLocked may release for a while.
func (qp *queuePair) ringLocked(wr *softrc.SendWR, st verbs.Status, err error, doorbell message, ring bool) {
	if !ring {
		qp.executing = false
		qp.finishSendLocked(wr, st, err)
		return
	}
	qp.nextSeq++
	wr.Seq, doorbell.seq = qp.nextSeq, qp.nextSeq
	qp.Inflight = append(qp.Inflight, wr)
	qp.Mu.Unlock()
	err = qp.send(&doorbell, -1)
	qp.Mu.Lock()
	if err != nil {
		acks := qp.failLocked(verbs.StatusTransport, fmt.Errorf("shm: connection to the peer lost: %w", err))
		qp.Mu.Unlock()
		qp.sendAll(acks)
		qp.Mu.Lock()
	}
}

// finishSendLocked queues the completion of wr, the request that was
// executing, with status st and cause err, fails the queue pair if it
// failed and otherwise wakes the sender for the requests queued behind it.
// It may release qp.Mu for a while.
func (qp *queuePair) finishSendLocked(wr *softrc.SendWR, st verbs.Status, err error) {
	if e, ok := qp.SendQ.Complete(softrc.CompletionOf(wr, st, err), wr.Unsignaled); ok {
		// Not through CompleteSend, whose slice would cost an allocation.
		switch {
		case qp.runningInline:
			qp.SendCQ.Queue(e) // PostSendUnlock delivers it
			qp.queuedInline = true
		case qp.runningQueued:
			qp.SendCQ.Queue(e) // the receiver or polling caller delivers it
		default:
			qp.SendCQ.Push(e)
		}
	}
	if st != verbs.StatusSuccess {
		acks := qp.failLocked(verbs.StatusFlushed, verbs.CompletionError(softrc.CompletionOf(wr, st, err)))
		qp.Mu.Unlock()
		qp.sendAll(acks)
		qp.Mu.Lock()
	} else if len(qp.Sendq) > 0 && !qp.runningQueued {
		softrc.Signal(qp.sqSignal) // (runQueuedLocked goes on with them itself)
	}
}

// onAck completes the request awaiting this ack on Inflight (see
// softrc.QP.Ack), and wakes the sender for the requests queued behind it.
// It reports false when none is: the ack of a Send's earlier chunk, for
// the sender goroutine.
func (qp *queuePair) onAck(m message) (bool, error) {
	qp.Mu.Lock()
	mine := len(qp.Inflight) > 0
	qp.Mu.Unlock()
	if !mine {
		return false, nil
	}
	failed, err := qp.Ack(m.seq, m.status, func([]*softrc.SendWR, *softrc.SendWR) {
		qp.executing = false // one request at a time
		// The completions of what runs next follow the one Ack queues
		// after this.
		qp.ackHeld = true
	})
	qp.Mu.Lock()
	qp.ackHeld = false
	qp.runQueuedLocked() // its completions delivered by our caller, as Ack's
	qp.Mu.Unlock()
	if failed {
		qp.fail(0, nil) // in ERR already: sends the acks owed
	}
	return true, err
}

// PostRecvUnlock hands a Send or WriteImm that waits for a receive the
// oldest one posted.
func (qp *queuePair) PostRecvUnlock() {
	var acks []message
	if in := qp.inbound; in != nil && in.recv == nil && len(qp.Recvq) > 0 {
		acks = qp.deliverLocked(in, nil)
	}
	qp.Mu.Unlock()
	qp.sendAll(acks)
	qp.releaseRecv()
}

// fail moves the queue pair to the error state; see failLocked.
func (qp *queuePair) fail(inflight verbs.Status, cause error) {
	qp.Mu.Lock()
	acks := qp.failLocked(inflight, cause)
	qp.Mu.Unlock()
	qp.sendAll(acks)
}

// failLocked moves the queue pair to the error state (see
// softrc.QP.FailLocked and FailedLocked), unless it is there already, and
// returns the acks owed to the peer, for the caller to send after
// unlocking.
func (qp *queuePair) failLocked(inflight verbs.Status, cause error) []message {
	qp.FailLocked(inflight, cause)
	acks := qp.owed
	qp.owed = nil
	return acks
}

// FailedLocked marks the queue pair down for the peer and flushes the
// posted Recvs now; the send queue, and the inline request awaiting an
// ack, are flushed by the sender as it stops.
func (qp *queuePair) FailedLocked() {
	_, cause := qp.FailureLocked()
	if qp.localState != nil {
		qp.localState.Store(stateDown)
	}
	qp.releaseRecvLocked()
	qp.FlushRecvsLocked()
	if in := qp.inbound; in != nil {
		qp.inbound = nil
		in.stopTimer()
		if in.recv != nil {
			qp.completeRecv(verbs.Completion{ID: in.recv.ID, Op: verbs.OpRecv, Status: verbs.StatusFlushed, Err: cause})
		}
		qp.owed = append(qp.owed, message{typ: msgAck, seq: in.seq, status: verbs.StatusTransport})
	}
}

func (qp *queuePair) completeRecv(c verbs.Completion) {
	e, _ := qp.RecvQ.Complete(c, false)
	qp.RecvCQ.Push(e)
}

// holdRecvLocked keeps a successful receive completion until releaseRecv.
// The ack goes out first so that, when our application answers the Send at
// once, the answer does not overtake the ack on the wire and find the
// peer's queue pair still waiting for it.
func (qp *queuePair) holdRecvLocked(c verbs.Completion) {
	qp.releaseRecvLocked()
	qp.heldRecv, qp.held = c, true
}

// releaseRecv queues the held receive completion, if any. Every failure
// releases it before flushing, so receives still complete in order.
func (qp *queuePair) releaseRecv() {
	qp.Mu.Lock()
	qp.releaseRecvLocked()
	qp.Mu.Unlock()
}

// releaseRecvHere is releaseRecv for the receiver, which hands the
// completion over itself (softrc.CQ.Queue, then Deliver in runReceiver).
func (qp *queuePair) releaseRecvHere() {
	qp.Mu.Lock()
	if qp.held {
		c := qp.heldRecv
		qp.heldRecv, qp.held = verbs.Completion{}, false
		e, _ := qp.RecvQ.Complete(c, false)
		qp.RecvCQ.Queue(e)
	}
	qp.Mu.Unlock()
}

func (qp *queuePair) releaseRecvLocked() {
	if qp.held {
		c := qp.heldRecv
		qp.heldRecv, qp.held = verbs.Completion{}, false
		qp.completeRecv(c)
	}
}

// sendAll sends control messages that carry no fd, ignoring errors: a
// broken connection is noticed and reported by the receiver.
//
// Once the queue pair is in ERR, the acks it still owes are its last
// words: it then shuts down its side of the connection, so that the peer's
// queue pair goes to ERR too, as on RC.
func (qp *queuePair) sendAll(msgs []message) {
	for i := range msgs {
		qp.send(&msgs[i], -1)
	}
	qp.Mu.Lock()
	conn := qp.conn
	down := qp.StateLocked() == verbs.QPError && conn != nil && !qp.ClosedLocked()
	qp.Mu.Unlock()
	if down {
		conn.CloseWrite()
	}
}

// send sends one control message, with fd attached when fd >= 0: through
// the peer's control ring when the queue pair has one, else on the socket.
func (qp *queuePair) send(m *message, fd int) error {
	if qp.tx != nil {
		return qp.ringSend(m, fd)
	}
	return qp.writeConn(m, fd)
}

// writeConn writes one control message on the queue pair's socket. The
// peer reads its socket all the time, so a write that cannot go within
// ringFullLimit means a peer that stopped reading: the connection is
// closed, which fails the queue pair (its receiver reads the end), rather
// than leave this writer, and whatever waits on it (Deregister, Revoke,
// the receiver's acks), blocked for good.
func (qp *queuePair) writeConn(m *message, fd int) error {
	qp.conn.SetWriteDeadline(time.Now().Add(ringFullLimit))
	err := writeMessage(qp.conn, m, fd)
	if err != nil {
		qp.conn.Close()
		return fmt.Errorf("shm: writing to the peer's control socket: %w", err)
	}
	return nil
}

// writeMessage writes one control message on the socket, with the fds
// that are >= 0 attached.
func writeMessage(c *net.UnixConn, m *message, fds ...int) error {
	var b [messageSize]byte
	m.encode(&b)
	var oob []byte
	var pass [2]int
	k := 0
	for _, fd := range fds {
		if fd >= 0 && k < len(pass) {
			pass[k] = fd
			k++
		}
	}
	if k > 0 {
		oob = unix.UnixRights(pass[:k]...)
	}
	_, _, err := c.WriteMsgUnix(b[:], oob, nil)
	return err
}

// Shutdown unmaps everything the queue pair mapped (Close; the core
// closed the connection, so the peer sees the queue pair as gone, and its
// goroutines returned).
func (qp *queuePair) Shutdown() {
	qp.Mu.Lock()
	qp.owed = nil // the peer learns from the closed socket
	qp.Mu.Unlock()
	qp.inline.Wait()
	qp.remoteMu.Lock()
	for key, rr := range qp.remote {
		delete(qp.remote, key)
		rr.drop() // Mappings of it keep their own read-only mappings
	}
	for id, pm := range qp.peerRegions {
		delete(qp.peerRegions, id)
		pm.unmap()
	}
	qp.remoteMu.Unlock()
	if qp.stagingMapping != nil {
		unix.Munmap(qp.stagingMapping)
		qp.stagingMapping, qp.staging, qp.localState = nil, nil, nil
	}
	if qp.peerStagingMapping != nil {
		unix.Munmap(qp.peerStagingMapping)
		qp.peerStagingMapping, qp.peerStaging, qp.peerState = nil, nil, nil
	}
	qp.remoteMu.Lock()
	qp.cma.release() // no copy runs: the goroutines and inline posts are done
	qp.remoteMu.Unlock()
	// Senders outside our goroutines (a Deregister, an RNR timer, a
	// PostRecv) may still try the peer's ring: release takes its lock.
	qp.tx.release()
	qp.rx.release()
}

// revoke tells the peer to unmap our region or grant key; see unmapAtPeer.
func (qp *queuePair) revoke(key uint32) {
	qp.unmapAtPeer(message{typ: msgUnmap, key: key})
}

// unexpose tells the peer to drop its mapping of our region r, exposed
// to it by grants as exposure id, with every grant on it; see unmapAtPeer.
func (qp *queuePair) unexpose(r *region, id uint64) {
	qp.unmapAtPeer(message{typ: msgUnmap, flags: flagRegion, key: r.LocalKey(), total: id})
}

// unmapAtPeer sends m, a msgUnmap, and waits for the peer's confirmation,
// for the connection to end, or for the deregister timeout (after which
// the queue pair fails: a peer that keeps a revoked region mapped is not
// one to keep talking to).
func (qp *queuePair) unmapAtPeer(m message) {
	qp.Mu.Lock()
	readerDone := qp.readerDone
	if readerDone == nil {
		qp.Mu.Unlock()
		return
	}
	qp.nextToken++
	token := qp.nextToken
	done := make(chan struct{})
	qp.unmapWaiters[token] = &unmapWaiter{done: done}
	qp.Mu.Unlock()
	defer func() {
		qp.Mu.Lock()
		delete(qp.unmapWaiters, token)
		qp.Mu.Unlock()
	}()

	if err := qp.sendUnmap(&m, token); err != nil {
		return
	}
	t := time.NewTimer(qp.pd.opts.deregisterTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-readerDone:
	case <-t.C:
		qp.failAndClose(qp.unmapTimedOut(m))
	}
}

// unmapWaiter waits for the peer's confirmation of one msgUnmap: a
// goroutine blocked in unmapAtPeer (done), or unmapAtPeerAsync's fn, with
// the timer that fails the queue pair if it does not come.
type unmapWaiter struct {
	done  chan struct{}
	fn    func()
	timer *time.Timer
}

// finish ends w's wait; the waiter is off the map.
func (w *unmapWaiter) finish() {
	if w.done != nil {
		close(w.done)
	}
	if w.fn != nil {
		w.timer.Stop()
		w.fn()
	}
}

// sendUnmap sends m, a msgUnmap, as confirmation request token.
func (qp *queuePair) sendUnmap(m *message, token uint64) error {
	m.seq = token
	qp.announceMu.Lock()
	defer qp.announceMu.Unlock()
	return qp.send(m, -1)
}

// unmapTimedOut is why the queue pair fails when the peer does not
// confirm m within the deregister timeout.
func (qp *queuePair) unmapTimedOut(m message) error {
	what := fmt.Sprintf("region %#x", m.key)
	if m.flags&flagRegion != 0 {
		what = fmt.Sprintf("region %#x (exposure %d)", m.key, m.total)
	}
	return fmt.Errorf("shm: peer did not confirm unmapping %s within %v", what, qp.pd.opts.deregisterTimeout)
}

func (qp *queuePair) unmapConfirmed(token uint64) {
	qp.Mu.Lock()
	w, ok := qp.unmapWaiters[token]
	delete(qp.unmapWaiters, token)
	qp.Mu.Unlock()
	if ok {
		w.finish()
	}
}

// unmapAtPeerAsync is unmapAtPeer without waiting: fn runs once the peer
// confirmed, the connection ended or the deregister timeout failed the
// queue pair; it runs in the receiver (a confirmation), in a timer's
// goroutine, or here (nothing to wait for), and must not block.
func (qp *queuePair) unmapAtPeerAsync(m message, fn func()) {
	qp.Mu.Lock()
	if qp.readerDone == nil || qp.receiverGone {
		qp.Mu.Unlock()
		fn()
		return
	}
	qp.nextToken++
	token := qp.nextToken
	w := &unmapWaiter{fn: fn}
	m.seq = token
	sent := m // the timer's copy: sendUnmap writes m
	w.timer = time.AfterFunc(qp.pd.opts.deregisterTimeout, func() {
		qp.Mu.Lock()
		_, ok := qp.unmapWaiters[token]
		delete(qp.unmapWaiters, token)
		qp.Mu.Unlock()
		if !ok {
			return
		}
		qp.failAndClose(qp.unmapTimedOut(sent))
		fn()
	})
	qp.unmapWaiters[token] = w
	qp.Mu.Unlock()
	if err := qp.sendUnmap(&m, token); err != nil {
		// The queue pair failed: no confirmation comes.
		qp.Mu.Lock()
		_, ok := qp.unmapWaiters[token]
		delete(qp.unmapWaiters, token)
		qp.Mu.Unlock()
		if ok {
			w.finish()
		}
	}
}

// receiverEnded ends the waits for confirmations that will not come: the
// receiver, which reads them, has ended (unmapAtPeer's own waits see
// readerDone close).
func (qp *queuePair) receiverEnded() {
	qp.Mu.Lock()
	qp.receiverGone = true
	var ws []*unmapWaiter
	for token, w := range qp.unmapWaiters {
		if w.fn != nil {
			delete(qp.unmapWaiters, token)
			ws = append(ws, w)
		}
	}
	qp.Mu.Unlock()
	for _, w := range ws {
		w.finish()
	}
}
