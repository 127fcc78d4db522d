// Package leakcheck verifies that a test leaves no goroutines behind.
//
// Use it in every test that starts goroutines, directly or through the code
// under test:
//
//	func TestX(t *testing.T) {
//		defer leakcheck.Check(t)
//		...
//	}
//
// or for a whole package, from TestMain:
//
//	func TestMain(m *testing.M) { leakcheck.Main(m) }
package leakcheck

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"
)

// Timeout is how long Check waits for goroutines to finish before it reports
// them. Goroutines that are shutting down (closing sockets, draining
// channels) get this long to go away.
var Timeout = 10 * time.Second

// ignored lists goroutines that belong to the runtime, the testing package or
// long-lived library internals and are never ours to stop.
var ignored = []string{
	"testing.Main(",
	"testing.tRunner(",
	"testing.(*M).",
	"testing.(*T).Run(",
	"testing.(*F).Fuzz(",
	"testing.runFuzzing(",
	"testing.runFuzzTests(",
	"runtime.goexit",
	"created by runtime.gc",
	"created by runtime/trace",
	"runtime.MHeap_Scavenger",
	"signal.signal_recv",
	"os/signal.loop",
	"sigterm.handler",
	"runtime_mcall",
	"goroutine in C code",
	"leakcheck.interesting",
	// gRPC's process-wide helpers, started once and never stopped.
	"google.golang.org/grpc/internal/grpcsync.NewCallbackSerializer",
	"google.golang.org/grpc/internal/transport.(*controlBuffer)",
	"google.golang.org/grpc/internal/resolver/dns",
	"google.golang.org/grpc.(*addrConn).resetTransport",
}

func interesting(stack string) bool {
	if stack == "" {
		return false
	}
	// The goroutine running this check is the first in the dump.
	for _, s := range ignored {
		if strings.Contains(stack, s) {
			return false
		}
	}
	return true
}

// Goroutines returns the stacks of the goroutines that Check would report
// right now, sorted.
func Goroutines() []string {
	buf := make([]byte, 2<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 { // the calling goroutine
			continue
		}
		g = strings.TrimSpace(g)
		if interesting(g) {
			out = append(out, g)
		}
	}
	sort.Strings(out)
	return out
}

// Errorer is the part of testing.TB that Check needs.
type Errorer interface {
	Helper()
	Errorf(format string, args ...any)
}

// Check fails t when goroutines other than the test's own and the runtime's
// are still running after Timeout.
func Check(t Errorer) {
	t.Helper()
	if left := wait(Timeout); len(left) > 0 {
		for _, g := range left {
			t.Errorf("leaked goroutine:\n%s", g)
		}
	}
}

func wait(timeout time.Duration) []string {
	deadline := time.Now().Add(timeout)
	for {
		left := Goroutines()
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Main runs the tests of a package and then fails the run if goroutines are
// left over.
func Main(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if left := wait(Timeout); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "leakcheck: %d goroutine(s) left after the tests:\n\n%s\n", len(left), strings.Join(left, "\n\n"))
			code = 1
		}
	}
	os.Exit(code)
}
