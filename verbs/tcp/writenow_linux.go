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

// writeNow writes bufs, or their first maxIOV segments, to the socket in
// one system call that does not block (Go's sockets are non-blocking): it
// returns how many bytes the kernel's send queue took (0 when it is
// full) of how many it was offered. iov is scratch space kept between
// calls.
func writeNow(raw syscall.RawConn, bufs [][]byte, iov *[]iovec) (n, asked int, err error) {
	var werr, cerr error
	if raceEnabled {
		// A plain write, which the race detector annotates (see race.go):
		// the batch is one buffer.
		b := bufs[0]
		asked = len(b)
		if writeNowCap != nil {
			b = b[:min(len(b), writeNowCap(asked))]
		}
		cerr = raw.Write(func(fd uintptr) bool {
			for {
				n, werr = syscall.Write(int(fd), b)
				if werr != syscall.EINTR {
					return true
				}
			}
		})
	} else {
		v := (*iov)[:0]
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
		*iov = v
		if writeNowCap != nil {
			v = capIOV(v, writeNowCap(asked))
		}
		if len(v) == 0 {
			return 0, asked, nil
		}
		cerr = raw.Write(func(fd uintptr) bool {
			for {
				r, _, errno := unix.Syscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&v[0])), uintptr(len(v)))
				if errno == unix.EINTR {
					continue
				}
				if errno != 0 {
					werr = errno
				} else {
					n = int(r)
				}
				return true
			}
		})
		clear(*iov) // no references to user memory kept
		runtime.KeepAlive(bufs)
	}
	if cerr != nil {
		return 0, asked, cerr
	}
	if werr == unix.EAGAIN {
		return 0, asked, nil
	}
	if werr != nil || n < 0 {
		return 0, asked, werr
	}
	return n, asked, nil
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
