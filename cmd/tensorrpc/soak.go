package main

// tensorrpc soak runs a Server and a Client per data plane in this process,
// on loopback, and moves tensors between them for a while, verifying every
// byte.
//
// Why one process: the soak watches for slow leaks and corruption, not for
// process death (the fault suite, go test -tags fault -run TestFault ./rpc,
// kills peers). In one process it needs nothing but its own binary, a
// failure is one exit status, and VmRSS and the goroutine count cover both
// sides at once. The data planes do not know the peer is in the same
// process: tcp goes through loopback sockets, shm through memfd mappings
// passed over a Unix socket, grpc through a loopback HTTP/2 connection.

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

const soakUsage = `usage: tensorrpc soak [flags]

Runs a tensorrpc Server and Client per data plane in this process, on
loopback, with -streams concurrent streams each doing a random mix of Send,
Fetch and Call of tensors of random sizes (log-uniform, 1 KiB to -size),
filled with a seeded pattern, sent with checksums on, and verified by the
soak against its own CRC32C. Every -report it prints per plane: transfers,
GB moved, errors, server and client pool stats, and the process's RSS and
goroutines. It exits 1 on any error or verification failure, 0 otherwise.

flags:
`

// soakCallTimeout is every call's deadline: a call that outlives it counts
// as an error (DeadlineExceeded).
const soakCallTimeout = 60 * time.Second

// soakCorrupt, when set (by tests), may change received bytes before the
// soak verifies them.
var soakCorrupt func(b []byte)

type soakConfig struct {
	duration, report time.Duration
	streams          int
	planes           []string
	size             int
	seed             uint64
}

