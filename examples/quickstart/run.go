package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/examples/internal/units"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// config is what run does.
type config struct {
	addr   string // the server; "" starts one as a child process
	sizes  []int
	planes []string
	iters  int // timed operations per cell; 0 picks by size
}

// result is one row of the table: one operation on tensors of one size
// over one data plane.
type result struct {
	Plane  string
	Size   int
	Op     string // "send", "fetch" or "lease"
	Iters  int
	PerOp  time.Duration
	GBps   float64
	Copies float64 // CPU copies of tensor bytes on the client, per operation
	Leases int64   // zero-copy leases among the timed operations
}

// skipped is a data plane that did not connect, and why.
type skipped struct{ Plane, Reason string }

// report is everything run measured.
type report struct {
	Negotiated string
	Results    []result
	Skipped    []skipped
}

// run starts a server unless cfg.addr names one, shows which data plane a
// default session negotiates, then measures every size and operation over
// each data plane in cfg.planes and prints the table to out.
func run(ctx context.Context, cfg config, out io.Writer) (*report, error) {
	addr := cfg.addr
	if addr == "" {
		server, err := childproc.Start(serverRole)
		if err != nil {
			return nil, err
		}
		defer server.Kill() // on early returns; Stop below is the normal end
		sctx, cancel := context.WithTimeout(ctx, connectTimeout)
		addr, err = server.ReadLine(sctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("waiting for the server's address: %w", err)
		}
		fmt.Fprintf(out, "server: pid %d, listening on %s\n", server.PID(), addr)
		defer func() {
			if err := server.Stop(10 * time.Second); err != nil {
				fmt.Fprintln(out, "server:", err)
			}
		}()
	}

	rep := &report{}
	reasons, err := negotiate(ctx, addr, rep, out)
	if err != nil {
		return nil, err
	}
	for _, plane := range cfg.planes {
		rows, err := measurePlane(ctx, addr, plane, cfg)
		if err != nil {
			if reason := reasons[plane]; reason != "" {
				err = fmt.Errorf("%s", reason)
			}
			rep.Skipped = append(rep.Skipped, skipped{plane, err.Error()})
			continue
		}
		rep.Results = append(rep.Results, rows...)
	}
	printTable(out, rep)
	if len(rep.Results) == 0 {
		return rep, fmt.Errorf("no data plane connected")
	}
	return rep, nil
}

// plaintext is the quickstart's gRPC credentials: none. A deployment
// across untrusted networks dials with TLS credentials instead
// (credentials.NewTLS), and serves with rpc.WithCreds.
var plaintext = rpc.WithTransportCredentials(insecure.NewCredentials())

// negotiate opens a session with every data plane allowed, as an
// application would, and prints the plane it got and why the better ones
// were not used. It returns those reasons by plane.
func negotiate(ctx context.Context, addr string, rep *report, out io.Writer) (map[string]string, error) {
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	c, err := rpc.Dial(dctx, addr, plaintext)
	if err != nil {
		return nil, err
	}
	rep.Negotiated = c.Transport()
	reasons := map[string]string{}
	fmt.Fprintf(out, "negotiated data plane: %s\n", c.Transport())
	for _, r := range c.Rejections() {
		reasons[r.Transport] = r.String()
		fmt.Fprintf(out, "  not used: %s (%s): %s\n", r.Transport, r.Side, r.Reason)
		if r.Fix != "" {
			fmt.Fprintf(out, "    fix: %s\n", r.Fix)
		}
	}
	return reasons, c.Close()
}

// measurePlane opens a session restricted to plane and measures each size.
func measurePlane(ctx context.Context, addr, plane string, cfg config) ([]result, error) {
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	c, err := rpc.Dial(dctx, addr, plaintext, rpc.WithTransports(plane))
	cancel()
	if err != nil {
		return nil, err
	}
	var rows []result
	for _, size := range cfg.sizes {
		r, err := measureSize(ctx, c, plane, size, cfg.iters)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("%s, %s: %w", plane, bytesize.Format(int64(size)), err)
		}
		rows = append(rows, r...)
	}
	// Close fails if a received tensor was not released.
	return rows, c.Close()
}

// measureSize sends a tensor of size bytes to the server's rendezvous,
// fetches it back (and leases it, on shm), checking the bytes every time,
// and finally has the server verify what it received.
func measureSize(ctx context.Context, c *rpc.Client, plane string, size, iters int) ([]result, error) {
	if iters <= 0 {
		iters = defaultIters(size)
	}
	// A tensor in the client's pool: sending it costs no copy.
	t, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
	if err != nil {
		return nil, err
	}
	defer t.Release()
	fill(t.Bytes(), byte(size))
	key := fmt.Sprintf("quickstart/%s/%d", plane, size)

	ops := []operation{
		{"send", func() (*rpc.Tensor, error) { return nil, c.Send(ctx, key, t) }},
		{"fetch", func() (*rpc.Tensor, error) { return c.Fetch(ctx, key) }},
	}
	if plane == rpc.TransportSHM {
		// A zero-copy lease of the server's memory; other planes would copy.
		ops = append(ops, operation{"lease", func() (*rpc.Tensor, error) { return c.Fetch(ctx, key, rpc.Lease()) }})
	}
	check := func(got *rpc.Tensor) error {
		if got.DType() != t.DType() || !slices.Equal(got.Shape(), t.Shape()) || !bytes.Equal(got.Bytes(), t.Bytes()) {
			return fmt.Errorf("the fetched tensor differs from the one sent")
		}
		return nil
	}
	var rows []result
	for _, op := range ops {
		r, err := timeOp(c, op, iters, check)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", op.name, err)
		}
		r.Plane, r.Size, r.Op = plane, size, op.name
		rows = append(rows, r)
	}
	meta, _ := json.Marshal(checkRequest{Key: key, CRC32C: zerocopy.Checksum(t.Bytes())})
	reply, err := c.Call(ctx, "check", &rpc.Message{Metadata: meta})
	if err != nil {
		return nil, fmt.Errorf("server check: %w", err)
	}
	reply.Release()
	return rows, nil
}

