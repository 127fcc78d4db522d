package tcp

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// sendQueueRoom reports whether the kernel's send queue of the connection
// takes n more bytes without a write blocking: what it holds (SIOCOUTQ)
// and n fit in a quarter of SO_SNDBUF, which reports twice the bytes the
// queue may hold (the rest is the kernel's bookkeeping), leaving a margin.
// *size caches SO_SNDBUF between calls; it is read again when too small,
// since the kernel grows the buffer as the connection goes.
func sendQueueRoom(raw syscall.RawConn, n int, size *int) bool {
	ok := false
	raw.Control(func(fd uintptr) {
		queued, err := unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
		if err != nil {
			return
		}
		if queued+n > *size/4 {
			if *size, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF); err != nil {
				*size = 0
				return
			}
		}
		ok = queued+n <= *size/4
	})
	return ok
}
