package childtest

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// The test binary re-executes itself as "hello", which prints its
// arguments and "hello" and waits for stdin to end, or as "mute", which
// exits at once.
func TestMain(m *testing.M) {
	switch childproc.Role() {
	case "hello":
		fmt.Println(strings.Join(os.Args[1:], " "))
		fmt.Println("hello")
		childproc.WaitForStop()
		os.Exit(0)
	case "mute":
		os.Exit(0)
	}
	leakcheck.Main(m)
}

func TestStartLine(t *testing.T) {
	var p *childproc.Process
	t.Run("child", func(t *testing.T) {
		p = Start(t, "hello", childproc.Options{Args: []string{"-x"}})
		if l := Line(t, p); l != "-test.run=^$ -x" {
			t.Fatalf("arguments %q", l)
		}
		if l := Line(t, p); l != "hello" {
			t.Fatalf("line %q", l)
		}
	})
	select { // the cleanup killed it
	case <-p.Exited():
	default:
		t.Fatal("the child outlived its test")
	}
	if !p.Signaled() {
		t.Fatalf("the child ended by itself: %v", p.ProcessState())
	}
}

// fatalTB records the failure of a helper, which must not return.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestLineOfDeadChild(t *testing.T) {
	p := Start(t, "mute", childproc.Options{})
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		l := Line(f, p)
		f.msg = fmt.Sprintf("Line returned %q", l)
	}()
	<-done
	if !strings.Contains(f.msg, "ended without output") {
		t.Fatalf("Line of a child that printed nothing: %s", f.msg)
	}
}