func soakMain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tensorrpc soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg soakConfig
	fs.DurationVar(&cfg.duration, "duration", time.Minute, "how long to run")
	fs.DurationVar(&cfg.report, "report", 10*time.Second, "interval between reports")
	fs.IntVar(&cfg.streams, "streams", 16, "concurrent streams per plane")
	planes := fs.String("planes", "tcp,shm,grpc", "comma-separated data planes (tcp, shm, grpc, ibv)")
	size := fs.String("size", "4MiB", "largest tensor (bytes, or with a suffix KiB, MiB, GiB)")
	fs.Uint64Var(&cfg.seed, "seed", 0, "seed of sizes, operations and patterns (0: from the clock)")
	fs.Usage = func() {
		fmt.Fprint(stderr, soakUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	usage := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "tensorrpc soak: "+format+"\n", a...)
		fs.Usage()
		return 2
	}
	if fs.NArg() > 0 {
		return usage("unexpected arguments %q", fs.Args())
	}
	n, err := bytesize.Parse(*size)
	if err != nil || n < 1 || n > rpc.DefaultMaxTensorBytes {
		return usage("bad -size %q: want 1 B to 1 GiB", *size)
	}
	cfg.size = int(n)
	if cfg.duration <= 0 || cfg.report <= 0 || cfg.streams < 1 {
		return usage("-duration, -report and -streams must be positive")
	}
	for _, p := range strings.Split(*planes, ",") {
		switch p = strings.TrimSpace(p); p {
		case rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC, rpc.TransportIBV:
			cfg.planes = append(cfg.planes, p)
		default:
			return usage("unknown plane %q", p)
		}
	}
	if cfg.seed == 0 {
		cfg.seed = uint64(time.Now().UnixNano())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := runSoak(ctx, cfg, stdout); err != nil {
		fmt.Fprintln(stderr, "tensorrpc soak:", err)
		return 1
	}
	return 0
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// soakBlock is the pattern tensors are filled from: a seeded random block,
// copied from a seeded offset, so that filling costs a memcpy.
type soakBlock []byte

func newSoakBlock(seed uint64, size int) soakBlock {
	b := make([]byte, size+4096)
	r := rand.New(rand.NewPCG(seed, 0x50a4))
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	return b
}

// soakPlane is one Server and Client pair and its counters.
type soakPlane struct {
	name   string
	srv    *rpc.Server
	client *rpc.Client
	served chan error

	transfers, bytes, errs, verifyFails atomic.Int64
	sends, fetches, calls               atomic.Int64
	errMu                               sync.Mutex
	firstErrs                           []string
}

func (p *soakPlane) fail(verify bool, format string, a ...any) {
	if verify {
		p.verifyFails.Add(1)
	} else {
		p.errs.Add(1)
	}
	p.errMu.Lock()
	if len(p.firstErrs) < 10 {
		p.firstErrs = append(p.firstErrs, fmt.Sprintf(format, a...))
	}
	p.errMu.Unlock()
}

func soakPoolOptions() rpc.Option {
	return rpc.WithPoolOptions(mempool.WithArenaSize(16<<20), mempool.WithLimit(2<<30))
}

func startSoakPlane(ctx context.Context, name string) (*soakPlane, error) {
	p := &soakPlane{name: name, served: make(chan error, 1)}
	srv, err := rpc.NewServer(rpc.WithTransports(name), rpc.WithChecksums(true), soakPoolOptions())
	if err != nil {
		return nil, err
	}
	// echo verifies the request against the CRC32C in its metadata, then
	// returns a copy.
	srv.Handle("echo", func(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
		if len(req.Tensors) != 1 || len(req.Metadata) != 4 {
			return nil, status.Error(codes.InvalidArgument, "soak: echo wants one tensor and a CRC32C")
		}
		b := req.Tensors[0].Bytes()
		if got, want := crc32.Checksum(b, castagnoli), binary.LittleEndian.Uint32(req.Metadata); got != want {
			p.fail(true, "%s: server: call request of %d bytes: CRC32C %08x, want %08x", name, len(b), got, want)
			return nil, status.Errorf(codes.DataLoss, "soak: request CRC32C %08x, want %08x", got, want)
		}
		return &rpc.Message{Metadata: req.Metadata, Tensors: []*rpc.Tensor{rpc.WrapTensor(req.Tensors[0].Tensor)}}, nil
	})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Close()
		return nil, err
	}
	go func() { p.served <- srv.Serve(lis) }()
	p.srv = srv
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c, err := rpc.Dial(dctx, lis.Addr().String(), rpc.WithTransportCredentials(insecure.NewCredentials()), // loopback only
		rpc.WithTransports(name), rpc.WithChecksums(true), soakPoolOptions())
	if err != nil {
		p.stopServer()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	p.client = c
	if c.Transport() != name {
		p.close()
		return nil, fmt.Errorf("%s: the session uses %s (%v)", name, c.Transport(), c.Rejections())
	}
	return p, nil
}

func (p *soakPlane) stopServer() {
	p.srv.Stop()
	<-p.served
}

// close ends the plane: the client (which fails when its pool still has
// buffers out), then the server.
func (p *soakPlane) close() error {
	var errs []error
	if p.client != nil {
		if err := p.client.Close(); err != nil {
			errs = append(errs, fmt.Errorf("%s: client Close: %w", p.name, err))
		}
	}
	p.stopServer()
	if st := p.srv.Pool().Stats(); st.InUse != 0 {
		errs = append(errs, fmt.Errorf("%s: server pool: %d buffers (%d bytes) in use after Stop", p.name, st.Allocs, st.InUse))
	}
	return errors.Join(errs...)
}

// stream runs one stream's operations until run ends; the calls under way
// then finish under their own deadlines.
func (p *soakPlane) stream(run context.Context, id int, seed uint64, maxSize int, block soakBlock) {
	r := rand.New(rand.NewPCG(seed, uint64(id)))
	key := fmt.Sprintf("stream%d", id)
	var sent uint32 // CRC32C of the latest tensor sent under key
	var sentOff, sentN int
	var haveSent bool
	logMax := math.Log(float64(maxSize))
	logMin := math.Log(float64(min(1024, maxSize)))
	for run.Err() == nil {
		n := int(math.Exp(logMin + r.Float64()*(logMax-logMin)))
		n = max(1, min(n, maxSize))
		off := r.IntN(4096)
		ctx, cancel := context.WithTimeout(context.Background(), soakCallTimeout)
		switch op := r.IntN(3); {
		case op == 0 || (op == 1 && !haveSent):
			t, err := p.client.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
			if err != nil {
				p.fail(false, "%s: NewTensor %d: %v", p.name, n, err)
				break
			}
			copy(t.Bytes(), block[off:off+n])
			want := crc32.Checksum(t.Bytes(), castagnoli)
			err = p.client.Send(ctx, key, t)
			t.Release()
			if err != nil {
				p.fail(false, "%s: Send %d bytes: %v", p.name, n, err)
				haveSent = false // it may or may not have arrived
				break
			}
			sent, sentOff, sentN, haveSent = want, off, n, true
			p.sends.Add(1)
			p.transfers.Add(1)
			p.bytes.Add(int64(n))
		case op == 1:
			t, err := p.client.Fetch(ctx, key)
			if err != nil {
				p.fail(false, "%s: Fetch: %v", p.name, err)
				break
			}
			b := t.Bytes()
			if soakCorrupt != nil {
				soakCorrupt(b)
			}
			if got := crc32.Checksum(b, castagnoli); got != sent {
				p.fail(true, "%s: Fetch of %q: %d bytes (sent %d): CRC32C %08x, want %08x; %s", p.name, key, len(b), sentN, got, sent, diffSummary(b, block[sentOff:sentOff+sentN]))
			}
			p.fetches.Add(1)
			p.transfers.Add(1)
			p.bytes.Add(int64(len(b)))
			t.Release()
		default:
			t, err := p.client.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
			if err != nil {
				p.fail(false, "%s: NewTensor %d: %v", p.name, n, err)
				break
			}
			copy(t.Bytes(), block[off:off+n])
			want := crc32.Checksum(t.Bytes(), castagnoli)
			reply, err := p.client.Call(ctx, "echo", &rpc.Message{Metadata: binary.LittleEndian.AppendUint32(nil, want), Tensors: []*rpc.Tensor{t}})
			t.Release()
			if err != nil {
				p.fail(status.Code(err) == codes.DataLoss, "%s: Call with %d bytes: %v", p.name, n, err)
				break
			}
			if len(reply.Tensors) != 1 {
				p.fail(true, "%s: Call: %d reply tensors", p.name, len(reply.Tensors))
			} else {
				b := reply.Tensors[0].Bytes()
				if soakCorrupt != nil {
					soakCorrupt(b)
				}
				if got := crc32.Checksum(b, castagnoli); got != want || len(b) != n {
					p.fail(true, "%s: Call reply of %d bytes (sent %d): CRC32C %08x, want %08x", p.name, len(b), n, got, want)
				}
			}
			reply.Release()
			p.calls.Add(1)
			p.transfers.Add(2)
			p.bytes.Add(2 * int64(n))
		}
		cancel()
	}
}

// diffSummary says where got differs from want.
func diffSummary(got, want []byte) string {
	first, last, count := -1, -1, 0
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			if first < 0 {
				first = i
			}
			last = i
			count++
		}
	}
	if first < 0 {
		return fmt.Sprintf("equal over the first %d bytes", min(len(got), len(want)))
	}
	return fmt.Sprintf("%d bytes differ, from offset %d to %d", count, first, last)
}

