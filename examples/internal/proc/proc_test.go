package proc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// The test binary re-executes itself as "echo", which prints "hello" and
// then every line it reads with "echo " in front, and exits 3 on "fail".
func TestMain(m *testing.M) {
	if Role() == "echo" {
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
	}
	os.Exit(m.Run())
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestLines(t *testing.T) {
	defer leakcheck.Check(t)
	p, err := Start("echo")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	ctx := ctxT(t)
	want := []string{"hello"}
	for _, l := range []string{"a", "", "b c"} {
		if err := p.WriteLine(l); err != nil {
			t.Fatal(err)
		}
		want = append(want, "echo "+l)
	}
	for _, w := range want {
		if got, err := p.ReadLine(ctx); err != nil || got != w {
			t.Fatalf("ReadLine = %q, %v; want %q", got, err, w)
		}
	}
	if err := p.Stop(10 * time.Second); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if _, err := p.ReadLine(ctx); !errors.Is(err, errExited) {
		t.Fatalf("ReadLine after exit: %v", err)
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
	if err := g[0].Err(); !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Fatalf("Err = %v, want exit status 3", err)
	}
	if err := g.Stop(10 * time.Second); err == nil {
		t.Fatal("Group.Stop hid the failed child")
	}
	if err := g[1].Err(); err != nil {
		t.Fatalf("second child: %v", err)
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
