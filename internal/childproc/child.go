package childproc

import (
	"bufio"
	"io"
	"os"
	"sync"
)

// The child's side: lines from the parent arrive on stdin, and its end is
// the order to stop. A child reads stdin through ReadParent or WaitForStop
// only, not also through a reader of its own, which could buffer lines
// away from them.

var (
	stdinOnce sync.Once
	stdin     *bufio.Scanner
)

// ReadParent returns the parent's next line. It returns io.EOF when the
// parent closed stdin (told this process to stop, or died).
func ReadParent() (string, error) {
	stdinOnce.Do(func() { stdin = bufio.NewScanner(os.Stdin) })
	if stdin.Scan() {
		return stdin.Text(), nil
	}
	if err := stdin.Err(); err != nil {
		return "", err
	}
	return "", io.EOF
}

// WaitForStop blocks until the parent closes stdin, discarding any lines.
func WaitForStop() {
	for {
		if _, err := ReadParent(); err != nil {
			return
		}
	}
}
