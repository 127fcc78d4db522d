package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/examples/internal/units"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// plaintext is the example's gRPC credentials: none. Across untrusted
// networks, dial with TLS (credentials.NewTLS) and serve with rpc.WithCreds.
var plaintext = rpc.WithTransportCredentials(insecure.NewCredentials())

// An operation is what the decode times, once per request.
type operation int

const (
	// fetchRows is the request's blocks in one Fetch: Rows(ids...) and
	// Into(the decode cache).
	fetchRows operation = iota
	// fetchEach is the first baseline: one Fetch per block, of
	// RequestBlocks one-block tensors, each Into a one-block pool tensor.
	fetchEach
	// fetchContiguous is the second baseline: one Fetch of RequestBlocks
	// blocks that lie back to back on the prefill, Into the decode cache.
	fetchContiguous
	// writeRows is the write-back: SendRows of the decode cache over the
	// request's blocks.
	writeRows
	numOperations
)

func (o operation) String() string {
	return [...]string{"fetch rows", "fetch per block", "fetch contiguous", "write rows"}[o]
}

// calls is how many calls one request of o makes.
func (o operation) calls(cfg *config) int {
	if o == fetchEach {
		return cfg.RequestBlocks
	}
	return 1
}

// timing is what one operation measured over a plane's timed requests.
type timing struct {
	Requests int
	Total    time.Duration // over the timed requests
	Copies   int64         // CPU copies of tensor bytes on the decode's side (rpc.Stats), over them
}

func (t timing) perRequest() time.Duration { return t.Total / time.Duration(max(t.Requests, 1)) }

func (t timing) blocksPerSecond(cfg *config) float64 {
	return float64(t.Requests*cfg.RequestBlocks) / t.Total.Seconds()
}

// gbps is tensor bytes per second, in GB/s (1e9 bytes).
func (t timing) gbps(cfg *config) float64 {
	return t.blocksPerSecond(cfg) * float64(cfg.BlockBytes) / 1e9
}

// planeResult is one data plane's measurements.
type planeResult struct {
	Plane string
	Ops   [numOperations]timing
}

// Ratios of the Rows fetch's rate to the baselines'.
func (r *planeResult) overEach() float64 {
	return r.Ops[fetchEach].perRequest().Seconds() / r.Ops[fetchRows].perRequest().Seconds()
}

func (r *planeResult) overContiguous() float64 {
	return r.Ops[fetchContiguous].perRequest().Seconds() / r.Ops[fetchRows].perRequest().Seconds()
}

// skipped is a data plane that did not connect, and why.
type skipped struct{ Plane, Reason string }

// report is what a decode measured and checked.
type report struct {
	Planes  []planeResult
	Skipped []skipped
	// BlocksChecked counts fetched blocks compared with their pattern:
	// every block of every request, timed or not, of every operation.
	BlocksChecked int64
	// BlocksWritten counts blocks written back with SendRows, and
	// ReadBack those of them fetched again and found at the version the
	// decode wrote.
	BlocksWritten, ReadBack int64
	// PrefillChecked is the number of cache blocks the prefill compared,
	// in its own tensor, with the versions the decode wrote (all of
	// them), and PrefillWritten how many of those were written.
	PrefillChecked, PrefillWritten int
}

// decoder is the decode side: it draws the requests and remembers the
// version of every cache block it wrote, across data planes.
type decoder struct {
	cfg      *config
	addr     string
	reqs     *requests
	versions []uint32 // of each cache block, as this decode last wrote it (0: the prefill's)
	rep      *report
}

