package rpc_test

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// The tests re-execute the test binary as a peer process (see package
// childproc): TestMain sees the role and runs runChild instead of the
// tests.

// runChild is the peer process. Mode "server" serves on loopback, publishes
// "big" (TENSORRPC_TEST_BYTES bytes of pattern 7), handles "reverse" and
// "block" (never returns), prints its address and serves until stdin
// closes. Mode "client" dials TENSORRPC_TEST_ADDR and sends "flood" tensors
// of TENSORRPC_TEST_BYTES bytes until it is killed.
func runChild(mode string) int {
	size, _ := strconv.Atoi(os.Getenv("TENSORRPC_TEST_BYTES"))
	opts := []rpc.Option{testPool()}
	if ts := os.Getenv("TENSORRPC_TEST_TRANSPORTS"); ts != "" { // else the defaults
		opts = append(opts, rpc.WithTransports(strings.Split(ts, ",")...))
	}
	switch mode {
	case "server":
		sopts := asServer(opts)
		if a := os.Getenv("TENSORRPC_TEST_DATA_ADDR"); a != "" {
			sopts = append(sopts, rpc.WithDataAddress(a))
		}
		s, err := rpc.NewServer(sopts...)
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
		s.Handle("block", func(ctx context.Context, _ *rpc.Message) (*rpc.Message, error) {
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
		return serveUntilStopped(s, lis)
	case "cuda-server":
		return runCUDAServer(size, opts)
	case "client":
		ctx := context.Background()
		c, err := rpc.Dial(ctx, os.Getenv("TENSORRPC_TEST_ADDR"), asDial(opts)...)
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

// serveUntilStopped is the end of a server child: it serves s on lis,
// prints the address for the parent, and serves until the parent closes
// stdin. It returns the child's exit status.
func serveUntilStopped(s *rpc.Server, lis net.Listener) int {
	go s.Serve(lis)
	fmt.Println(lis.Addr().String())
	childproc.WaitForStop()
	s.Stop()
	return 0
}

func startChild(t *testing.T, mode, transport string, size int, env ...string) *childproc.Process {
	t.Helper()
	skipWithoutDevice(t, transport)
	ts := transport
	if transport != rpc.TransportGRPC {
		ts += "," + rpc.TransportGRPC
	}
	return startChildCmd(t, nil, mode, ts, size, env...)
}

// startChildCmd starts a child peer, which the test kills when it ends;
// prefix (e.g. "ip netns exec NS") runs it inside something, and
// transports "" leaves the defaults.
func startChildCmd(t *testing.T, prefix []string, mode, transports string, size int, env ...string) *childproc.Process {
	t.Helper()
	env = append([]string{"TENSORRPC_TEST_TRANSPORTS=" + transports, fmt.Sprintf("TENSORRPC_TEST_BYTES=%d", size)}, env...)
	return childtest.Start(t, mode, childproc.Options{Prefix: prefix, Env: env})
}
