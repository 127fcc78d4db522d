//go:build !linux

package tcp

import "syscall"

// nowWriter writes without blocking where the platform lets us; here it
// writes nothing, and the writer goroutine writes the batch.
type nowWriter struct{}

func (*nowWriter) write(raw syscall.RawConn, bufs [][]byte) (n, asked int, err error) {
	for _, b := range bufs {
		asked += len(b)
	}
	return 0, asked, nil
}
