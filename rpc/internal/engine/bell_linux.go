package engine

import (
	"context"
	"encoding/binary"
	"os"
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
