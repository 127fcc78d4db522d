//go:build fault

package rpc_test

// The fault suite kills peer processes (SIGKILL) while tensors move and
// checks what the surviving side does. It is not part of the ordinary
// tests; run it with
//
//	go test -tags fault -run TestFault -v ./rpc
//
// For every data plane (tcp, shm, grpc), operation (Fetch, Send, Call) and
// peer that dies (the server child, with a Client in this process that
// survives; or the client child, with a Server in this process that
// survives), it runs rounds of: start the peer process, move tensors of
// mixed sizes (4 KiB to 3 MiB, inline and over the data plane), kill the
// peer at a point the seeded schedule picks, and check the survivor:
//
//   - before: the peer is killed with a session open and no call under
//     way; the survivor's next call must fail.
//   - after: the peer is killed right after 1–6 completed transfers.
//   - during: faultWorkers goroutines (client survivor) or the child's loop
//     (server survivor) transfer continuously and the kill comes after a
//     random delay of up to faultMaxDelay; most kills land inside a
//     transfer (the report counts those that had one in flight).
//
// After each kill:
//
//   - every call of the survivor that the kill affected fails with
//     Unavailable or Canceled, within its deadline (faultCallTimeout);
//     DeadlineExceeded, or a call still running after its deadline plus a
//     grace period, counts as a hung call and fails the test;
//   - the survivor's pool returns, within faultSettle, to exactly what it
//     holds itself (the client's source tensors; the server's published
//     tensors), counted in buffers and bytes;
//   - a surviving Server drops the dead client's session from Sessions(),
//     and what the dead client managed to Send is intact (its CRC32C
//     matches) or absent, never torn;
//   - a surviving Client recovers by itself: the server child restarts on
//     the same address and the Client's next calls (the same Client, no
//     re-dial) open a new session over the same plane and succeed.
//
// Each combination ends with leakcheck: no goroutine is left.
//
// Numbers: -fault.kills (default 16) kills per combination, and rounds go
// on until at least -fault.transfers (default 100) transfers completed, so
// 18 combinations make at least 288 kills and 1800 transfers. On the
// 2-core development VM the whole suite takes about 2–3 minutes. Every
// transfer carries a CRC32C (WithChecksums on both sides) and is verified
// again by the test against the pattern it was filled with.

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

var (
	faultSeed      = flag.Uint64("fault.seed", 0, "seed of the fault suite's schedule (0: from the clock)")
	faultKills     = flag.Int("fault.kills", 25, "peer kills per combination")
	faultTransfers = flag.Int("fault.transfers", 100, "at least this many completed transfers per combination")
)

const (
	faultCallTimeout = 10 * time.Second // every call's deadline
	faultGrace       = 5 * time.Second  // past the deadline, a call counts as hung
	faultSettle      = 5 * time.Second  // bound of the polls for pools and sessions
	faultWorkers     = 2                // concurrent transfers of a surviving client
	faultMaxDelay    = 40 * time.Millisecond
	faultSrcSeed     = 50  // Send and Call move fill(…, faultSrcSeed+i)
	faultFetchSeed   = 100 // key f<i> holds fill(…, faultFetchSeed+i)
)

// faultSizes are the tensor sizes, picked at random per transfer: below and
// above the eager threshold, up to a few MiB, odd lengths included.
var faultSizes = []int{4<<10 + 1, 12 << 10, 24<<10 + 7, 256<<10 + 3, 1 << 20, 3<<20 + 5}

var faultOps = []string{"fetch", "send", "call"}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

var faultCRCs sync.Map // [2]int{size, seed} → uint32

// faultCRC is the CRC32C of size bytes of fill's pattern seed.
func faultCRC(size, seed int) uint32 {
	k := [2]int{size, seed}
	if v, ok := faultCRCs.Load(k); ok {
		return v.(uint32)
	}
	b := make([]byte, size)
	fill(b, byte(seed))
	sum := crc32.Checksum(b, castagnoli)
	faultCRCs.Store(k, sum)
	return sum
}

var errCorrupt = errors.New("corrupt tensor")

