package shm

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/mempool"
	"golang.org/x/sys/unix"
)

// The control ring. Each queue pair makes one sealed memfd for the control
// messages it receives and passes it to the peer at connect, next to its
// staging buffer. Both map it read-write: the peer produces into it, we
// consume. Its layout:
//
//	[0:4)     sleeping word: 1 while the consumer is (about to be) blocked
//	          on the socket, waiting for a wake-up
//	[64:end)  a mempool.Ring whose records are encoded control messages
//
// The consumer formats the ring (mempool.NewRing), so its own read position
// starts where it should; the producer attaches to it (mempool.AttachRing).
// Every control message goes through the ring. The socket carries what
// memory cannot: the wake-up (a msgWake), the fd of a msgMapReply (a msgFD
// right after the record, which is marked flagFD) and the peer's death
// (EOF).
//
// Wake-ups are Dekker-style, with sequentially consistent atomics on both
// sides. The consumer stores sleeping = 1, then looks at the ring once more,
// and only if it is empty blocks reading the socket. The producer commits
// its record (an atomic store of the ring's tail), then swaps sleeping from
// 1 to 0 and, if it did, sends a wake-up. Either the consumer's second look
// sees the record or the producer's swap sees the 1, so no wake-up is lost;
// and since only the producer that clears the word sends one, a sleep costs
// at most one wake-up message.
const (
	ringFileSize  = 64 << 10 // about 680 records of 96 bytes
	ringOffset    = 64
	ringRecord    = messageSize
	sleepingWord  = 0
	ringFullLimit = time.Second // how long a producer waits for credit
)

var errRingClosed = errors.New("shm: control ring closed")

// shmFewProcs is the most Ps at which a ring receiver's spin yields to
// its goroutines on every look. Measured with benchmarks/cmd/handoffs on
// 2 CPUs: with GOMAXPROCS=2, yielding on every look keeps a non-inline
// Call at about 30 µs (yielding rarely: 50 to 80 µs); with GOMAXPROCS=16,
// yielding rarely takes a Fetch from 2.2 idle-P starts per call to 0.15
// and its p50 from 26 to 14-20 µs, and never (only sched_yield) the
// Fetch, Call and Send from 0.15-0.51 idle-P starts per call to
// 0.05-0.21, p50 unchanged, as is the p50 of 4 and 16 streams. (Each
// Gosched starts an idle P, Go's wakep, when no thread spins already;
// a goroutine our records made ready is on this P's queue, from where an
// idle P that ready itself woke takes it.)
const shmFewProcs = 4

// ringSpinners counts the ring receivers of the process spinning now
// with sched_yield (with more than shmFewProcs Ps), which
// mayRingSpin bounds.
var ringSpinners atomic.Int32

// mayRingSpin reports whether a ring receiver may spin now (with procs
// Ps, more than shmFewProcs), counting it in ringSpinners (ringSpun when it
// stops): at most a quarter of the Ps' worth of receivers spin at once.
// Their sched_yield keeps the thread and its P: with 16 streams of 1
// MiB Fetches on 8 lanes on the 16-core machine, the 16 receivers of
// both ends (tensorbench, one process) spinning up to maxRingSpin took
// half the CPU time (49% in sched_yield, against 20% in the copies) and
// the Ps the copying streams needed, holding 16 streams to 1.4x one
// stream's throughput. A receiver that may not spin sleeps at once, and
// its peer wakes it (a message on the socket) for its next record.
func mayRingSpin(procs int) bool {
	limit := int32(max(procs/4, 1))
	if ringSpinners.Add(1) > limit {
		ringSpinners.Add(-1)
		return false
	}
	return true
}

func ringSpun() { ringSpinners.Add(-1) }

// errQueuePairClosed ends a receiver draining its ring when Close stops it.
var errQueuePairClosed = errors.New("shm: queue pair closed")

