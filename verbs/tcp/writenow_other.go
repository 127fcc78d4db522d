//go:build !linux

package tcp

import "syscall"

type iovec struct{}

// writeNow writes without blocking where the platform lets us; here it
// writes nothing, and the writer goroutine writes the batch.
func writeNow(raw syscall.RawConn, bufs [][]byte, iov *[]iovec) (n, asked int, err error) {
	for _, b := range bufs {
		asked += len(b)
	}
	return 0, asked, nil
}
