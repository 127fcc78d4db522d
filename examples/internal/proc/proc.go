// Package proc runs the examples' peers as separate processes: the example
// re-executes its own binary in another role, talks to it over the child's
// stdin and stdout (one line per message), and stops it by closing stdin.
//
// The role travels in an environment variable rather than a flag, so that
// the same mechanism works for `go run` binaries and for test binaries,
// whose command line belongs to the testing package.
//
// # Caveats
//
// A child must treat the end of its stdin as the order to stop, so that it
// also ends when the parent dies. Its stderr is the parent's; only protocol
// lines go to its stdout.
package proc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// RoleEnv is the environment variable that names the role of a re-executed
// example process. It is empty in the process the user started.
const RoleEnv = "TENSORRPC_EXAMPLE_ROLE"

// Role is this process's role, "" for the process the user started.
func Role() string { return os.Getenv(RoleEnv) }

// Process is a running child: this program re-executed in another role.
type Process struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *lineQueue

	waitErr error // set before exited is closed
	exited  chan struct{}
}

// Start re-executes this program in role with args. The child inherits the
// environment and stderr.
func Start(role string, args ...string) (*Process, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("proc: finding this program: %w", err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), RoleEnv+"="+role)
	cmd.Stderr = os.Stderr
	out := newLineQueue()
	cmd.Stdout = out
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("proc: starting %s: %w", role, err)
	}
	p := &Process{cmd: cmd, stdin: stdin, out: out, exited: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait() // also waits for stdout to be copied
		out.close()
		close(p.exited)
	}()
	return p, nil
}

// Exited is closed when the child has exited; Err then says how.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Err is the child's exit error, valid once Exited is closed: nil when it
// exited with status 0.
func (p *Process) Err() error {
	<-p.exited
	return p.waitErr
}

// PID is the child's process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// ReadLine returns the child's next line of output. It fails when the
// child exits without printing one, or when ctx ends.
func (p *Process) ReadLine(ctx context.Context) (string, error) {
	return p.out.next(ctx)
}

// WriteLine sends one line to the child's stdin.
func (p *Process) WriteLine(line string) error {
	_, err := io.WriteString(p.stdin, line+"\n")
	return err
}

// Stop closes the child's stdin, which tells it to end, and waits for it
// to exit; after timeout it kills it. It returns the child's exit error.
func (p *Process) Stop(timeout time.Duration) error {
	p.stdin.Close()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("proc: pid %d did not exit within %v of being told to stop; killed", p.PID(), timeout)
	}
	return p.waitErr
}

// Kill kills the child at once and waits for it. It is safe to call after
// Stop.
func (p *Process) Kill() {
	p.stdin.Close()
	select {
	case <-p.exited:
		return
	default:
	}
	p.cmd.Process.Kill()
	<-p.exited
}

// Group is a set of children that are stopped together.
type Group []*Process

// Stop stops every child (see Process.Stop) and returns the first error.
func (g Group) Stop(timeout time.Duration) error {
	for _, p := range g {
		p.stdin.Close() // all at once: peers may wait for each other to go
	}
	var first error
	for _, p := range g {
		if err := p.Stop(timeout); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Kill kills every child.
func (g Group) Kill() {
	for _, p := range g {
		p.Kill()
	}
}

// lineQueue is the child's stdout: an io.Writer that splits what the child
// prints into lines and queues them without bound, so that the goroutine
// os/exec copies with never blocks on a parent that reads nothing.
type lineQueue struct {
	mu      sync.Mutex
	partial strings.Builder
	lines   []string
	closed  bool
	notify  chan struct{} // closed and replaced whenever lines or closed change
}

func newLineQueue() *lineQueue { return &lineQueue{notify: make(chan struct{})} }

func (q *lineQueue) Write(b []byte) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.partial.Write(b)
	if s := q.partial.String(); strings.Contains(s, "\n") {
		parts := strings.Split(s, "\n")
		q.lines = append(q.lines, parts[:len(parts)-1]...)
		q.partial.Reset()
		q.partial.WriteString(parts[len(parts)-1])
		q.wake()
	}
	return len(b), nil
}

func (q *lineQueue) close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	q.wake()
}

func (q *lineQueue) wake() {
	close(q.notify)
	q.notify = make(chan struct{})
}

var errExited = errors.New("proc: the child exited")

func (q *lineQueue) next(ctx context.Context) (string, error) {
	for {
		q.mu.Lock()
		if len(q.lines) > 0 {
			l := q.lines[0]
			q.lines = q.lines[1:]
			q.mu.Unlock()
			return l, nil
		}
		if q.closed {
			q.mu.Unlock()
			return "", errExited
		}
		notify := q.notify
		q.mu.Unlock()
		select {
		case <-notify:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}