// ringRx is our end of the ring we consume.
type ringRx struct {
	fd       int // until passed to the peer; -1 after
	mapping  []byte
	ring     *mempool.Ring
	sleeping *atomic.Uint32
	// consume is held by whoever drains the ring: the receiver, or a
	// goroutine waiting for a message that polls (queuePair.Poll).
	// released (under consume) says the ring is unmapped.
	consume  sync.Mutex
	released bool
	// pollers is 1 while a goroutine is between BeginPoll and EndPoll;
	// claimed (under consume) says that it took the sleeping word from 1
	// to 0, so that the peer sends no wake-ups while it polls, and
	// EndPoll must set it back.
	pollers atomic.Int32
	claimed bool
	// kicked is set while an awake receiver of the process has ended
	// this receiver's sleep (kick) and it has not woken yet;
	// waitingSince (Unix ns, 0: none) is when an awake receiver first saw
	// records wait in the ring of this one, asleep.
	kicked       atomic.Bool
	waitingSince atomic.Int64
	// resume continues the ring receiver in a new goroutine (set before
	// it starts).
	resume func()
}

// newRingRx makes the memfd of the ring we will consume and formats it.
func newRingRx() (*ringRx, error) {
	fd, mapping, err := newSealedMemfd("tensorrpc-shm-ring", ringFileSize)
	if err != nil {
		return nil, err
	}
	r, err := mempool.NewRing(mapping[ringOffset:])
	if err != nil {
		unix.Munmap(mapping)
		unix.Close(fd)
		return nil, fmt.Errorf("shm: control ring: %w", err)
	}
	return &ringRx{fd: fd, mapping: mapping, ring: r, sleeping: wordAt(mapping, sleepingWord)}, nil
}

// closeFD closes the memfd once the peer has its copy (or will not get one).
func (rx *ringRx) closeFD() {
	if rx == nil {
		return
	}
	closeFD(rx.fd)
	rx.fd = -1
}

func (rx *ringRx) release() {
	if rx == nil {
		return
	}
	rx.consume.Lock()
	defer rx.consume.Unlock()
	rx.released = true
	rx.closeFD()
	if rx.mapping != nil {
		unix.Munmap(rx.mapping)
		rx.mapping, rx.ring, rx.sleeping = nil, nil, nil
	}
}

// ringTx is our end of the peer's ring, which we produce into. mu makes us
// the single producer, keeps the fd that follows a record in record order
// on the socket, and keeps Close from unmapping the ring under a producer.
type ringTx struct {
	mu       sync.Mutex
	mapping  []byte
	ring     *mempool.Ring
	sleeping *atomic.Uint32
	closed   bool
	broken   error         // why the ring cannot be used any more
	wakes    atomic.Uint64 // wake-ups sent (tests)
}

// attachRingTx maps the peer's ring. The peer is not trusted: the memfd
// must be sealed and large enough, and AttachRing checks the header.
func attachRingTx(fd int) (*ringTx, error) {
	if fd < 0 {
		return nil, errors.New("shm: the peer offered a control ring without its memfd")
	}
	if err := checkSealedFD(fd, ringFileSize); err != nil {
		return nil, fmt.Errorf("shm: peer control ring: %v", err)
	}
	mapping, _, err := mapFD(fd, 0, ringFileSize, true)
	if err != nil {
		return nil, fmt.Errorf("shm: peer control ring: %v", err)
	}
	r, err := mempool.AttachRing(mapping[ringOffset:])
	if err == nil && r.MaxRecord() < ringRecord {
		err = fmt.Errorf("%w: records of at most %d bytes", mempool.ErrRingCorrupt, r.MaxRecord())
	}
	if err != nil {
		unix.Munmap(mapping)
		return nil, fmt.Errorf("shm: peer control ring: %w", err)
	}
	return &ringTx{mapping: mapping, ring: r, sleeping: wordAt(mapping, sleepingWord)}, nil
}

func (tx *ringTx) release() {
	if tx == nil {
		return
	}
	tx.mu.Lock()
	defer tx.mu.Unlock()
	tx.closed = true
	if tx.mapping != nil {
		unix.Munmap(tx.mapping)
		tx.mapping, tx.ring, tx.sleeping = nil, nil, nil
	}
}

// put commits one record. A peer that corrupts the ring's header (which it
// can write: the consumer's counter shares the page with ours) could make
// mempool.Ring index out of range; that is recovered here as corruption.
func (tx *ringTx) put(rec *[messageSize]byte) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%w: %v", mempool.ErrRingCorrupt, p)
		}
	}()
	buf, err := tx.ring.Reserve(len(rec))
	if err != nil {
		return err
	}
	copy(buf, rec[:])
	return tx.ring.Commit(len(rec))
}

