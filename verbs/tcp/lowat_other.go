//go:build !linux

package tcp

import (
	"net"
	"syscall"
)

// newLowatConn is conn: the receive low water mark is managed on Linux only.
func newLowatConn(conn net.Conn, _ syscall.RawConn) net.Conn { return conn }
