//go:build !linux

package tcp

import "syscall"

// sendQueueRoom reports whether the kernel's send queue of the connection
// takes n more bytes without a write blocking; where that cannot be
// asked, never (the writer writes instead).
func sendQueueRoom(raw syscall.RawConn, n int, size *int) bool { return false }
