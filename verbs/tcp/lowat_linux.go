//go:build linux

package tcp

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// lowatConn is the receiver's connection with the socket's receive low
// water mark (SO_RCVLOWAT) raised while a large payload is read straight
// into its destination: the netpoller then wakes the receiver once that
// many bytes wait in the socket, instead of at every segment that
// arrives, so a payload of a megabyte is read in a few large reads
// rather than a dozen small ones that race the sender's delivery for the
// socket's lock. On the 2-core VM (RESULTS "Session 29"): a client's
// reads of a 1 MiB tcp Fetch between processes went from 7.2 to 4.6 a
// call and their time in the kernel from 332 to 186 µs;
// BenchmarkFetch/tcp, four interleaved pairs of runs, moved 1 MiB at
// 1775-2359 MB/s against 1351-1830 and 64 MiB at 2103-2963 against
// 1614-2099.
//
// Safety: the mark never exceeds the bytes the reader still wants, and a
// read that wants more than bufio's own buffer is always the rest of one
// payload (bufio reads straight into the caller's slice only then), which
// the peer sends in full; every other read puts the mark back to 1
// first. The kernel caps the mark (half of tcp_rmem's maximum, or of a
// locked receive buffer) and wakes a reader early when its window would
// close, so a mark cannot hold a read for bytes that cannot come.
type lowatConn struct {
	net.Conn
	raw  syscall.RawConn
	mark int // the socket's SO_RCVLOWAT as last set; 1 stands for the kernel's default (which 6.18 reports as 0), the same
	want int // the mark the next setsockopt sets (set's argument)
	err  error
	set  func(fd uintptr)
}

// lowatMin is the smallest read that raises the mark: smaller payloads
// arrive in a segment or two anyway.
const lowatMin = 4 * readBufferSize

// lowatMax bounds the mark, so that a large payload is still read while
// it arrives (the copy out of the socket overlaps the sender's) rather
// than only once it is all there.
const lowatMax = 256 << 10

func newLowatConn(conn net.Conn, raw syscall.RawConn) net.Conn {
	if raw == nil {
		return conn
	}
	c := &lowatConn{Conn: conn, raw: raw, mark: 1}
	c.set = func(fd uintptr) {
		c.err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, c.want)
	}
	return c
}

func (c *lowatConn) Read(p []byte) (int, error) {
	want := 1
	if len(p) >= lowatMin {
		want = min(len(p), lowatMax)
	}
	if want != c.mark && c.raw != nil {
		c.want, c.err = want, nil
		if err := c.raw.Control(c.set); err != nil || c.err != nil {
			// A socket that takes no option any more is closed or
			// broken, and its reads fail too; stop managing the mark.
			c.raw = nil
		} else {
			c.mark = want
		}
	}
	return c.Conn.Read(p)
}