// ringSend puts a control message into the peer's ring, wakes the peer if
// it sleeps, and sends fd (when >= 0) on the socket right after. A ring
// that is corrupt or stays full fails the queue pair.
func (qp *queuePair) ringSend(m *message, fd int) error {
	tx := qp.tx
	var rec [messageSize]byte
	mm := *m
	if fd >= 0 {
		mm.flags |= flagFD
	}
	mm.encode(&rec)

	tx.mu.Lock()
	if tx.closed {
		tx.mu.Unlock()
		return errRingClosed
	}
	if tx.broken != nil {
		err := tx.broken
		tx.mu.Unlock()
		return err
	}
	var err error
	var full time.Time // since when the ring is full
	for {
		err = tx.put(&rec)
		if !errors.Is(err, mempool.ErrRingFull) {
			break
		}
		// The peer reads its ring all the time and we never have more
		// than a few messages in flight, so a full ring means a peer
		// that stopped reading. Give it a moment, then give up.
		if full.IsZero() {
			full = time.Now()
		}
		if waited := time.Since(full); waited >= ringFullLimit || qp.InError() {
			err = fmt.Errorf("shm: the peer's control ring stayed full for %v: it does not read its control messages", waited.Round(time.Millisecond))
			break
		}
		qp.wakePeerLocked()
		time.Sleep(100 * time.Microsecond) // about a millisecond, in fact: see gpudirect/wait.go
	}
	if err != nil {
		tx.broken = fmt.Errorf("shm: peer control ring: %w", err)
		err = tx.broken
		tx.mu.Unlock()
		qp.failAndClose(err)
		return err
	}
	err = qp.wakePeerLocked()
	if fd >= 0 && err == nil {
		err = qp.writeConn(&message{typ: msgFD, seq: m.seq}, fd)
	}
	tx.mu.Unlock()
	return err
}

// wakePeerLocked sends a wake-up if the peer said it sleeps. The caller
// holds tx.mu and has committed its record.
func (qp *queuePair) wakePeerLocked() error {
	if !qp.tx.sleeping.CompareAndSwap(1, 0) {
		return nil
	}
	qp.tx.wakes.Add(1)
	return qp.writeConn(&message{typ: msgWake}, -1)
}

// runRingReceiver is the receiver of a queue pair whose control messages
// come through the ring: it handles records as they come, polls the ring
// for a while when it runs dry (WithRingSpin), then sleeps on the socket
// until a wake-up, the fd of a record, or the end of the connection.
func (qp *queuePair) runRingReceiver() {
	bufs := newMsgBuffers()
	qp.rx.resume = func() { qp.Continue(func() { qp.ringReceiver(bufs, true) }) }
	qp.ringReceiver(bufs, false)
}

