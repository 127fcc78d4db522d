package rpc

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// The tests re-execute the test binary as a peer process: TestMain sees
// childEnv and runs runChild instead of the tests.
const childEnv = "TENSORRPC_TEST_CHILD"

// runChild is the peer process. Mode "server" serves on loopback, publishes
// "big" (TENSORRPC_TEST_BYTES bytes of pattern 7), handles "reverse" and
// "block" (never returns), prints its address and serves until stdin
// closes. Mode "client" dials TENSORRPC_TEST_ADDR and sends "flood" tensors
// of TENSORRPC_TEST_BYTES bytes until it is killed.
func runChild(mode string) int {
	size, _ := strconv.Atoi(os.Getenv("TENSORRPC_TEST_BYTES"))
	opts := []Option{testPool()}
	if ts := os.Getenv("TENSORRPC_TEST_TRANSPORTS"); ts != "" { // else the defaults
		opts = append(opts, WithTransports(strings.Split(ts, ",")...))
	}
	switch mode {
	case "server":
		sopts := asServer(opts)
		if a := os.Getenv("TENSORRPC_TEST_DATA_ADDR"); a != "" {
			sopts = append(sopts, WithDataAddress(a))
		}
		s, err := NewServer(sopts...)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		ctx := context.Background()
		big, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fill(big.Bytes(), 7)
		s.Publish(context.Background(), "big", big)
		big.Release()
		s.Handle("reverse", echoReverse)
		s.Handle("block", func(ctx context.Context, _ *Message) (*Message, error) {
			fmt.Println("blocked")
			<-ctx.Done()
			return nil, ctx.Err()
		})
		addr := cmp.Or(os.Getenv("TENSORRPC_TEST_LISTEN"), "127.0.0.1:0")
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		go s.Serve(lis)
		fmt.Println(lis.Addr().String())
		io.Copy(io.Discard, os.Stdin)
		s.Stop()
		return 0
	case "client":
		ctx := context.Background()
		c, err := Dial(ctx, os.Getenv("TENSORRPC_TEST_ADDR"), asDial(opts)...)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		t, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("sending")
		for i := 0; ; i++ {
			if err := c.Send(ctx, fmt.Sprintf("flood%d", i), t); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
	}
	return 2
}

// fill writes a pattern quickly, also under the race detector: a small
// pattern block, then doubling copies.
func fill(b []byte, seed byte) {
	n := min(len(b), 1<<16)
	pattern(b[:n], seed)
	for n < len(b) {
		n += copy(b[n:], b[:n])
	}
}

// child is a running peer process.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  *bufio.Scanner
	waited chan error
}

func startChild(t *testing.T, mode, transport string, size int, env ...string) *child {
	t.Helper()
	skipWithoutDevice(t, transport)
	ts := transport
	if transport != TransportGRPC {
		ts += "," + TransportGRPC
	}
	return startChildCmd(t, nil, mode, ts, size, env...)
}

// startChildCmd starts a child peer; prefix (e.g. "ip netns exec NS") runs
// it inside something, and transports "" leaves the defaults.
func startChildCmd(t *testing.T, prefix []string, mode, transports string, size int, env ...string) *child {
	t.Helper()
	args := append(append([]string(nil), prefix...), os.Args[0], "-test.run=^$")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), childEnv+"="+mode, "TENSORRPC_TEST_TRANSPORTS="+transports, fmt.Sprintf("TENSORRPC_TEST_BYTES=%d", size))
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch := &child{cmd: cmd, stdin: stdin, lines: bufio.NewScanner(stdout), waited: make(chan error, 1)}
	t.Cleanup(func() { ch.kill() })
	return ch
}

// line waits for the child's next line of output.
func (ch *child) line(t *testing.T) string {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		if ch.lines.Scan() {
			got <- ch.lines.Text()
		} else {
			got <- ""
		}
	}()
	select {
	case l := <-got:
		if l == "" {
			t.Fatal("child process ended without output")
		}
		return l
	case <-time.After(30 * time.Second):
		t.Fatal("child process printed nothing for 30 s")
	}
	return ""
}

// kill kills the child and waits for it, once.
func (ch *child) kill() {
	if ch.cmd.ProcessState != nil {
		return
	}
	ch.cmd.Process.Kill()
	ch.stdin.Close()
	ch.cmd.Wait()
}