// defaultIters is the number of timed operations per row without -iters:
// about 256 MiB worth, at least 5 and at most 200.
func defaultIters(size int) int { return min(max((256<<20)/size, 5), 200) }

// operation is one timed operation; do returns the tensor it received, if
// any, for checking.
type operation struct {
	name string
	do   func() (*rpc.Tensor, error)
}

// warmups is the number of untimed operations before the timed ones: the
// first operations of a size grow the pools and map new regions, and a
// Send's destination alternates between two server buffers (the next one
// is allocated while the previous is still published).
const warmups = 4

// timeOp runs op warmups+iters times and reports the time and the
// client's copies per timed operation. Checking and releasing a received
// tensor are not timed.
func timeOp(c *rpc.Client, op operation, iters int, check func(*rpc.Tensor) error) (result, error) {
	var before rpc.Stats
	var total time.Duration
	for i := range warmups + iters {
		if i == warmups {
			before = c.Stats()
		}
		start := time.Now()
		got, err := op.do()
		elapsed := time.Since(start)
		if err != nil {
			return result{}, err
		}
		if got != nil {
			err = check(got)
			got.Release()
			if err != nil {
				return result{}, err
			}
		}
		if i >= warmups {
			total += elapsed
		}
	}
	after := c.Stats()
	return result{
		Iters:  iters,
		PerOp:  total / time.Duration(iters),
		Copies: float64(after.Copies-before.Copies) / float64(iters),
		Leases: after.Leases - before.Leases,
	}, nil
}

// fill writes a pattern that depends on seed and position.
func fill(b []byte, seed byte) {
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
}

// printHeader says what the table's columns measure.
func printHeader(out io.Writer) {
	fmt.Fprintf(out, "%s", `
What the table measures, per data plane and tensor size:
  send     Send of a tensor from the client's pool into the server's rendezvous
           under a key: from the call to its return, when the server holds the bytes.
  fetch    Fetch of that key back into the client's pool: from the request to the
           bytes in hand.
  lease    (shm only) Fetch with rpc.Lease(): the client maps the server's memory
           instead of copying it.
  iters    timed operations per row (-iters; by default about 256 MiB worth, 5 to 200),
           after `+fmt.Sprint(warmups)+` untimed warm-ups.
  time/op  the mean of the timed operations; checking and releasing each received
           tensor are not timed.
  GB/s     tensor bytes per time/op, with GB = 1e9 bytes (sizes are binary: 1 MiB = 1048576 bytes).
  copies   CPU copies of the tensor bytes on the client per operation (rpc.Stats.Copies).
`)
	fmt.Fprintln(out)
}

func printTable(out io.Writer, rep *report) {
	printHeader(out)
	fmt.Fprintf(out, "%-10s  %7s  %-5s  %5s  %9s  %6s  %6s\n", "data plane", "size", "op", "iters", "time/op", "GB/s", "copies")
	for _, r := range rep.Results {
		gbps := float64(r.Size) / r.PerOp.Seconds() / 1e9
		fmt.Fprintf(out, "%-10s  %7s  %-5s  %5d  %9s  %6.2f  %6s\n", r.Plane, bytesize.Format(int64(r.Size)), r.Op, r.Iters, units.Duration(r.PerOp), gbps, formatCopies(r.Copies))
	}
	for _, r := range rep.Results {
		if r.Op == "lease" && r.Leases < int64(r.Iters) && r.Size <= rpc.DefaultEagerThreshold {
			fmt.Fprintf(out, "%s %s lease: at or below the eager threshold (%s), the tensor travels inline in the control message, so there is nothing to lease\n",
				r.Plane, bytesize.Format(int64(r.Size)), bytesize.Format(int64(rpc.DefaultEagerThreshold)))
			continue
		}
		if r.Op == "lease" && r.Leases < int64(r.Iters) {
			fmt.Fprintf(out, "%s %s lease: %d of %d fetches with rpc.Lease() were leases; the others were copied into the client's pool\n",
				r.Plane, bytesize.Format(int64(r.Size)), r.Leases, r.Iters)
		}
	}
	for _, s := range rep.Skipped {
		fmt.Fprintf(out, "%s: not measured: %s\n", s.Plane, s.Reason)
	}
}

func formatCopies(c float64) string {
	if c == float64(int64(c)) {
		return fmt.Sprintf("%d", int64(c))
	}
	return fmt.Sprintf("%.2f", c)
}

// parseSizes parses a comma-separated list such as "4KiB,1MiB,64MiB"
// (binary units; see internal/bytesize); every size must be positive.
func parseSizes(s string) ([]int, error) { return bytesize.ParsePositiveInts(s) }