// ringReceiver is runRingReceiver's loop. resumed starts it in a goroutine
// taking over from one whose delivery was detached in the middle of a
// drain (see drainRing): it holds rx.consume, and finishes that drain
// first. A goroutine that hands the loop over returns at once.
func (qp *queuePair) ringReceiver(bufs *msgBuffers, resumed bool) {
	rx := qp.rx
	spin := qp.pd.opts.ringSpin // adapted to the peer's pace: see adaptSpin
	for {
		var n int
		var err error
		if resumed {
			// The receiver is awake; the drain it took over may have
			// begun after it said it slept, see below.
			rx.sleeping.Store(0)
			if n, err = qp.drainHeld(bufs); err == nil && bufs.pendingFD >= 0 {
				err = fmt.Errorf("shm: peer broke the protocol: the fd of record %d on the socket, and no record marked for it in the ring", bufs.pendingSeq)
			}
			resumed = false
		} else {
			n, err = qp.drainLocked(bufs)
		}
		if err == nil {
			lookAfterSleeper(qp) // see asleep
		}
		// Poll for a while before sleeping, which costs the peer a
		// wake-up message and us a trip through the netpoller. Between
		// looks, let the other threads of the host run (the peer's, which
		// has the answer to compute): sched_yield. With few Ps, yield to
		// our own goroutines too, every time (runtime.Gosched): they may
		// have no other P to run on (a call's handler our record started,
		// a caller polling its answer). With many, never: there, Gosched
		// mostly wakes an idle P's thread for nothing, which costs more
		// than the look (shmFewProcs).
		procs := runtime.GOMAXPROCS(0)
		few := procs <= shmFewProcs
		base := qp.pd.opts.ringSpin
		if n == 0 && err == nil && spin > 0 && (few || mayRingSpin(procs)) {
			// With TENSORRPC_COPY=share, the spinning receiver takes
			// chunks of a large copy made elsewhere in the process
			// meanwhile (memcopy.Share), one between looks.
			helping := memcopy.Sharing()
			if helping {
				memcopy.Helping(true)
			}
			for start := time.Now(); n == 0 && err == nil; {
				if time.Since(start) >= spin {
					break
				}
				if helping && memcopy.Help() {
					// The spin counts idle time only, from the end of
					// the chunk.
					start = time.Now()
				} else if few {
					runtime.Gosched()
				} else {
					unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
				}
				lookAfterSleeper(qp)
				n, err = qp.drainLocked(bufs)
			}
			if helping {
				memcopy.Helping(false)
			}
			if !few {
				ringSpun()
			}
		}
		if n == 0 && err == nil {
			rx.sleeping.Store(1)
			if n, err = qp.drainLocked(bufs); n == 0 && err == nil {
				slept := time.Now()
				sleepBegins(qp)
				err = qp.awaitWake(bufs)
				sleepEnds(qp)
				spin = adaptSpin(spin, base, time.Since(slept))
			}
			if err != errDetached {
				rx.sleeping.Store(0)
			}
			if err == nil && bufs.pendingFD >= 0 {
				// The peer commits a record before it sends its fd: the
				// record is in the ring now, and takes the fd.
				if _, err = qp.drainLocked(bufs); err == nil && bufs.pendingFD >= 0 {
					err = fmt.Errorf("shm: peer broke the protocol: the fd of record %d on the socket, and no record marked for it in the ring", bufs.pendingSeq)
				}
			}
		}
		if err == errDetached {
			return // another goroutine receives now
		}
		if err != nil {
			qp.failAndClose(err)
			break
		}
	}
	closeFD(bufs.pendingFD)
	qp.receiverEnded()
	close(qp.readerDone)
}

// maxRingSpin bounds how long adaptSpin lets a receiver poll its empty
// ring: longer than a 1 MiB copy takes (50-100 µs on the 2-core VM).
const maxRingSpin = 200 * time.Microsecond

// adaptSpin is a ring receiver's next spin, after it slept for slept
// having spun for spin (base: the configured spin, 0: never spin). A
// sleep that a little more spinning would have saved (the peer's next
// record came within maxRingSpin) doubles the spin, up to maxRingSpin: a
// peer that copies a large tensor between its records (a Fetch of 1 MiB
// and the next request) is then met awake, without a wake-up message and
// a trip through the netpoller each time. A long sleep halves it, down to
// base: an idle peer is not spun for.
//
// Measured (2-core VM, handoffs -size 1048576 -cases fetch-shm, G=2):
// 1.24-1.45 hand-offs, 1.0 idle-P starts and 3.0-3.3 syscalls per 1 MiB
// Fetch at the fixed 20 µs, p50 89-123 µs; adapted, 0.26-0.31, 0.01-0.02
// and 0.10-0.14, p50 68-90 µs; 4 KiB Fetches and Calls the same either
// way, and with 16 Ps within the runs' spread. After traffic stops, four
// long sleeps bring the spin back to base.
func adaptSpin(spin, base, slept time.Duration) time.Duration {
	switch {
	case base <= 0:
		return 0
	case slept < maxRingSpin:
		return min(max(2*spin, base), maxRingSpin)
	case slept > 4*maxRingSpin:
		return max(spin/2, base)
	}
	return spin
}