// runDecode measures every data plane of cfg.Transports against the
// prefill at addr, has the prefill check its cache, prints the report to
// out and stops the prefill.
func runDecode(ctx context.Context, cfg *config, addr string, out io.Writer) (_ *report, err error) {
	control, err := dialControl(ctx, cfg, addr)
	if err != nil {
		return nil, err
	}
	defer func() {
		reply, serr := control.Call(context.WithoutCancel(ctx), stopMethod, &rpc.Message{})
		reply.Release()
		if serr != nil {
			err = errors.Join(err, fmt.Errorf("stopping the prefill: %w", serr))
		}
		err = errors.Join(err, control.Close())
	}()
	d := &decoder{cfg: cfg, addr: addr, reqs: newRequests(cfg.Seed, cfg.Blocks, cfg.RequestBlocks),
		versions: make([]uint32, cfg.Blocks), rep: &report{}}
	header(out, cfg, addr)
	for _, plane := range cfg.Transports {
		r, err := d.measure(ctx, plane)
		var unavailable *errUnavailable
		switch {
		case errors.As(err, &unavailable):
			d.rep.Skipped = append(d.rep.Skipped, skipped{plane, unavailable.reason})
			fmt.Fprintf(out, "%s: not measured: %s\n", plane, unavailable.reason)
			continue
		case err != nil:
			return d.rep, fmt.Errorf("%s: %w", plane, err)
		}
		d.rep.Planes = append(d.rep.Planes, r)
		printPlane(out, cfg, &r)
	}
	if err := d.prefillCheck(ctx, control); err != nil {
		return d.rep, err
	}
	printVerified(out, cfg, d.rep)
	if len(d.rep.Planes) == 0 {
		return d.rep, errors.New("no data plane connected")
	}
	return d.rep, nil
}

// dialControl waits until the prefill at addr accepts connections (it may
// start after the decode), opens the decode's control session (any data
// plane), checks that the prefill serves the same job and says hello.
func dialControl(ctx context.Context, cfg *config, addr string) (*rpc.Client, error) {
	for {
		d := net.Dialer{Timeout: 5 * time.Second}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			conn.Close()
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("prefill at %s: %w (last: %v)", addr, ctx.Err(), err)
		case <-time.After(200 * time.Millisecond): // not listening yet
		}
	}
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	c, err := rpc.Dial(dctx, addr, plaintext, rpc.WithName(decodeName))
	cancel()
	if err != nil {
		return nil, fmt.Errorf("prefill at %s: %w", addr, err)
	}
	t, err := c.Fetch(ctx, configKey, rpc.WaitForKey())
	if err != nil {
		return nil, errors.Join(fmt.Errorf("prefill at %s: %w", addr, err), c.Close())
	}
	theirs := string(t.Bytes())
	t.Release()
	if ours := string(jobOf(cfg)); theirs != ours {
		return nil, errors.Join(fmt.Errorf("the prefill at %s serves the job %s, this decode wants %s: give both the same -blocks, -block-bytes and -request-blocks", addr, theirs, ours), c.Close())
	}
	reply, err := c.Call(ctx, helloMethod, &rpc.Message{})
	reply.Release()
	if err != nil {
		return nil, errors.Join(fmt.Errorf("prefill at %s: hello: %w", addr, err), c.Close())
	}
	return c, nil
}

// errUnavailable is a data plane the session could not use.
type errUnavailable struct{ reason string }

func (e *errUnavailable) Error() string { return e.reason }

// planeState is what the decode holds on one data plane.
type planeState struct {
	c *rpc.Client
	// cache is the decode cache, [RequestBlocks, BlockBytes] from the
	// client's pool: a request's blocks land in it back to back, block
	// ids[j] at row j, whichever way they are fetched.
	cache *rpc.Tensor
	// blocks are the per-block baseline's destinations, one pool tensor
	// of [1, BlockBytes] per block.
	blocks []*rpc.Tensor
}

func (s *planeState) release() {
	s.cache.Release()
	for _, b := range s.blocks {
		b.Release()
	}
}

// row is row j of the decode cache.
func (s *planeState) row(cfg *config, j int) []byte {
	return s.cache.Bytes()[j*cfg.BlockBytes : (j+1)*cfg.BlockBytes]
}

// measure opens a session restricted to plane and times each operation
// over cfg.Requests requests, after one untimed warm-up request, checking
// every block fetched.
func (d *decoder) measure(ctx context.Context, plane string) (planeResult, error) {
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	c, err := rpc.Dial(dctx, d.addr, plaintext, rpc.WithTransports(plane), rpc.WithName(decodeName+"/"+plane))
	cancel()
	if err != nil {
		return planeResult{}, &errUnavailable{err.Error()}
	}
	if got := c.Transport(); got != plane {
		reason := fmt.Sprintf("the session negotiated %s", got)
		var why []string
		for _, r := range c.Rejections() {
			why = append(why, r.String())
		}
		if len(why) > 0 {
			reason += ": " + strings.Join(why, "; ")
		}
		c.Close()
		return planeResult{}, &errUnavailable{reason}
	}
	s := &planeState{c: c}
	res, err := d.measureOn(ctx, s)
	s.release()
	// Close fails if a received tensor was not released.
	return res, errors.Join(err, c.Close())
}

