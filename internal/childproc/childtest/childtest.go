// Package childtest has the helpers for tests that run a peer in another
// process with package childproc: the test binary re-executes itself in a
// role, which its TestMain (or an init function) catches before m.Run:
//
//	func TestMain(m *testing.M) {
//		if role := childproc.Role(); role != "" {
//			os.Exit(runChild(role))
//		}
//		os.Exit(m.Run())
//	}
//
//	func TestPeer(t *testing.T) {
//		p := childtest.Start(t, "server", childproc.Options{})
//		addr := childtest.Line(t, p)
//		...
//	}
//
// It is a package of its own so that childproc, which the examples'
// binaries use, does not import testing.
package childtest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
)

// LineTimeout is how long Line waits for the child's next line.
const LineTimeout = 30 * time.Second

// Start starts this test binary in role as o says, with "-test.run=^$"
// before o.Args so that a child that misses its role runs no tests. It
// fails t when the child cannot start, and kills the child when t ends.
func Start(t testing.TB, role string, o childproc.Options) *childproc.Process {
	t.Helper()
	o.Args = append([]string{"-test.run=^$"}, o.Args...)
	p, err := childproc.StartWith(role, o)
	if err != nil {
		t.Fatalf("starting the child process: %v", err)
	}
	t.Cleanup(p.Kill)
	return p
}

// Line returns the child's next line of output. It fails t when the child
// exits without printing one, or prints nothing for LineTimeout.
func Line(t testing.TB, p *childproc.Process) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), LineTimeout)
	defer cancel()
	l, err := p.ReadLine(ctx)
	switch {
	case errors.Is(err, childproc.ErrExited):
		t.Fatalf("child process %d ended without output: %v", p.PID(), p.ProcessState())
	case err != nil:
		t.Fatalf("child process %d printed nothing for %v", p.PID(), LineTimeout)
	}
	return l
}

// Job waits for a job of several children: it collects procs[0]'s output
// until it exits, then waits for every child to exit, failing t if ctx ends
// first or a child exits unsuccessfully. It returns procs[0]'s output.
func Job(ctx context.Context, t testing.TB, procs []*childproc.Process) string {
	t.Helper()
	var out strings.Builder
	for {
		l, err := procs[0].ReadLine(ctx)
		if errors.Is(err, childproc.ErrExited) {
			break
		}
		if err != nil {
			t.Fatalf("child 0: %v; printed so far:\n%s", err, out.String())
		}
		out.WriteString(l + "\n")
	}
	t.Log("child 0 printed:\n" + out.String())
	for i, p := range procs {
		select {
		case <-p.Exited():
		case <-ctx.Done():
			t.Fatalf("child %d did not exit", i)
		}
		if err := p.Wait(); err != nil {
			t.Errorf("child %d: %v", i, err)
		}
	}
	return out.String()
}
