package tcp

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// lowatPair is a loopback connection whose reading end goes through
// newLowatConn and bufio, as the receiver's does.
func lowatPair(t *testing.T) (w net.Conn, br *bufio.Reader, mark func() int) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := lis.Accept()
		accepted <- c
	}()
	w, err = net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	r := <-accepted
	if r == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { w.Close(); r.Close() })
	raw, err := r.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	mark = func() int {
		v := -1
		var gerr error
		raw.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT) })
		if gerr != nil {
			t.Errorf("getsockopt SO_RCVLOWAT: %v", gerr)
		}
		return v
	}
	return w, bufio.NewReaderSize(newLowatConn(r, raw), readBufferSize), mark
}

// readWithin runs f and fails the test if it has not returned within
// limit: a low water mark above the bytes still to come would hold the
// read for good.
func readWithin(t *testing.T, limit time.Duration, what string, f func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	case <-time.After(limit):
		t.Fatalf("%s: no return within %v (a receive low water mark above the bytes left?)", what, limit)
	}
}

// A payload larger than the mark's bound, written in pieces of every size
// and then nothing more, is read whole; a small read after it puts the
// mark back to the kernel's default; the payload's bytes are intact.
func TestLowatPayloadThenSilence(t *testing.T) {
	w, br, mark := lowatPair(t)
	const header = 24
	for _, n := range []int{lowatMin - 1, lowatMin, lowatMax - 3, lowatMax + 5, 3*lowatMax + 4097} {
		msg := make([]byte, header+n)
		for i := range msg {
			msg[i] = byte(i*7 + n)
		}
		go func() {
			// Uneven pieces, the last one small, then silence until the
			// next message.
			rest := msg
			for i := 0; len(rest) > 0; i++ {
				k := min(len(rest), []int{100, 70000, 1, 300000, 5000}[i%5])
				if _, err := w.Write(rest[:k]); err != nil {
					return
				}
				rest = rest[k:]
				time.Sleep(time.Millisecond)
			}
		}()
		var hb [header]byte
		dst := make([]byte, n)
		readWithin(t, 20*time.Second, "the message", func() error {
			if _, err := io.ReadFull(br, hb[:]); err != nil {
				return err
			}
			return readPayload(br, dst)
		})
		if !bytes.Equal(hb[:], msg[:header]) || !bytes.Equal(dst, msg[header:]) {
			t.Fatalf("%d-byte payload: bytes differ", n)
		}
	}
	// A small read (a header) with nothing buffered sets the mark back to
	// the default: 1, or 0 as this kernel reports a mark never set, which
	// means the same.
	go w.Write([]byte("0123456789"))
	var small [10]byte
	readWithin(t, 20*time.Second, "a small read", func() error { _, err := io.ReadFull(br, small[:]); return err })
	if got := mark(); got > 1 {
		t.Fatalf("SO_RCVLOWAT after a small read = %d, want 1", got)
	}
}

// Each read sets the mark to what it wants, at most lowatMax, before it
// may wait; reads of less than lowatMin set it back to 1.
func TestLowatMarkFollowsTheRead(t *testing.T) {
	w, br, mark := lowatPair(t)
	c := br                                          // bufio hands reads of at least its buffer's size straight to the conn
	n := 2*lowatMax + lowatMin + 10 + readBufferSize // every read below finds bytes
	go w.Write(make([]byte, n))
	for _, step := range []struct{ read, mark int }{
		{2 * lowatMax, lowatMax}, // only part of it may be there: the read returns that
		{lowatMin + 10, lowatMin + 10},
		{readBufferSize, 1},
	} {
		buf := make([]byte, step.read)
		readWithin(t, 20*time.Second, "a read", func() error { _, err := c.Read(buf); return err })
		if got := mark(); got != step.mark && !(step.mark == 1 && got == 0) {
			t.Fatalf("SO_RCVLOWAT after a read of %d bytes = %d, want %d", step.read, got, step.mark)
		}
	}
}

// A peer that sends part of a payload and closes ends the read with an
// error, even with the mark above what came: the kernel wakes a reader at
// the end of the stream.
func TestLowatPeerClosesMidPayload(t *testing.T) {
	w, br, _ := lowatPair(t)
	go func() {
		w.Write(make([]byte, 100<<10))
		time.Sleep(10 * time.Millisecond) // the reader waits on a raised mark by now, usually
		w.Close()
	}()
	dst := make([]byte, 1<<20)
	readWithin(t, 20*time.Second, "a payload cut short", func() error {
		if err := readPayload(br, dst); err == nil {
			return errors.New("read a whole payload the peer never sent")
		}
		return nil
	})
}
