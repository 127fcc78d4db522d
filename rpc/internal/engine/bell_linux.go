package engine

import (
	"context"
	"encoding/binary"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// bell is an eventfd in Go's netpoller: the wake-up a caller waiting for
// its answer hears (awaitBell). A goroutine that hands an answer over
// through a channel readies the waiter itself, and Go then starts an idle
// thread to run it (wakep); a bell rung by the receiver is found instead
// by the receiver's own thread when it next looks for work, just as it
// finds a socket that became readable, so the caller runs there.
//
// The waiter never reads the eventfd: each ring is a write, and each
// write is a new edge for Go's edge-triggered netpoller, whether the
// counter was zero or not, so waiting needs no syscall of its own (a read
// to reset the counter cost two a call: one that found nothing before
// parking, one after). What a read would have found, a ring before the
// wait, the waiter learns from what the ringer did before ringing (the
// answer in its channel: wait's ready). The counter grows by one a ring;
// it would take thousands of years at ten million calls a second to
// fill.
type bell struct {
	f  *os.File
	rc syscall.RawConn
	// The waiter's (one at a time: Link.belled), read by look in the
	// waiter's own goroutine (RawConn.Read calls it there): kept here, and
	// look made once, so that a wait allocates nothing.
	ready  func() bool
	looked bool
	look   func(uintptr) bool
	// waitAnswer's: what its waiter waits for, and answered, made once.
	pc       *PendingCall
	ctx      context.Context
	dead     <-chan struct{}
	answered func() bool
}

func newBell() *bell {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil // callers wait on their channels instead
	}
	f := os.NewFile(uintptr(fd), "tensorrpc-answer-bell")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil
	}
	b := &bell{f: f, rc: rc}
	b.look, b.answered = b.lookOnce, b.answerIn
	return b
}

var one = binary.NativeEndian.AppendUint64(nil, 1)

// ring wakes the waiter, or the next one to wait (which then finds
// nothing new and waits again).
func (b *bell) ring() { b.f.Write(one) }

// wait returns at once when ready reports true, else once the bell
// rings (or, now and then, after an earlier ring: callers look for what
// they wait for again), or with an error once it is closed. ready must
// report true when what a ring before the wait announced is there.
func (b *bell) wait(ready func() bool) error {
	b.ready, b.looked = ready, false
	err := b.rc.Read(b.look)
	b.ready = nil
	return err
}

// waitAnswer is wait for pc's answer in its channel, ctx's end or
// dead's closing (awaitBell), without allocating.
func (b *bell) waitAnswer(pc *PendingCall, ctx context.Context, dead <-chan struct{}) error {
	b.pc, b.ctx, b.dead = pc, ctx, dead
	err := b.wait(b.answered)
	b.pc, b.ctx, b.dead = nil, nil, nil
	return err
}

func (b *bell) answerIn() bool { return len(b.pc.Ch) > 0 || b.ctx.Err() != nil || isDone(b.dead) }

// lookOnce is wait's RawConn.Read callback. The first time, Read has
// just forgotten the edges the netpoller saw (it expects a read syscall
// to find what they announced): ready stands in for that read. A ring
// from then on is an edge that ends the park.
func (b *bell) lookOnce(uintptr) bool {
	if b.looked {
		return true
	}
	b.looked = true
	return b.ready()
}

func (b *bell) close() { b.f.Close() }

// threadBell is the bell of a caller locked to its thread (a call from a
// foreign thread through the C ABI): an eventfd outside the netpoller,
// which that caller reads in a blocking read(2), so that the receiver's
// ring wakes its thread straight from the kernel, as a socket wakes a
// thread reading it. Parked in the netpoller instead, the caller is made
// ready by whichever thread polls, and a goroutine locked to its thread
// can only run there: that thread hands its P over and wakes the locked
// one (startlockedm), then sleeps itself, two OS-level switches a call.
//
// Its descriptor is closed by whoever is last of close and a waiter, so
// that neither a read nor a ring ever reaches a number the process has
// since reused.
type threadBell struct {
	mu      sync.Mutex
	fd      int
	waiting bool // a waiter is in read(2) or about to be
	closed  bool // close was called; fd is closed once nobody waits
}

func newThreadBell() *threadBell {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		return nil
	}
	return &threadBell{fd: fd}
}

// ring wakes the waiter, or makes the next read return at once.
func (b *threadBell) ring() {
	b.mu.Lock()
	if !b.closed {
		unix.Write(b.fd, one)
	}
	b.mu.Unlock()
}

// waitAnswer blocks its thread until pc's answer is in its channel, ctx
// ends or dead is closed (whoever ends them rings), or the bell is
// closed. A ring for an earlier call (one whose answer came before its
// caller read) makes one read return early: the loop looks again.
func (b *threadBell) waitAnswer(pc *PendingCall, ctx context.Context, dead <-chan struct{}) error {
	var buf [8]byte
	for {
		if len(pc.Ch) > 0 || ctx.Err() != nil || isDone(dead) {
			return nil
		}
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			return os.ErrClosed
		}
		b.waiting = true
		b.mu.Unlock()
		_, err := unix.Read(b.fd, buf[:])
		b.mu.Lock()
		b.waiting = false
		if b.closed && b.fd >= 0 {
			unix.Close(b.fd)
			b.fd = -1
		}
		b.mu.Unlock()
		if err != nil && err != unix.EINTR {
			return err
		}
	}
}

// close wakes a waiter and closes the descriptor once it has gone.
func (b *threadBell) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	b.closed = true
	if b.waiting {
		unix.Write(b.fd, one) // the waiter closes it
		return
	}
	unix.Close(b.fd)
	b.fd = -1
}