func faultCheck(t *rpc.Tensor, i, seed int) error {
	if n := len(t.Bytes()); n != faultSizes[i] {
		return fmt.Errorf("%w: %d bytes, want %d", errCorrupt, n, faultSizes[i])
	}
	if got, want := crc32.Checksum(t.Bytes(), castagnoli), faultCRC(faultSizes[i], seed); got != want {
		return fmt.Errorf("%w: CRC32C %08x, want %08x (size %d)", errCorrupt, got, want, faultSizes[i])
	}
	return nil
}

// faultBackoff makes recovery quick: both the Client's session backoff and
// gRPC's connection backoff.
var faultBackoff = backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 100 * time.Millisecond}

func faultDialOpts(plane string) []rpc.DialOption {
	return []rpc.DialOption{
		rpc.WithTransports(plane), testPool(), insecureCreds(), rpc.WithChecksums(true), rpc.WithBackoff(faultBackoff),
		rpc.WithGRPCDialOptions(grpc.WithConnectParams(grpc.ConnectParams{Backoff: faultBackoff, MinConnectTimeout: 5 * time.Second})),
	}
}

// faultOp does one transfer of op with the tensor of size index i, under
// its own deadline, and verifies what arrives.
func faultOp(c *rpc.Client, op string, i int, src []*rpc.Tensor) error {
	ctx, cancel := context.WithTimeout(context.Background(), faultCallTimeout)
	defer cancel()
	switch op {
	case "fetch":
		t, err := c.Fetch(ctx, fmt.Sprintf("f%d", i))
		if err != nil {
			return err
		}
		defer t.Release()
		return faultCheck(t, i, faultFetchSeed+i)
	case "send":
		return c.Send(ctx, fmt.Sprintf("s%d", i), src[i])
	case "call":
		reply, err := c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{src[i]}})
		if err != nil {
			return err
		}
		defer reply.Release()
		if len(reply.Tensors) != 1 {
			return fmt.Errorf("%w: %d reply tensors", errCorrupt, len(reply.Tensors))
		}
		return faultCheck(reply.Tensors[0], i, faultSrcSeed+i)
	}
	return fmt.Errorf("unknown op %q", op)
}

// faultSources allocates one pool tensor per size, filled for Send and Call.
func faultSources(ctx context.Context, alloc func(context.Context, zerocopy.DType, []int64) (*rpc.Tensor, error)) ([]*rpc.Tensor, error) {
	var src []*rpc.Tensor
	for i, n := range faultSizes {
		t, err := alloc(ctx, zerocopy.Uint8, []int64{int64(n)})
		if err != nil {
			for _, s := range src {
				s.Release()
			}
			return nil, err
		}
		fill(t.Bytes(), byte(faultSrcSeed+i))
		src = append(src, t)
	}
	return src, nil
}

// faultServe publishes f<i> and handles "echo".
func faultServe(ctx context.Context, s *rpc.Server) error {
	for i, n := range faultSizes {
		t, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
		if err != nil {
			return err
		}
		fill(t.Bytes(), byte(faultFetchSeed+i))
		err = s.Publish(ctx, fmt.Sprintf("f%d", i), t)
		t.Release()
		if err != nil {
			return err
		}
	}
	s.Handle("echo", func(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
		out := make([]*rpc.Tensor, len(req.Tensors))
		for i, x := range req.Tensors {
			out[i] = rpc.WrapTensor(x.Tensor) // copied by tensorrpc before the request is released
		}
		return &rpc.Message{Tensors: out}, nil
	})
	return nil
}

// The child processes of the fault suite. TestMain hands other modes to
// runChild; these are caught first, in init.
func init() {
	if mode := childproc.Role(); strings.HasPrefix(mode, "fault-") {
		os.Exit(runFaultChild(mode))
	}
}

