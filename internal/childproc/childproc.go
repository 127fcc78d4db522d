// Package childproc runs peers as separate processes: a program (an
// example, or a test binary) re-executes itself in another role, talks to
// the child over the child's stdin and stdout (one line per message), and
// stops it by closing stdin.
//
// The role travels in an environment variable (RoleEnv) rather than a
// flag, so that the same mechanism works for `go run` binaries and for test
// binaries, whose command line belongs to the testing package. A test
// binary catches its role in TestMain (or in an init function) before
// m.Run; it passes "-test.run=^$" among the child's arguments so that a
// child that misses its role runs no tests. Package childtest has the
// helpers for tests.
//
// # Caveats
//
// A child must treat the end of its stdin as the order to stop, so that it
// also ends when the parent dies. Its stderr is the parent's; only protocol
// lines go to its stdout.
//
// Lines the child prints are queued without bound until the parent reads
// them, so that the child never blocks on a parent that reads nothing; a
// child that prints a lot should have its lines read.
package childproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"time"
)

// RoleEnv is the environment variable that names the role of a re-executed
// process. It is empty in the process the user started.
const RoleEnv = "TENSORRPC_CHILD_ROLE"

// Role is this process's role, "" for the process the user started.
func Role() string { return os.Getenv(RoleEnv) }

// Options say how StartWith runs a child. The zero value runs this program
// without arguments.
type Options struct {
	// Args are the child's arguments.
	Args []string
	// Prefix, if set, is a command that runs the child: this program's
	// path and Args follow it, as in {"ip", "netns", "exec", "ns1"}. The
	// prefix must exec the program (or at least pass stdin, stdout and the
	// environment through), and PID is then the prefix's.
	Prefix []string
	// Env is added to the environment this process passes on; RoleEnv is
	// set after it.
	Env []string
}

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
	return StartWith(role, Options{Args: args})
}

// StartWith re-executes this program in role as o says. The child
// inherits the environment and stderr.
func StartWith(role string, o Options) (*Process, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("childproc: finding this program: %w", err)
	}
	argv := append(append(append([]string(nil), o.Prefix...), exe), o.Args...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), o.Env...), RoleEnv+"="+role)
	cmd.Stderr = os.Stderr
	out := newLineQueue()
	cmd.Stdout = out
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("childproc: starting %s: %w", role, err)
	}
	p := &Process{cmd: cmd, stdin: stdin, out: out, exited: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait() // also waits for stdout to be copied
		out.close()
		close(p.exited)
	}()
	return p, nil
}

// Exited is closed when the child has exited and all its output is
// queued; Wait then says how.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Wait waits for the child to exit and returns its exit error: nil when
// it exited with status 0.
func (p *Process) Wait() error {
	<-p.exited
	return p.waitErr
}

// ProcessState waits for the child to exit and returns how it ended.
func (p *Process) ProcessState() *os.ProcessState {
	<-p.exited
	return p.cmd.ProcessState
}

// Signaled waits for the child to exit and reports whether a signal ended
// it (a Kill, for one), rather than an exit of its own.
func (p *Process) Signaled() bool {
	ws, ok := p.ProcessState().Sys().(interface{ Signaled() bool })
	return ok && ws.Signaled()
}

// PID is the child's process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// ErrExited is what ReadLine returns once the child has exited and every
// line it printed has been read.
var ErrExited = errors.New("childproc: the child exited")

// ReadLine returns the child's next line of output, without its line end.
// It returns ErrExited when the child exits without printing one, and
// ctx's error when ctx ends first.
func (p *Process) ReadLine(ctx context.Context) (string, error) {
	return p.out.next(ctx)
}

// WriteLine sends one line to the child's stdin.
func (p *Process) WriteLine(line string) error {
	_, err := io.WriteString(p.stdin, line+"\n")
	return err
}

// CloseStdin closes the child's stdin, which tells it to end, and returns
// at once. It is safe to call more than once.
func (p *Process) CloseStdin() { p.stdin.Close() }

// Stop closes the child's stdin, which tells it to end, and waits for it
// to exit; after timeout it kills it. It returns the child's exit error.
func (p *Process) Stop(timeout time.Duration) error {
	p.CloseStdin()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.exited:
	case <-t.C:
		p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("childproc: pid %d did not exit within %v of being told to stop; killed", p.PID(), timeout)
	}
	return p.waitErr
}

// Kill kills the child at once and waits for it. It is safe to call after
// Stop, and more than once.
func (p *Process) Kill() {
	select {
	case <-p.exited:
	default:
		p.cmd.Process.Kill() // before closing stdin, which could end it first
	}
	p.CloseStdin()
	<-p.exited
}

// Group is a set of children that are stopped together.
type Group []*Process

// Stop stops every child (see Process.Stop) and returns the first error.
func (g Group) Stop(timeout time.Duration) error {
	for _, p := range g {
		p.CloseStdin() // all at once: peers may wait for each other to go
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
// os/exec copies with never blocks on a parent that reads nothing. Like
// bufio.ScanLines it drops a "\r" before the "\n", and it keeps a last
// line without "\n".
type lineQueue struct {
	mu      sync.Mutex
	partial []byte
	lines   []string
	closed  bool
	notify  chan struct{} // closed and replaced whenever lines or closed change
}

func newLineQueue() *lineQueue { return &lineQueue{notify: make(chan struct{})} }

func (q *lineQueue) Write(b []byte) (int, error) {
	n := len(b)
	q.mu.Lock()
	defer q.mu.Unlock()
	added := false
	for {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			break
		}
		q.partial = append(q.partial, b[:i]...)
		q.lines = append(q.lines, string(bytes.TrimSuffix(q.partial, []byte("\r"))))
		q.partial = q.partial[:0]
		b = b[i+1:]
		added = true
	}
	q.partial = append(q.partial, b...)
	if added {
		q.wake()
	}
	return n, nil
}

func (q *lineQueue) close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.partial) > 0 {
		q.lines = append(q.lines, string(bytes.TrimSuffix(q.partial, []byte("\r"))))
		q.partial = nil
	}
	q.closed = true
	q.wake()
}

func (q *lineQueue) wake() {
	close(q.notify)
	q.notify = make(chan struct{})
}

func (q *lineQueue) next(ctx context.Context) (string, error) {
	for {
		q.mu.Lock()
		if len(q.lines) > 0 {
			l := q.lines[0]
			q.lines[0] = ""
			q.lines = q.lines[1:]
			q.mu.Unlock()
			return l, nil
		}
		if q.closed {
			q.mu.Unlock()
			return "", ErrExited
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
