// Command gopeer is the Go side of the shim's cross-language tests and
// benchmarks: a Go server for Python clients, a Go client for Python
// servers, and both ends of the Go-to-Go transfer the Python transfer is
// measured against.
//
//	gopeer serve [-transports shm,tcp,grpc]
//	gopeer serve-rows [-transports ...]
//	gopeer client -addr HOST:PORT [-transports ...]
//	gopeer bench-serve -size N [-transports ...]
//	gopeer bench-client -addr HOST:PORT -size N -iters K [-ops fetch,fetch_into,send_pool,send_wrapped] [-transports ...]
//	gopeer bench-client -socket HOST:PORT -size N -iters K -ops socket,socket2
//
// Servers print "ADDR host:port" on stdout and serve until stdin closes;
// bench-serve also prints "SOCKET host:port" where its transports include
// tcp, a raw TCP server of the same bytes (socket.go), whose ceiling
// bench-client's socket (one connection) and socket2 (two, half each, as a
// striped Fetch's two lanes) measure;
// when stdin's first line is "check", serve first checks the tensors the
// client sent back ("BACK ok N"). Then they print "POOL allocs=N" (the
// buffers still live after Close) and exit 1 if N is not 0 or a check
// failed. Tensors carry the pattern of Pattern, which the Python tests
// reproduce, so that every dtype is checked bit for bit; bench-serve's
// "bench" tensor (and its raw socket's bytes) are pseudo-random bytes
// instead, which no codec shrinks (benchBytes). serve-rows
// publishes the tensors of the rows tests instead (publishRows).
package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Shapes of the test tensors: one under the eager threshold, one over it
// for every dtype (100000 elements of at least one byte).
var (
	smallShape = []int64{3, 5}
	largeShape = []int64{4, 25000}
)

// Pattern fills b with the test pattern of dtype d: byte i is
// (131·i + 7 + d) mod 256, and its low bit only for bool.
func Pattern(b []byte, d zerocopy.DType) {
	for i := range b {
		v := byte(uint64(i)*131 + 7 + uint64(d))
		if d == zerocopy.Bool {
			v &= 1
		}
		b[i] = v
	}
}

func patterned(d zerocopy.DType, shape []int64) zerocopy.Tensor {
	n, _ := zerocopy.ByteSize(d, shape)
	b := make([]byte, n)
	Pattern(b, d)
	t, _ := zerocopy.New(d, shape, b)
	return t
}

func check(name string, t *rpc.Tensor, d zerocopy.DType, shape []int64) error {
	want := patterned(d, shape)
	if t.DType() != d || !slices.Equal(t.Shape(), shape) {
		return fmt.Errorf("%s: got %s%v, want %s%v", name, t.DType(), t.Shape(), d, shape)
	}
	if string(t.Bytes()) != string(want.Bytes()) {
		return fmt.Errorf("%s: bytes differ from the pattern", name)
	}
	return nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: gopeer serve|client|bench-serve|bench-client [flags]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	transports := fs.String("transports", "", "comma-separated data planes (default: all)")
	addr := fs.String("addr", "", "server address (client modes)")
	size := fs.Int("size", 64<<20, "tensor bytes (bench modes)")
	iters := fs.Int("iters", 10, "transfers per measurement (bench-client)")
	ops := fs.String("ops", "fetch,send_pool,send_wrapped", "measurements of bench-client, in order (also fetch_into; socket, socket2)")
	socketAddr := fs.String("socket", "", "bench-serve's raw socket address (bench-client's socket ops)")
	fs.Parse(os.Args[2:])
	var opts []rpc.Option
	if os.Getenv("TENSORRPC_LOG") == "debug" {
		opts = append(opts, rpc.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))))
	}
	if *transports != "" {
		opts = append(opts, rpc.WithTransports(strings.Split(*transports, ",")...))
	}
	var sopts []rpc.ServerOption
	// The shim has no TLS: the Go client dials in plaintext, as the C ABI's
	// does.
	dopts := []rpc.DialOption{rpc.WithTransportCredentials(insecure.NewCredentials())}
	for _, o := range opts {
		sopts = append(sopts, o)
		dopts = append(dopts, o)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(sopts, publishAll, nil)
	case "serve-rows":
		err = serve(sopts, publishRows, nil)
	case "bench-serve":
		var raw []byte // the raw socket's bytes: only where the tcp plane may run
		if *transports == "" || slices.Contains(strings.Split(*transports, ","), rpc.TransportTCP) {
			raw = make([]byte, *size)
			benchBytes(raw)
		}
		err = serve(sopts, func(s *rpc.Server) error { return publishBench(s, *size) }, raw)
	case "client":
		err = client(*addr, dopts)
	case "bench-client":
		err = benchClient(*addr, *socketAddr, dopts, *size, *iters, strings.Split(*ops, ","))
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gopeer:", err)
		os.Exit(1)
	}
}