// runFaultChild: "fault-server" serves faultServe on TENSORRPC_TEST_LISTEN
// (retrying while a killed predecessor's port lingers), prints its address
// and serves until killed or stdin closes. "fault-client" dials
// TENSORRPC_TEST_ADDR, prints "ready", does TENSORRPC_FAULT_N transfers of
// TENSORRPC_FAULT_OP (-1: until killed) printing "t" after each, then
// prints "idle" and waits. Any failure exits 1 (a verification failure 3),
// which the parent sees, since it expects death by SIGKILL.
func runFaultChild(mode string) int {
	plane := os.Getenv("TENSORRPC_TEST_TRANSPORTS")
	ctx := context.Background()
	switch mode {
	case "fault-server":
		s, err := rpc.NewServer(rpc.WithTransports(plane), testPool(), rpc.WithChecksums(true))
		if err != nil {
			fmt.Fprintln(os.Stderr, "fault-server:", err)
			return 1
		}
		if err := faultServe(ctx, s); err != nil {
			fmt.Fprintln(os.Stderr, "fault-server:", err)
			return 1
		}
		addr := cmp.Or(os.Getenv("TENSORRPC_TEST_LISTEN"), "127.0.0.1:0")
		var lis net.Listener
		for try := 0; ; try++ {
			if lis, err = net.Listen("tcp", addr); err == nil || try == 200 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "fault-server:", err)
			return 1
		}
		return serveUntilStopped(s, lis)
	case "fault-client":
		op := os.Getenv("TENSORRPC_FAULT_OP")
		n, _ := strconv.Atoi(os.Getenv("TENSORRPC_FAULT_N"))
		seed, _ := strconv.ParseUint(os.Getenv("TENSORRPC_FAULT_SEED"), 10, 64)
		dctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		c, err := rpc.Dial(dctx, os.Getenv("TENSORRPC_TEST_ADDR"), faultDialOpts(plane)...)
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "fault-client:", err)
			return 1
		}
		src, err := faultSources(ctx, c.NewTensor)
		if err != nil {
			fmt.Fprintln(os.Stderr, "fault-client:", err)
			return 1
		}
		rng := rand.New(rand.NewPCG(seed, 1))
		fmt.Println("ready")
		for i := 0; n < 0 || i < n; i++ {
			if err := faultOp(c, op, rng.IntN(len(faultSizes)), src); err != nil {
				fmt.Fprintln(os.Stderr, "fault-client:", op, err)
				if errors.Is(err, errCorrupt) {
					return 3
				}
				return 1
			}
			fmt.Println("t")
		}
		fmt.Println("idle")
		childproc.WaitForStop()
		return 0
	}
	return 2
}

// faultResult is what one combination saw.
type faultResult struct {
	name             string
	transfers, kills int
	phases           [3]int // kills before, after, during
	inFlight         int    // kills with a transfer of the survivor in flight
	failed           map[codes.Code]int
	hung, corrupt    int
	leakedBuffers    int64
	sessionsDropped  int
	recoveries       int
	maxRecovery      time.Duration
	sentChecked      int // tensors a dead client had sent, verified intact
	goroutines       int
	elapsed          time.Duration
	skipped          string
	ran              bool
}

var phaseNames = [3]string{"before", "after", "during"}

// faultCode classifies the error of a call a kill affected: Unavailable and
// Canceled are what it may be; anything else fails the test.
func (r *faultResult) faultCode(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		return
	}
	code := status.Code(err)
	r.failed[code]++
	switch {
	case errors.Is(err, errCorrupt):
		r.corrupt++
		t.Errorf("%s: %v", what, err)
	case code == codes.DeadlineExceeded:
		r.hung++
		t.Errorf("%s: hung until its deadline: %v", what, err)
	case code != codes.Unavailable && code != codes.Canceled:
		t.Errorf("%s: %v (code %v), want Unavailable or Canceled", what, err, code)
	}
}