// awaitWake sleeps on the socket until the peer's wake-up, or until the fd
// of a record marked flagFD, which the peer sends without a wake-up when a
// poller had cleared the sleeping word (see Poll): readFD takes it from
// bufs.pending.
func (qp *queuePair) awaitWake(bufs *msgBuffers) error {
	m, fds, kicked, err := qp.readSocket(bufs)
	if err != nil {
		return fmt.Errorf("shm: connection to the peer lost: %w", err)
	}
	if kicked {
		return nil // records wait in the ring
	}
	if m.typ == msgFD && fds[0] >= 0 && fds[1] < 0 && bufs.pendingFD < 0 {
		bufs.pendingFD, bufs.pendingSeq = fds[0], m.seq
		return nil
	}
	if m.typ != msgWake || fds[0] >= 0 {
		fds.close()
		return fmt.Errorf("shm: peer broke the protocol: message type %d on the socket while waiting for a wake-up", m.typ)
	}
	return nil
}

// readSocket reads the next message on the socket, as the ring receiver
// does. kicked reports a read that an awake receiver of the process ended
// instead (kick: a read deadline in the past, which it clears).
func (qp *queuePair) readSocket(bufs *msgBuffers) (m message, fds passedFDs, kicked bool, err error) {
	m, fds, err = readMessageFDs(qp.conn, bufs)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		qp.conn.SetReadDeadline(time.Time{})
		qp.rx.kicked.Store(false)
		return m, fds, true, nil
	}
	return m, fds, false, err
}

// drainLocked is drainRing under the ring's consume lock, for the
// receiver.
func (qp *queuePair) drainLocked(bufs *msgBuffers) (int, error) {
	qp.rx.consume.Lock()
	return qp.drainHeld(bufs)
}

// drainHeld is drainLocked for a receiver that holds the consume lock
// already; it releases it, unless the receiver's role was handed over
// (errDetached), with the lock, to the goroutine taking over.
func (qp *queuePair) drainHeld(bufs *msgBuffers) (int, error) {
	rx := qp.rx
	if rx.released {
		rx.consume.Unlock()
		return 0, errQueuePairClosed
	}
	n, err := qp.drainRing(bufs)
	if err != errDetached {
		rx.consume.Unlock()
	}
	return n, err
}

// errDetached ends a receiver's drain whose delivery was detached (see
// handleFrom): a new goroutine, holding the consume lock, finishes it.
var errDetached = errors.New("shm: the receiver's role was handed over")

// errPollStops ends a poller's drain at a record marked flagFD: its fd
// comes on the socket, which only the receiver reads.
var errPollStops = errors.New("shm: a record whose fd only the receiver reads")

// BeginPoll (verbs.Poller) makes the caller the queue pair's poller,
// unless one polls already: one goroutine spinning per queue pair is
// enough to take every answer as it arrives, and more would only burn
// cores (the others wait for theirs, which the poller hands over).
func (qp *queuePair) BeginPoll() bool {
	rx := qp.rx
	return rx != nil && rx.pollers.CompareAndSwap(0, 1)
}

// Poll (verbs.Poller) drains the ring in the calling goroutine, unless the
// receiver or another poller is draining it, and reports whether it
// handled any record. If the receiver sleeps, the first Poll takes its
// sleeping word from 1 to 0 (claimed), so that the peer sends no wake-up
// for what the pollers handle; the last EndPoll sets it back. A record
// marked flagFD is left to the receiver, which the fd's message on the
// socket wakes (awaitWake).
func (qp *queuePair) Poll() bool {
	rx := qp.rx
	if rx == nil || !rx.consume.TryLock() {
		return false
	}
	defer rx.consume.Unlock()
	if rx.released || qp.Closing() {
		return false
	}
	if !rx.claimed && rx.pollers.Load() > 0 && rx.sleeping.CompareAndSwap(1, 0) {
		rx.claimed = true
	}
	n, err := qp.drainRing(nil)
	qp.pollFailed(err)
	return n > 0
}

// EndPoll (verbs.Poller) ends the poller's polling and gives the ring
// back to the sleeping receiver: it sets the sleeping word to 1 and looks
// once more, handling what came before the peer could see it (the
// receiver's own Dekker protocol, see above).
func (qp *queuePair) EndPoll() {
	rx := qp.rx
	if rx == nil || rx.pollers.Add(-1) > 0 {
		return
	}
	rx.consume.Lock()
	defer rx.consume.Unlock()
	if !rx.claimed || rx.released || rx.pollers.Load() > 0 {
		return
	}
	rx.claimed = false
	rx.sleeping.Store(1)
	_, err := qp.drainRing(nil)
	qp.pollFailed(err)
}