// serve runs a server until stdin closes; with raw, also a raw socket
// server of those bytes (serveSocket).
func serve(opts []rpc.ServerOption, setup func(*rpc.Server) error, raw []byte) error {
	s, err := rpc.NewServer(opts...)
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	if err := setup(s); err != nil {
		return err
	}
	s.Handle("echo", echo(s))
	s.Handle("checksum", checksum)
	fmt.Printf("ADDR %s\n", lis.Addr())
	if raw != nil {
		ss, err := serveSocket("127.0.0.1", raw)
		if err != nil {
			return err
		}
		defer ss.Close()
		fmt.Printf("SOCKET %s\n", ss.lis.Addr())
	}
	var backErr error
	if line, _ := bufio.NewReader(os.Stdin).ReadString('\n'); strings.TrimSpace(line) == "check" {
		backErr = checkBack(s)
	}
	io.Copy(io.Discard, os.Stdin)
	s.Stop()
	<-served
	allocs := s.Pool().Stats().Allocs
	fmt.Printf("POOL allocs=%d\n", allocs)
	if allocs != 0 {
		return fmt.Errorf("%d pool buffers still live after Close", allocs)
	}
	return backErr
}

// sizes names the two test shapes.
var sizes = []struct {
	name  string
	shape []int64
}{{"small", smallShape}, {"large", largeShape}}