func TestFault(t *testing.T) {
	seed := *faultSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("fault seed %d (rerun with -fault.seed=%d); %d kills and at least %d transfers per combination",
		seed, seed, *faultKills, *faultTransfers)
	var results []*faultResult
	for pi, plane := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		for oi, op := range faultOps {
			for di, dies := range []string{"server", "client"} {
				r := &faultResult{name: plane + "/" + op + "/" + dies + "-dies", failed: map[codes.Code]int{}}
				results = append(results, r)
				sched := rand.New(rand.NewPCG(seed, uint64(pi*100+oi*10+di)))
				t.Run(plane+"/"+op+"/"+dies+"-dies", func(t *testing.T) {
					if p := rpctest.Provider(plane); p != nil {
						if _, err := p.Devices(); err != nil {
							r.skipped = err.Error()
						}
					}
					skipWithoutDevice(t, plane)
					r.ran = true
					start := time.Now()
					if dies == "server" {
						faultServerDies(t, sched, plane, op, r)
					} else {
						faultClientDies(t, sched, seed, plane, op, r)
					}
					leakcheck.Check(t)
					r.goroutines = len(leakcheck.Goroutines())
					r.elapsed = time.Since(start)
					t.Logf("%s", r)
				})
			}
		}
	}
	var tot faultResult
	tot.failed = map[codes.Code]int{}
	t.Logf("summary (seed %d):", seed)
	for _, r := range results {
		if !r.ran && r.skipped == "" {
			continue // not selected by -run
		}
		if r.skipped != "" {
			t.Logf("  %-24s skipped: %s", r.name, r.skipped)
			continue
		}
		t.Logf("  %s", r)
		tot.transfers += r.transfers
		tot.kills += r.kills
		for i := range tot.phases {
			tot.phases[i] += r.phases[i]
		}
		tot.inFlight += r.inFlight
		for k, v := range r.failed {
			tot.failed[k] += v
		}
		tot.hung += r.hung
		tot.corrupt += r.corrupt
		tot.leakedBuffers += r.leakedBuffers
		tot.sessionsDropped += r.sessionsDropped
		tot.recoveries += r.recoveries
		tot.maxRecovery = max(tot.maxRecovery, r.maxRecovery)
		tot.sentChecked += r.sentChecked
		tot.goroutines += r.goroutines
		tot.elapsed += r.elapsed
	}
	tot.name = "TOTAL"
	t.Logf("  %s", &tot)
}

func (r *faultResult) String() string {
	var codesSeen []string
	for _, c := range []codes.Code{codes.Unavailable, codes.Canceled} {
		codesSeen = append(codesSeen, fmt.Sprintf("%v=%d", c, r.failed[c]))
	}
	for c, n := range r.failed {
		if c != codes.Unavailable && c != codes.Canceled {
			codesSeen = append(codesSeen, fmt.Sprintf("%v=%d", c, n))
		}
	}
	return fmt.Sprintf("%-24s transfers=%d kills=%d (before=%d after=%d during=%d, in-flight=%d) failed-calls[%s] hung=%d corrupt=%d leaked-buffers=%d sessions-dropped=%d recoveries=%d (max %v) sent-verified=%d goroutines-left=%d time=%v",
		r.name, r.transfers, r.kills, r.phases[0], r.phases[1], r.phases[2], r.inFlight, strings.Join(codesSeen, " "),
		r.hung, r.corrupt, r.leakedBuffers, r.sessionsDropped, r.recoveries, r.maxRecovery.Round(time.Millisecond),
		r.sentChecked, r.goroutines, r.elapsed.Round(100*time.Millisecond))
}