// pollFailed fails the queue pair as the receiver would on a drain's
// error (the receiver then ends too, on the closed connection).
func (qp *queuePair) pollFailed(err error) {
	if err != nil && !errors.Is(err, errPollStops) && !errors.Is(err, errQueuePairClosed) {
		go qp.failAndClose(err)
	}
}

// drainRing handles every record in the ring and reports how many there
// were. An error (a corrupt ring, a protocol violation, a lost connection)
// ends the receiver. The caller holds rx.consume; a poller passes no bufs,
// and its drain stops before a record marked flagFD (errPollStops).
func (qp *queuePair) drainRing(bufs *msgBuffers) (int, error) {
	rx := qp.rx
	n := 0
	for {
		// A peer that keeps the ring full would keep us here: Close
		// must not wait for it.
		if qp.Closing() {
			return n, errQueuePairClosed
		}
		if bufs == nil {
			// A poller leaves a record whose fd follows on the socket.
			// (Read returns the record Peek did: we are the consumer.)
			if b, ok := rx.ring.Peek(); !ok {
				if err := rx.ring.Err(); err != nil {
					return n, fmt.Errorf("shm: peer broke the protocol: %w", err)
				}
				return n, nil
			} else if len(b) == messageSize && peekFlags(b)&flagFD != 0 {
				return n, errPollStops
			}
		}
		b, ok := rx.ring.Read()
		if !ok {
			if err := rx.ring.Err(); err != nil {
				return n, fmt.Errorf("shm: peer broke the protocol: %w", err)
			}
			return n, nil
		}
		// The peer can still write the record: copy it before looking.
		var rec [messageSize]byte
		copied := copy(rec[:], b)
		length := len(b)
		rx.ring.Release()
		n++
		if length != messageSize || copied != messageSize {
			return n, fmt.Errorf("shm: peer broke the protocol: control record of %d bytes, want %d", length, messageSize)
		}
		m, err := decodeMessage(rec[:])
		if err != nil {
			return n, fmt.Errorf("shm: peer broke the protocol: %w", err)
		}
		fd := -1
		if m.flags&flagFD != 0 {
			if bufs == nil {
				// Marked after the poller's Peek: only the peer writes there.
				return n, fmt.Errorf("shm: peer broke the protocol: a control record changed while it was read")
			}
			if fd, err = qp.readFD(m.seq, bufs); err != nil {
				return n, err
			}
		}
		var resume func()
		if bufs != nil {
			resume = rx.resume // the receiver's
		}
		detached, err := qp.handleFrom(m, fd, resume)
		if detached {
			return n, errDetached
		}
		if err != nil {
			return n, fmt.Errorf("shm: peer broke the protocol: %w", err)
		}
	}
}

// readFD reads the msgFD that follows a record marked flagFD on the socket,
// skipping wake-ups, and returns its fd.
func (qp *queuePair) readFD(seq uint64, bufs *msgBuffers) (int, error) {
	if fd := bufs.pendingFD; fd >= 0 {
		bufs.pendingFD = -1
		if bufs.pendingSeq != seq {
			closeFD(fd)
			return -1, fmt.Errorf("shm: peer broke the protocol: the fd of record %d on the socket, want the fd of record %d", bufs.pendingSeq, seq)
		}
		return fd, nil
	}
	for {
		m, fds, kicked, err := qp.readSocket(bufs)
		if err != nil {
			return -1, fmt.Errorf("shm: connection to the peer lost: %w", err)
		}
		if kicked || m.typ == msgWake && fds[0] < 0 {
			continue
		}
		if m.typ != msgFD || m.seq != seq || fds[0] < 0 || fds[1] >= 0 {
			fds.close()
			return -1, fmt.Errorf("shm: peer broke the protocol: message type %d (seq %d) on the socket, want the fd of record %d", m.typ, m.seq, seq)
		}
		return fds[0], nil
	}
}
