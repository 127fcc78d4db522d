package tcp

import (
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

type iovec = unix.Iovec

// maxIOV is the most segments one writev takes (IOV_MAX).
const maxIOV = 1024

// nowWriter writes without blocking (write). It is kept with its batch,
// and its RawConn callback made once, so that a write allocates nothing
// (a closure over locals would move them to the heap, four allocations a
// write).
type nowWriter struct {
	iov []iovec // scratch space kept between writes
	one []byte  // the race build's single buffer
	n   int
	err error
	do  func(fd uintptr) bool
}

// write writes bufs, or their first maxIOV segments, to the socket in one
// system call that does not block (Go's sockets are non-blocking): it
// returns how many bytes the kernel's send queue took (0 when it is
// full) of how many it was offered.
func (w *nowWriter) write(raw syscall.RawConn, bufs [][]byte) (n, asked int, err error) {
	if w.do == nil {
		w.do = w.syscall
	}
	w.n, w.err = 0, nil
	if raceEnabled {
		// A plain write, which the race detector annotates (see race.go):
		// the batch is one buffer.
		b := bufs[0]
		asked = len(b)
		if writeNowCap != nil {
			b = b[:min(len(b), writeNowCap(asked))]
		}
		w.one = b
	} else {
		v := w.iov[:0]
		for _, b := range bufs {
			if len(v) == maxIOV {
				break
			}
			if len(b) > 0 {
				e := iovec{Base: &b[0]}
				e.SetLen(len(b))
				v = append(v, e)
				asked += len(b)
			}
		}
		w.iov = v
		if writeNowCap != nil {
			v = capIOV(v, writeNowCap(asked))
		}
		if len(v) == 0 {
			w.iov = v[:0]
			return 0, asked, nil
		}
		w.iov = v
	}
	cerr := raw.Write(w.do)
	clear(w.iov) // no references to user memory kept
	w.iov, w.one = w.iov[:0], nil
	runtime.KeepAlive(bufs)
	if cerr != nil {
		return 0, asked, cerr
	}
	if w.err == unix.EAGAIN {
		return 0, asked, nil
	}
	if w.err != nil || w.n < 0 {
		return 0, asked, w.err
	}
	return w.n, asked, nil
}

// syscall is write's RawConn.Write callback: one writev (one write in the
// race build), retried only when a signal interrupted it.
func (w *nowWriter) syscall(fd uintptr) bool {
	for {
		var r uintptr
		var errno syscall.Errno
		if raceEnabled {
			var n int
			var err error
			n, err = syscall.Write(int(fd), w.one)
			if err == syscall.EINTR {
				continue
			}
			w.n, w.err = n, err
			return true
		}
		r, _, errno = unix.Syscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&w.iov[0])), uintptr(len(w.iov)))
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			w.err = errno
		} else {
			w.n = int(r)
		}
		return true
	}
}

// capIOV shortens v to its first max bytes (a test's writeNowCap).
func capIOV(v []iovec, max int) []iovec {
	for i := range v {
		if l := int(v[i].Len); l >= max {
			if max == 0 {
				return v[:i]
			}
			v[i].SetLen(max)
			return v[:i+1]
		} else {
			max -= l
		}
	}
	return v
}