// poolSettles waits (bounded) until the pool holds exactly want buffers of
// wantBytes, and returns the buffers over.
func poolSettles(t *testing.T, what string, stats func() (inUse, allocs int64), wantBytes, want int64) int64 {
	t.Helper()
	deadline := time.Now().Add(faultSettle)
	for {
		inUse, allocs := stats()
		if inUse == wantBytes && allocs == want {
			return 0
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: %d buffers (%d bytes) in use %v after the kill, want %d (%d bytes)", what, allocs, inUse, faultSettle, want, wantBytes)
			return max(allocs-want, 1)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// faultServerDies: the server is a child process, killed and restarted on
// the same address; one Client in this process survives every kill.
func faultServerDies(t *testing.T, sched *rand.Rand, plane, op string, r *faultResult) {
	start := func(addr string) *childproc.Process {
		return startChildCmd(t, nil, "fault-server", plane, 0, "TENSORRPC_TEST_LISTEN="+addr)
	}
	ch := start("127.0.0.1:0")
	addr := childtest.Line(t, ch)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	c, err := rpc.Dial(ctx, addr, faultDialOpts(plane)...)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	// The client's own tensors, released and allocated again after every
	// kill: its pool must then be empty, so that a reference the kill
	// leaked on one of them shows too.
	srcs := make([][]*rpc.Tensor, faultWorkers)
	allocSources := func() {
		for w := range srcs {
			if srcs[w], err = faultSources(context.Background(), c.NewTensor); err != nil {
				t.Fatal(err)
			}
		}
	}
	releaseSources := func() {
		for _, src := range srcs {
			for _, s := range src {
				s.Release()
			}
		}
	}
	allocSources()
	t.Cleanup(func() { c.Close() }) // when the test stops early; Close is idempotent
	var leakedBytes int64
	sizes := rand.New(rand.NewPCG(sched.Uint64(), 2)) // apart from the schedule, which stays reproducible
	var sizeMu sync.Mutex
	size := func() int {
		sizeMu.Lock()
		defer sizeMu.Unlock()
		return sizes.IntN(len(faultSizes))
	}
	stats := func() (int64, int64) { st := c.Pool().Stats(); return st.InUse, st.Allocs }

	for r.kills < *faultKills || r.transfers < *faultTransfers {
		if r.kills > 0 {
			// The server comes back on the same address; the same Client's
			// next calls open a new session by themselves.
			ch = start(addr)
			if got := childtest.Line(t, ch); got != addr {
				t.Fatalf("restarted server listens on %s, want %s", got, addr)
			}
			began := time.Now()
			for {
				err := faultOp(c, op, size(), srcs[0])
				if err == nil {
					break
				}
				if status.Code(err) != codes.Unavailable || time.Since(began) > 30*time.Second {
					t.Fatalf("after the server restarted, kill %d: %v", r.kills, err)
				}
				time.Sleep(5 * time.Millisecond)
			}
			r.recoveries++
			r.maxRecovery = max(r.maxRecovery, time.Since(began))
			r.transfers++
			if tr := c.Transport(); tr != plane {
				t.Fatalf("after recovery the session uses %s, want %s", tr, plane)
			}
		} else if err := c.Connect(context.Background()); err != nil {
			t.Fatal(err)
		}

		phase := sched.IntN(3)
		r.phases[phase]++
		var inflight atomic.Int32
		var wg sync.WaitGroup
		errs := make(chan error, faultWorkers)
		var slow atomic.Int32
		var done atomic.Int64
		switch phase {
		case 1:
			for range 1 + sched.IntN(6) {
				if err := faultOp(c, op, size(), srcs[0]); err != nil {
					t.Fatalf("transfer before the kill: %v", err)
				}
				r.transfers++
			}
		case 2:
			for w := range faultWorkers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						inflight.Add(1)
						began := time.Now()
						err := faultOp(c, op, size(), srcs[w])
						inflight.Add(-1)
						if err != nil {
							if time.Since(began) > faultCallTimeout+faultGrace {
								slow.Add(1)
							}
							errs <- err
							return
						}
						done.Add(1)
					}
				}()
			}
			time.Sleep(time.Duration(sched.Int64N(int64(faultMaxDelay))))
		}
		if inflight.Load() > 0 {
			r.inFlight++
		}
		ch.Kill()
		r.kills++
		if phase == 2 {
			finished := make(chan struct{})
			go func() { wg.Wait(); close(finished) }()
			select {
			case <-finished:
			case <-time.After(faultCallTimeout + faultGrace):
				r.hung++
				t.Fatalf("calls under way at the kill still run after %v:\n%s", faultCallTimeout+faultGrace, strings.Join(leakcheck.Goroutines(), "\n\n"))
			}
			close(errs)
			if n := slow.Load(); n > 0 {
				r.hung += int(n)
				t.Errorf("%d calls outlived their deadline by more than %v", n, faultGrace)
			}
			for err := range errs {
				r.faultCode(t, op+" under way at the kill", err)
			}
			r.transfers += int(done.Load())
		}
		// A call after the kill, before the restart, fails too.
		r.faultCode(t, op+" after the kill", cmp.Or(faultOp(c, op, size(), srcs[0]), errors.New("succeeded with the server dead")))
		releaseSources()
		if leaked := poolSettles(t, fmt.Sprintf("client pool (kill %d, %s)", r.kills, phaseNames[phase]), stats, leakedBytes, r.leakedBuffers); leaked > 0 {
			// Go on, counting: what leaked stays in the pool.
			r.leakedBuffers += leaked
			leakedBytes, _ = stats()
		}
		allocSources()
		if t.Failed() && r.leakedBuffers == 0 {
			t.FailNow()
		}
	}
	releaseSources()
	closeClient(t, c)
	ch.Kill()
}