// publishAll publishes "srv/<dtype>/<size>" for every dtype and size.
func publishAll(s *rpc.Server) error {
	for _, d := range zerocopy.DTypes() {
		for _, sz := range sizes {
			if err := s.Publish(context.Background(), "srv/"+d.String()+"/"+sz.name, rpc.WrapTensor(patterned(d, sz.shape))); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkBack checks the tensors a client sent back ("back/<dtype>/<size>").
func checkBack(s *rpc.Server) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n := 0
	for _, d := range zerocopy.DTypes() {
		for _, sz := range sizes {
			key := "back/" + d.String() + "/" + sz.name
			// The client process sent these before it ended; a transfer of
			// its may still be landing, so wait for the key (up to ctx's 5
			// seconds) rather than fail with NotFound.
			t, err := s.Take(ctx, key, rpc.WaitForKey())
			if err != nil {
				return fmt.Errorf("take %s: %w", key, err)
			}
			err = check(key, t, d, sz.shape)
			t.Release()
			if err != nil {
				return err
			}
			n++
		}
	}
	fmt.Printf("BACK ok %d\n", n)
	return nil
}

// The tensors of the rows tests (shim/python/tests/test_rows.py):
// float32 [rowsN, rowsCols], element j of row r holding r*rowsCols + j,
// published as "kv" (Writable, in place in the pool) and "ro" (not
// writable).
const (
	rowsN    = 64
	rowsCols = 4096 // 16 KiB rows: a few of them pass the eager threshold
)

func publishRows(s *rpc.Server) error {
	ctx := context.Background()
	t, err := s.NewTensor(ctx, zerocopy.Float32, []int64{rowsN, rowsCols})
	if err != nil {
		return err
	}
	defer t.Release()
	for i := range rowsN * rowsCols {
		binary.LittleEndian.PutUint32(t.Bytes()[4*i:], math.Float32bits(float32(i)))
	}
	if err := s.Publish(ctx, "kv", t, rpc.Writable()); err != nil {
		return err
	}
	return s.Publish(ctx, "ro", rpc.WrapTensor(t.Tensor))
}

func publishBench(s *rpc.Server, size int) error {
	t, err := s.NewTensor(context.Background(), zerocopy.Uint8, []int64{int64(size)})
	if err != nil {
		return err
	}
	defer t.Release()
	benchBytes(t.Bytes())
	return s.Publish(context.Background(), "bench", t)
}

// benchBytes fills b with the bench tensor's bytes: pseudo-random, the
// same every run, which no codec shrinks. With a repeating pattern, the
// tcp plane's auto compression (rpc.CompressionAuto) compressed some of
// a 16 MiB Fetch's reads and not others, varying from run to run, so
// that the tcp rows measured the codec on a toy payload as much as the
// plane; random bytes make it sample, decline and send them as they are,
// as it would a tensor of float noise, and make the rows compare planes
// (PyTorch's and the raw socket's bytes are not compressed either).
func benchBytes(b []byte) {
	r := rand.NewChaCha8([32]byte{'t', 'e', 'n', 's', 'o', 'r', 'r', 'p', 'c'})
	r.Read(b)
}

// echo replies with its request, the tensors copied into the pool.
func echo(s *rpc.Server) rpc.Handler {
	return func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		out := &rpc.Message{Metadata: append([]byte("echo:"), req.Metadata...)}
		for _, t := range req.Tensors {
			c, err := s.NewTensor(ctx, t.DType(), t.Shape())
			if err != nil {
				out.Release()
				return nil, err
			}
			copy(c.Bytes(), t.Bytes())
			out.Tensors = append(out.Tensors, c)
		}
		return out, nil
	}
}

// checksum replies with "dtype shape crc32" of each request tensor, one per
// line.
func checksum(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
	var lines []string
	for _, t := range req.Tensors {
		lines = append(lines, fmt.Sprintf("%s %v %08x", t.DType(), t.Shape(), crc32.ChecksumIEEE(t.Bytes())))
	}
	return &rpc.Message{Metadata: []byte(strings.Join(lines, "\n"))}, nil
}

// client checks a server (shim/python/tests/peer.py or gopeer serve): it
// fetches the tensors the server published as "srv/<dtype>/<size>", sends
// them back as "back/<dtype>/<size>" and calls the server's "echo" method.
func client(addr string, opts []rpc.DialOption) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := rpc.Dial(ctx, addr, opts...)
	if err != nil {
		return err
	}
	if err := clientChecks(ctx, c); err != nil {
		c.Close()
		return err
	}
	if err := c.Close(); err != nil {
		return err
	}
	if n := c.Pool().Stats().Allocs; n != 0 {
		return fmt.Errorf("%d pool buffers live after Close", n)
	}
	fmt.Printf("OK transport=%s\n", c.Transport())
	return nil
}

func clientChecks(ctx context.Context, c *rpc.Client) error {
	for _, d := range zerocopy.DTypes() {
		for _, sz := range sizes {
			key := d.String() + "/" + sz.name
			t, err := c.Fetch(ctx, "srv/"+key)
			if err != nil {
				return fmt.Errorf("fetch srv/%s: %w", key, err)
			}
			err = check("srv/"+key, t, d, sz.shape)
			if err == nil {
				err = c.Send(ctx, "back/"+key, t) // from the pool: no copy
			}
			t.Release()
			if err != nil {
				return err
			}
		}
		req := &rpc.Message{Metadata: []byte(d.String())}
		for _, shape := range [][]int64{smallShape, largeShape} {
			req.Tensors = append(req.Tensors, rpc.WrapTensor(patterned(d, shape)))
		}
		reply, err := c.Call(ctx, "echo", req)
		if err != nil {
			return fmt.Errorf("call echo (%s): %w", d, err)
		}
		err = func() error {
			defer reply.Release()
			if string(reply.Metadata) != "echo:"+d.String() || len(reply.Tensors) != 2 {
				return fmt.Errorf("echo (%s): metadata %q, %d tensors", d, reply.Metadata, len(reply.Tensors))
			}
			if err := check("echo small", reply.Tensors[0], d, smallShape); err != nil {
				return err
			}
			return check("echo large", reply.Tensors[1], d, largeShape)
		}()
		if err != nil {
			return err
		}
	}
	return nil
}