func rssMiB() string {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return "n/a"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				return fmt.Sprintf("%.1fMiB", float64(kb)/1024)
			}
		}
	}
	return "n/a"
}

func mib(n int64) string { return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20)) }

func (p *soakPlane) line(elapsed time.Duration) string {
	ss, cs := p.srv.Pool().Stats(), p.client.Pool().Stats()
	return fmt.Sprintf("[%6s] %-4s transfers=%d GB=%.3f errors=%d verify-failures=%d server-pool(inuse=%s reserved=%s) client-pool(inuse=%s reserved=%s) rss=%s goroutines=%d",
		elapsed.Round(time.Second), p.name, p.transfers.Load(), float64(p.bytes.Load())/1e9, p.errs.Load(), p.verifyFails.Load(),
		mib(ss.InUse), mib(ss.Reserved), mib(cs.InUse), mib(cs.Reserved), rssMiB(), runtime.NumGoroutine())
}

func runSoak(ctx context.Context, cfg soakConfig, out io.Writer) error {
	goroutinesBefore := runtime.NumGoroutine()
	fmt.Fprintf(out, "soak: planes=%s streams=%d duration=%v size=%d report=%v seed=%d (loopback, checksums on; rss and goroutines are the whole process)\n",
		strings.Join(cfg.planes, ","), cfg.streams, cfg.duration, cfg.size, cfg.report, cfg.seed)
	block := newSoakBlock(cfg.seed, cfg.size)
	var planes []*soakPlane
	closeAll := func() error {
		var errs []error
		for _, p := range planes {
			errs = append(errs, p.close())
		}
		return errors.Join(errs...)
	}
	for _, name := range cfg.planes {
		p, err := startSoakPlane(ctx, name)
		if err != nil {
			closeAll()
			return err
		}
		planes = append(planes, p)
	}
	start := time.Now()
	run, cancel := context.WithTimeout(ctx, cfg.duration)
	defer cancel()
	var wg sync.WaitGroup
	for pi, p := range planes {
		for s := range cfg.streams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p.stream(run, s, cfg.seed+uint64(pi)<<32, cfg.size, block)
			}()
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	tick := time.NewTicker(cfg.report)
	defer tick.Stop()
	interrupted, ctxDone := false, ctx.Done()
wait:
	for {
		select {
		case <-done:
			break wait
		case <-tick.C:
			for _, p := range planes {
				fmt.Fprintln(out, p.line(time.Since(start)))
			}
		case <-ctxDone:
			interrupted, ctxDone = true, nil
			fmt.Fprintln(out, "soak: interrupted; finishing the calls under way")
		}
	}
	elapsed := time.Since(start)

	fmt.Fprintf(out, "soak: summary after %v\n", elapsed.Round(100*time.Millisecond))
	var failed bool
	var totBytes, totTransfers int64
	for _, p := range planes {
		fmt.Fprintln(out, p.line(elapsed))
		gb := float64(p.bytes.Load()) / 1e9
		fmt.Fprintf(out, "         %-4s sends=%d fetches=%d calls=%d %.2f GB/s\n", p.name, p.sends.Load(), p.fetches.Load(), p.calls.Load(), gb/elapsed.Seconds())
		totBytes += p.bytes.Load()
		totTransfers += p.transfers.Load()
		if p.errs.Load() > 0 || p.verifyFails.Load() > 0 {
			failed = true
			for _, e := range p.firstErrs {
				fmt.Fprintln(out, "  error:", e)
			}
		}
	}
	closeErr := closeAll()
	if closeErr != nil {
		fmt.Fprintln(out, "  error:", closeErr)
		failed = true
	}
	// Goroutines of the planes end with Close and Stop; give them a moment.
	left := runtime.NumGoroutine()
	for deadline := time.Now().Add(5 * time.Second); left > goroutinesBefore && time.Now().Before(deadline); left = runtime.NumGoroutine() {
		time.Sleep(10 * time.Millisecond)
	}
	fmt.Fprintf(out, "soak: total transfers=%d GB=%.3f goroutines-after-shutdown=%d (before start %d) rss=%s\n",
		totTransfers, float64(totBytes)/1e9, left, goroutinesBefore, rssMiB())
	if interrupted {
		fmt.Fprintln(out, "soak: interrupted before -duration")
	}
	if failed {
		fmt.Fprintln(out, "soak: FAIL")
		return errors.New("errors or verification failures (see above)")
	}
	fmt.Fprintln(out, "soak: PASS")
	return nil
}