func (d *decoder) measureOn(ctx context.Context, s *planeState) (planeResult, error) {
	cfg := d.cfg
	res := planeResult{Plane: s.c.Transport()}
	var err error
	blockShape := []int64{1, int64(cfg.BlockBytes)}
	if s.cache, err = s.c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(cfg.RequestBlocks), int64(cfg.BlockBytes)}); err != nil {
		return res, err
	}
	s.blocks = make([]*rpc.Tensor, cfg.RequestBlocks)
	for j := range s.blocks {
		if s.blocks[j], err = s.c.NewTensor(ctx, zerocopy.Uint8, blockShape); err != nil {
			return res, err
		}
	}
	var last []int64 // the blocks written last
	for i := range 1 + cfg.Requests {
		timed := i > 0
		ids := d.reqs.next()
		// The baselines go first in even requests and last in odd ones,
		// so that neither side always follows the other's garbage.
		order := []operation{fetchEach, fetchContiguous, fetchRows}
		if i%2 == 1 {
			slices.Reverse(order)
		}
		for _, op := range order {
			if err := d.request(ctx, s, &res, op, ids, timed); err != nil {
				return res, fmt.Errorf("%s, request %d: %w", op, i, err)
			}
			if op == fetchRows {
				if err := d.request(ctx, s, &res, writeRows, ids, timed); err != nil {
					return res, fmt.Errorf("%s, request %d: %w", writeRows, i, err)
				}
				last = ids
			}
		}
	}
	// Read the last writes back, so that every plane's SendRows is seen
	// landing whatever the later requests draw.
	if _, err := s.c.Fetch(ctx, cacheKey, rpc.Rows(last...), rpc.Into(s.cache)); err != nil {
		return res, fmt.Errorf("reading the last write back: %w", err)
	}
	return res, d.checkRows(s, last)
}

// request runs op for one request's blocks ids and checks what arrived;
// only the call (or calls) is timed.
func (d *decoder) request(ctx context.Context, s *planeState, res *planeResult, op operation, ids []int64, timed bool) error {
	cfg := d.cfg
	if op == writeRows {
		// The decode "appends" to each block: a new version of its pattern.
		for j, id := range ids {
			d.versions[id]++
			fillBlock(s.row(cfg, j), id, d.versions[id])
		}
	}
	before := s.c.Stats()
	start := time.Now()
	var err error
	switch op {
	case fetchRows:
		_, err = s.c.Fetch(ctx, cacheKey, rpc.Rows(ids...), rpc.Into(s.cache))
	case fetchEach:
		for j := range ids {
			if _, err = s.c.Fetch(ctx, blockKey(j), rpc.Into(s.blocks[j])); err != nil {
				break
			}
		}
	case fetchContiguous:
		_, err = s.c.Fetch(ctx, contiguousKey, rpc.Into(s.cache))
	case writeRows:
		err = s.c.SendRows(ctx, cacheKey, ids, s.cache)
	}
	elapsed := time.Since(start)
	if err != nil {
		return err
	}
	if timed {
		t := &res.Ops[op]
		t.Requests++
		t.Total += elapsed
		t.Copies += s.c.Stats().Copies - before.Copies
	}
	switch op {
	case fetchRows:
		return d.checkRows(s, ids)
	case fetchEach:
		for j, b := range s.blocks {
			if err := checkBlock(b.Bytes(), blockSourceID(cfg, j), 0); err != nil {
				return fmt.Errorf("%s: %w", blockKey(j), err)
			}
		}
		d.rep.BlocksChecked += int64(len(s.blocks))
	case fetchContiguous:
		for j := range cfg.RequestBlocks {
			if err := checkBlock(s.row(cfg, j), contiguousSourceID(cfg, j), 0); err != nil {
				return fmt.Errorf("%s row %d: %w", contiguousKey, j, err)
			}
		}
		d.rep.BlocksChecked += int64(cfg.RequestBlocks)
	case writeRows:
		d.rep.BlocksWritten += int64(len(ids))
	}
	return nil
}