// benchResult is one measurement: the times of iters transfers, and their
// median.
type benchResult struct {
	Op        string    `json:"op"`
	Transport string    `json:"transport"`
	Bytes     int       `json:"bytes"`
	Times     []float64 `json:"times_s"`
	MedianSec float64   `json:"median_s"`
	MedianGBs float64   `json:"median_GBps"`
	// Switches is the process's voluntary context switches (all threads)
	// per timed transfer: how often a thread slept and was woken.
	Switches float64 `json:"voluntary_switches_per_op"`
}

// voluntarySwitches is the process's count of voluntary context switches.
func voluntarySwitches() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Nvcsw
}

func measure(op, transport string, size, iters int, f func() error) (benchResult, error) {
	if err := f(); err != nil { // warm-up: pool growth, page faults
		return benchResult{}, err
	}
	ds := make([]float64, 0, iters)
	switches := voluntarySwitches()
	for range iters {
		start := time.Now()
		if err := f(); err != nil {
			return benchResult{}, err
		}
		ds = append(ds, time.Since(start).Seconds())
	}
	switches = voluntarySwitches() - switches
	sorted := slices.Sorted(slices.Values(ds))
	med := sorted[len(sorted)/2]
	return benchResult{Op: op, Transport: transport, Bytes: size, Times: ds, MedianSec: med, MedianGBs: float64(size) / med / 1e9,
		Switches: float64(switches) / float64(max(iters, 1))}, nil
}

// benchClient measures, against bench-serve: Fetch (+Release) of the
// published tensor, Send of a pool tensor (NewTensor) and Send of a tensor
// over Go memory (WrapTensor, one copy into the pool first): those of ops,
// in that order. The socket ops measure the raw socket at socketAddr
// instead, and need no session.
func benchClient(addr, socketAddr string, opts []rpc.DialOption, size, iters int, ops []string) error {
	if !slices.ContainsFunc(ops, func(op string) bool { return !strings.HasPrefix(op, "socket") }) {
		return benchSocket(socketAddr, size, iters, ops)
	}
	ctx := context.Background()
	c, err := rpc.Dial(ctx, addr, opts...)
	if err != nil {
		return err
	}
	defer c.Close()
	tr := c.Transport()
	fetch := func() error {
		t, err := c.Fetch(ctx, "bench")
		if err != nil {
			return err
		}
		t.Release()
		return nil
	}
	pooled, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
	if err != nil {
		return err
	}
	defer pooled.Release()
	Pattern(pooled.Bytes(), zerocopy.Uint8)
	wrapped := rpc.WrapTensor(patterned(zerocopy.Uint8, []int64{int64(size)}))
	// fetch_into lands the tensor in memory of the caller's own (Go heap,
	// as a framework's tensor would be), of the published dtype and
	// shape, learnt by its first call (measure's warm-up).
	var mine *rpc.Tensor
	fetchInto := func() error {
		if mine == nil {
			first, err := c.Fetch(ctx, "bench")
			if err != nil {
				return err
			}
			mine = rpc.WrapTensor(patterned(first.DType(), first.Shape()))
			first.Release()
		}
		_, err := c.Fetch(ctx, "bench", rpc.Into(mine))
		return err
	}
	measurements := map[string]func() error{
		"fetch":        fetch,
		"fetch_into":   fetchInto,
		"send_pool":    func() error { return c.Send(ctx, "sent", pooled) },
		"send_wrapped": func() error { return c.Send(ctx, "sent", wrapped) },
	}
	var out []benchResult
	for _, op := range ops {
		f, ok := measurements[op]
		if !ok {
			return fmt.Errorf("unknown bench-client op %q", op)
		}
		r, err := measure(op, tr, size, iters, f)
		if err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
		out = append(out, r)
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// benchSocket measures ops, each "socket" (one connection) or "socket2"
// (two), against bench-serve's raw socket server at addr.
func benchSocket(addr string, size, iters int, ops []string) error {
	var out []benchResult
	for _, op := range ops {
		conns := map[string]int{"socket": 1, "socket2": 2}[op]
		if conns == 0 || addr == "" {
			return fmt.Errorf("bench-client op %q: the socket ops need -socket and no other ops", op)
		}
		c, err := dialSocket(addr, conns, size)
		if err != nil {
			return err
		}
		r, err := measure(op, "tcp", size, iters, c.fetch)
		c.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
		out = append(out, r)
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}
