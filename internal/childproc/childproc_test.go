package childproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// The test binary re-executes itself in these roles:
//   - "echo" prints "hello" and then every line it reads with "echo " in
//     front, and exits 3 on "fail";
//   - "env" prints its arguments, then TENSORRPC_CHILDPROC_TEST and
//     TENSORRPC_CHILDPROC_PREFIX, one a line, and waits for stdin to end;
//   - "deaf" ignores the end of stdin and sleeps until killed;
//   - "die" exits 3 at once, printing nothing;
//   - "ragged" prints "a\r\n", "\n" and "b" without a line end, and exits.
func TestMain(m *testing.M) {
	switch Role() {
	case "":
		os.Exit(m.Run())
	case "echo":
		fmt.Println("hello")
		for {
			line, err := ReadParent()
			if err == io.EOF {
				os.Exit(0)
			}
			if line == "fail" {
				os.Exit(3)
			}
			fmt.Println("echo " + line)
		}
	case "env":
		fmt.Println(strings.Join(os.Args[1:], " "))
		fmt.Println(os.Getenv("TENSORRPC_CHILDPROC_TEST"))
		fmt.Println(os.Getenv("TENSORRPC_CHILDPROC_PREFIX"))
		WaitForStop()
		os.Exit(0)
	case "deaf":
		fmt.Println("deaf")
		WaitForStop()
		time.Sleep(time.Hour)
	case "die":
		os.Exit(3)
	case "ragged":
		fmt.Print("a\r\n\nb")
		os.Exit(0)
	}
	fmt.Fprintln(os.Stderr, "unknown role", Role())
	os.Exit(2)
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func start(t *testing.T, role string, o Options) *Process {
	t.Helper()
	p, err := StartWith(role, o)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// readLines reads n lines from p and fails the test unless they are want.
func readLines(t *testing.T, p *Process, want ...string) {
	t.Helper()
	ctx := ctxT(t)
	for _, w := range want {
		if got, err := p.ReadLine(ctx); err != nil || got != w {
			t.Fatalf("ReadLine = %q, %v; want %q", got, err, w)
		}
	}
}

func TestLines(t *testing.T) {
	defer leakcheck.Check(t)
	p, err := Start("echo")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	want := []string{"hello"}
	for _, l := range []string{"a", "", "b c"} {
		if err := p.WriteLine(l); err != nil {
			t.Fatal(err)
		}
		want = append(want, "echo "+l)
	}
	readLines(t, p, want...)
	if err := p.Stop(10 * time.Second); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if _, err := p.ReadLine(ctxT(t)); !errors.Is(err, ErrExited) {
		t.Fatalf("ReadLine after exit: %v", err)
	}
	if p.Signaled() {
		t.Fatal("a child that exited by itself counts as signaled")
	}
}

// TestRaggedLines: "\r\n" ends a line as "\n" does, and the last line
// needs no line end; all of them can be read after the child exited.
func TestRaggedLines(t *testing.T) {
	defer leakcheck.Check(t)
	p := start(t, "ragged", Options{})
	defer p.Kill()
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	readLines(t, p, "a", "", "b")
	if _, err := p.ReadLine(ctxT(t)); !errors.Is(err, ErrExited) {
		t.Fatalf("ReadLine after the last line: %v", err)
	}
}

func TestExitStatus(t *testing.T) {
	defer leakcheck.Check(t)
	g := Group{}
	for range 2 {
		p, err := Start("echo")
		if err != nil {
			t.Fatal(err)
		}
		g = append(g, p)
	}
	defer g.Kill()
	if err := g[0].WriteLine("fail"); err != nil {
		t.Fatal(err)
	}
	<-g[0].Exited()
	var exit interface{ ExitCode() int }
	if err := g[0].Wait(); !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Fatalf("Wait = %v, want exit status 3", err)
	}
	if err := g.Stop(10 * time.Second); err == nil {
		t.Fatal("Group.Stop hid the failed child")
	}
	if err := g[1].Wait(); err != nil {
		t.Fatalf("second child: %v", err)
	}
}

// TestChildDies: a child that exits before printing anything ends
// ReadLine with ErrExited, and its exit status shows.
func TestChildDies(t *testing.T) {
	defer leakcheck.Check(t)
	p := start(t, "die", Options{})
	defer p.Kill()
	if _, err := p.ReadLine(ctxT(t)); !errors.Is(err, ErrExited) {
		t.Fatalf("ReadLine of a child that died: %v", err)
	}
	if code := p.ProcessState().ExitCode(); code != 3 {
		t.Fatalf("exit code %d, want 3", code)
	}
	if p.Signaled() {
		t.Fatal("a child that exited 3 counts as signaled")
	}
	if err := p.WriteLine("late"); err == nil {
		t.Fatal("WriteLine to a dead child succeeded")
	}
}

func TestReadLineContext(t *testing.T) {
	defer leakcheck.Check(t)
	p, err := Start("echo")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	ctx := ctxT(t)
	if _, err := p.ReadLine(ctx); err != nil { // "hello"
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := p.ReadLine(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ReadLine of a silent child: %v", err)
	}
}

// TestOptions: the arguments, the extra environment and the prefix reach
// the child, and CloseStdin ends it.
func TestOptions(t *testing.T) {
	defer leakcheck.Check(t)
	p := start(t, "env", Options{
		Args:   []string{"-test.run=^$", "x y"},
		Prefix: []string{"env", "TENSORRPC_CHILDPROC_PREFIX=via prefix"},
		Env:    []string{"TENSORRPC_CHILDPROC_TEST=extra", RoleEnv + "=not this one"},
	})
	defer p.Kill()
	readLines(t, p, "-test.run=^$ x y", "extra", "via prefix")
	p.CloseStdin()
	p.CloseStdin()
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("the child did not end 10 s after its stdin closed")
	}
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
}

// TestStopKills: Stop kills a child that outlives its timeout, and says
// so.
func TestStopKills(t *testing.T) {
	defer leakcheck.Check(t)
	p := start(t, "deaf", Options{})
	defer p.Kill()
	readLines(t, p, "deaf")
	err := p.Stop(100 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("Stop of a child that ignores it: %v", err)
	}
	if !p.Signaled() {
		t.Fatalf("the child ended by itself: %v", p.ProcessState())
	}
}

// TestKill: Kill ends the child by a signal at once, and again is
// harmless.
func TestKill(t *testing.T) {
	defer leakcheck.Check(t)
	p := start(t, "deaf", Options{})
	readLines(t, p, "deaf")
	began := time.Now()
	p.Kill()
	p.Kill()
	if d := time.Since(began); d > 5*time.Second {
		t.Fatalf("Kill took %v", d)
	}
	if !p.Signaled() {
		t.Fatalf("the child ended by itself: %v", p.ProcessState())
	}
	if p.Wait() == nil {
		t.Fatal("Wait of a killed child returned nil")
	}
}

func TestStartFails(t *testing.T) {
	defer leakcheck.Check(t)
	if p, err := StartWith("echo", Options{Prefix: []string{"/nonexistent/childproc-prefix"}}); err == nil {
		p.Kill()
		t.Fatal("started through a prefix that does not exist")
	}
}

func TestLineQueue(t *testing.T) {
	q := newLineQueue()
	for _, s := range []string{"ab", "c\nd", "e\r\n\n", "f\ng\nh"} {
		if n, err := q.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", s, n, err)
		}
	}
	q.close()
	var got []string
	for {
		l, err := q.next(context.Background())
		if err != nil {
			break
		}
		got = append(got, l)
	}
	if want := []string{"abc", "de", "", "f", "g", "h"}; !slices.Equal(got, want) {
		t.Fatalf("lines %q, want %q", got, want)
	}
}