// checkRows checks that the decode cache holds blocks ids, in order, at
// the versions the decode last wrote.
func (d *decoder) checkRows(s *planeState, ids []int64) error {
	for j, id := range ids {
		if err := checkBlock(s.row(d.cfg, j), id, d.versions[id]); err != nil {
			return fmt.Errorf("row %d of the fetch: %w", j, err)
		}
		if d.versions[id] > 0 {
			d.rep.ReadBack++
		}
	}
	d.rep.BlocksChecked += int64(len(ids))
	return nil
}

// prefillCheck has the prefill compare its own cache tensor, which the
// decode's SendRows wrote into, with the versions the decode wrote.
func (d *decoder) prefillCheck(ctx context.Context, control *rpc.Client) error {
	v, _ := zerocopy.FromSlice(d.versions)
	reply, err := control.Call(ctx, checkMethod, &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(v)}})
	if err != nil {
		return fmt.Errorf("the prefill's check of its cache: %w", err)
	}
	defer reply.Release()
	if _, err := fmt.Sscan(string(reply.Metadata), &d.rep.PrefillChecked, &d.rep.PrefillWritten); err != nil {
		return fmt.Errorf("the prefill's check answered %q: %v", reply.Metadata, err)
	}
	return nil
}

// header says what the run measures.
func header(out io.Writer, cfg *config, addr string) {
	req := int64(cfg.RequestBlocks) * int64(cfg.BlockBytes)
	fmt.Fprintf(out, "kvcache decode: prefill at %s, cache [%d, %d] uint8 (%s); requests of %d distinct random blocks (%s), seed %d; %d timed requests per operation and data plane, after 1 untimed\n",
		addr, cfg.Blocks, cfg.BlockBytes, bytesize.Format(int64(cfg.Blocks)*int64(cfg.BlockBytes)), cfg.RequestBlocks, bytesize.Format(req), cfg.Seed, cfg.Requests)
	fmt.Fprintf(out, "%s", `
Per request, on each data plane:
  fetch rows        1 Fetch of the request's blocks of the prefill's cache, rpc.Rows(ids...) with
                    rpc.Into(the decode cache): block ids[j] lands at row j of the decode cache
  fetch per block   baseline: one Fetch per block, of as many one-block tensors, each Into a one-block
                    tensor of the decode's pool
  fetch contiguous  baseline: 1 Fetch of a tensor of as many blocks back to back, Into the decode cache
  write rows        1 SendRows of the decode cache (each block at a new version of its pattern) over the
                    request's blocks of the prefill's cache
  Operations alternate request by request; only the calls are timed, not the checks.
  blocks/s and GB/s (1e9 bytes) from the mean time per request; copies: CPU copies of tensor bytes
  on the decode's side per request (rpc.Stats.Copies).
`)
	fmt.Fprintln(out)
	fmt.Fprintf(out, "%-5s  %-16s  %5s  %8s  %11s  %10s  %7s  %6s\n", "plane", "operation", "calls", "requests", "per request", "blocks/s", "GB/s", "copies")
}

func printPlane(out io.Writer, cfg *config, r *planeResult) {
	for op := range numOperations {
		t := r.Ops[op]
		fmt.Fprintf(out, "%-5s  %-16s  %5d  %8d  %11s  %10.0f  %7.3f  %6s\n", r.Plane, op, op.calls(cfg), t.Requests,
			units.Duration(t.perRequest()), t.blocksPerSecond(cfg), t.gbps(cfg), perRequest(t.Copies, t.Requests))
	}
	fmt.Fprintf(out, "%s: rows fetch %.2f× the rate of one Fetch per block, %.2f× the rate of one contiguous Fetch\n",
		r.Plane, r.overEach(), r.overContiguous())
}

func perRequest(n int64, requests int) string {
	if requests == 0 || n%int64(requests) == 0 {
		return fmt.Sprint(n / int64(max(requests, 1)))
	}
	return fmt.Sprintf("%.2f", float64(n)/float64(requests))
}

func printVerified(out io.Writer, cfg *config, rep *report) {
	var planes []string
	for _, p := range rep.Planes {
		planes = append(planes, p.Plane)
	}
	fmt.Fprintf(out, "bytes verified: %d blocks fetched (%s), every one checked against its pattern (block id, version); %d blocks written back with SendRows, %d read back by a later fetch at the version written; the prefill found all %d blocks of its own cache at the versions written (%d written)\n",
		rep.BlocksChecked, strings.Join(planes, ", "), rep.BlocksWritten, rep.ReadBack, rep.PrefillChecked, rep.PrefillWritten)
}
