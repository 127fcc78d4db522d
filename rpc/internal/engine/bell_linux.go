package engine

import (
	"encoding/binary"
	"os"

	"golang.org/x/sys/unix"
)

// bell is an eventfd in Go's netpoller: the wake-up a caller waiting for
// its answer hears (awaitBell). A goroutine that hands an answer over
// through a channel readies the waiter itself, and Go then starts an idle
// thread to run it (wakep); a bell rung by the receiver is found instead
// by the receiver's own thread when it next looks for work, just as it
// finds a socket that became readable, so the caller runs there.
type bell struct{ f *os.File }

func newBell() *bell {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil // callers wait on their channels instead
	}
	return &bell{f: os.NewFile(uintptr(fd), "tensorrpc-answer-bell")}
}

var one = binary.NativeEndian.AppendUint64(nil, 1)

// ring wakes the waiter, or the next one to wait (which then finds
// nothing new and waits again).
func (b *bell) ring() { b.f.Write(one) }

// wait returns once the bell rang since the last wait, or with an error
// once it is closed.
func (b *bell) wait() error {
	var buf [8]byte
	_, err := b.f.Read(buf[:])
	return err
}

func (b *bell) close() { b.f.Close() }