// faultClientDies: the client is a child process, killed and started again;
// one Server in this process survives every kill.
func faultClientDies(t *testing.T, sched *rand.Rand, seed uint64, plane, op string, r *faultResult) {
	s, addr, stop := serveOn(t, "127.0.0.1:0", rpc.WithTransports(plane), rpc.WithChecksums(true))
	if err := faultServe(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	published := s.Pool().Stats()
	stats := func() (int64, int64) { st := s.Pool().Stats(); return st.InUse, st.Allocs }
	// checkSent verifies what dead clients sent, then unpublishes it.
	checkSent := func() {
		for i := range faultSizes {
			key := fmt.Sprintf("s%d", i)
			ctx, cancel := context.WithTimeout(context.Background(), faultCallTimeout)
			got, err := s.Fetch(ctx, key)
			cancel()
			switch {
			case status.Code(err) == codes.NotFound:
			case err != nil:
				t.Errorf("server Fetch %s: %v", key, err)
			default:
				if err := faultCheck(got, i, faultSrcSeed+i); err != nil {
					r.corrupt++
					t.Errorf("%s, sent by a killed client: %v", key, err)
				}
				got.Release()
				r.sentChecked++
			}
			s.Unpublish(key)
		}
	}

	for round := 0; r.kills < *faultKills || r.transfers < *faultTransfers; round++ {
		phase := sched.IntN(3)
		n := -1
		switch phase {
		case 0:
			n = 0
		case 1:
			n = 1 + sched.IntN(6)
		}
		ch := startChildCmd(t, nil, "fault-client", plane, 0, "TENSORRPC_TEST_ADDR="+addr, "TENSORRPC_FAULT_OP="+op,
			fmt.Sprintf("TENSORRPC_FAULT_N=%d", n), fmt.Sprintf("TENSORRPC_FAULT_SEED=%d", seed+uint64(round)))
		if l := childtest.Line(t, ch); l != "ready" {
			t.Fatalf("client child said %q", l)
		}
		var count atomic.Int64
		idle, ended := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(ended)
			for {
				l, err := ch.ReadLine(context.Background()) // ErrExited once the child is gone
				if err != nil {
					return
				}
				switch l {
				case "t":
					count.Add(1)
				case "idle":
					close(idle)
				}
			}
		}()
		if n >= 0 {
			select {
			case <-idle:
			case <-ended:
				ch.Kill()
				t.Fatalf("client child ended before its %d transfers: %v", n, ch.ProcessState())
			case <-time.After(60 * time.Second):
				t.Fatalf("client child did not finish %d transfers in 60 s", n)
			}
		} else {
			time.Sleep(time.Duration(sched.Int64N(int64(faultMaxDelay))))
		}
		r.phases[phase]++
		live := s.Sessions()
		if len(live) != 1 {
			t.Fatalf("%d sessions before the kill, want 1", len(live))
		}
		ch.Kill()
		r.kills++
		select { // the reader has every line the child wrote once it ends
		case <-ended:
		case <-time.After(faultSettle):
			t.Fatal("the killed client child's output did not end")
		}
		if !ch.Signaled() {
			t.Fatalf("client child ended by itself, not by the kill: %v (see its stderr above)", ch.ProcessState())
		}
		r.transfers += int(count.Load())

		deadline := time.Now().Add(faultSettle)
		for len(s.Sessions()) != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("the dead client's session is still listed %v after the kill: %+v", faultSettle, s.Sessions())
			}
			time.Sleep(2 * time.Millisecond)
		}
		r.sessionsDropped++
		checkSent()
		r.leakedBuffers += poolSettles(t, "server pool", stats, published.InUse, published.Allocs)
		if t.Failed() {
			t.FailNow()
		}
	}

	// The server still serves every operation after all the kills.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := rpc.Dial(ctx, addr, faultDialOpts(plane)...)
	if err != nil {
		t.Fatal(err)
	}
	src, err := faultSources(ctx, c.NewTensor)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range faultOps {
		for i := range faultSizes {
			if err := faultOp(c, o, i, src); err != nil {
				t.Errorf("%s of %d bytes after the kills: %v", o, faultSizes[i], err)
			}
		}
	}
	for _, x := range src {
		x.Release()
	}
	closeClient(t, c)
	checked := r.sentChecked
	checkSent() // what the live client sent
	r.sentChecked = checked
	stop()
}
