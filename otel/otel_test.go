package tensorrpcotel_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	tensorrpcotel "github.com/tensorrpc/tensorrpc/otel"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func TestMain(m *testing.M) {
	if os.Getenv(benchChildEnv) != "" {
		serveBench() // BenchmarkFetch4KiBTwoProcesses's child
		return
	}
	leakcheck.Main(m)
}

func small() rpc.Option {
	return rpc.WithPoolOptions(mempool.WithArenaSize(4<<20), mempool.WithLimit(64<<20))
}

// pair starts a server and dials it over plane, both with tel as an
// inline interceptor (none when nil), and publishes "w" (64 KiB) and
// handles "echo".
func pair(t testing.TB, plane string, tel rpc.Interceptor) (*rpc.Server, *rpc.Client) {
	t.Helper()
	if tel == nil {
		return pairWith(t, plane, nil, nil)
	}
	return pairWith(t, plane, []rpc.ServerOption{rpc.WithInlineInterceptors(tel)}, []rpc.DialOption{rpc.WithInlineInterceptors(tel)})
}

// pairWith is pair with the server's options so and the client's do.
func pairWith(t testing.TB, plane string, so []rpc.ServerOption, do []rpc.DialOption) (*rpc.Server, *rpc.Client) {
	t.Helper()
	srv, err := rpc.NewServer(append(so, small())...)
	if err != nil {
		t.Fatal(err)
	}
	srv.Handle("echo", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		return &rpc.Message{Tensors: req.Tensors}, nil
	})
	ctx := context.Background()
	w, err := srv.NewTensor(ctx, zerocopy.Uint8, []int64{64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	srv.Publish(ctx, "w", w)
	w.Release()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	c, err := rpc.Dial(ctx, lis.Addr().String(), append(do, rpc.WithTransportCredentials(insecure.NewCredentials()),
		rpc.WithTransports(plane), small())...)
	if err != nil {
		srv.Stop()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		srv.Stop()
		<-served
	})
	return srv, c
}

func tensor(n int) *rpc.Tensor {
	zt, _ := zerocopy.New(zerocopy.Uint8, []int64{int64(n)}, make([]byte, n))
	return rpc.WrapTensor(zt)
}

func attr(kvs []attribute.KeyValue, key string) string {
	for _, kv := range kvs {
		if string(kv.Key) == key {
			return kv.Value.Emit()
		}
	}
	return ""
}

// TestCallSpansShareATrace: a Call over each plane yields a client span
// and a server span in one trace, the server's the child of the
// client's, with the RPC attributes.
func TestCallSpansShareATrace(t *testing.T) {
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		for _, n := range []int{100, 1 << 20} { // in the frame (an Inline method's call runs where it is read), and pulled
			t.Run(fmt.Sprintf("%s/%d", plane, n), func(t *testing.T) {
				callSpansShareATrace(t, plane, n)
			})
		}
	}
}

func callSpansShareATrace(t *testing.T, plane string, n int) {
	{
		{
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			defer tp.Shutdown(context.Background())
			srv, c := pair(t, plane, tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tp)))
			srv.Handle("echo-inline", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
				return &rpc.Message{Tensors: req.Tensors}, nil
			}, rpc.Inline())
			reply, err := c.Call(context.Background(), "echo-inline", &rpc.Message{Tensors: []*rpc.Tensor{tensor(n)}})
			if err != nil {
				t.Fatal(err)
			}
			reply.Release()
			// The server's span ends once its answer has gone: maybe
			// after the client has it.
			var spans tracetest.SpanStubs
			eventually(t, "both spans", func() bool { spans = exp.GetSpans(); return len(spans) >= 2 })
			var client, server *tracetest.SpanStub
			for i := range spans {
				switch spans[i].SpanKind {
				case trace.SpanKindClient:
					client = &spans[i]
				case trace.SpanKindServer:
					server = &spans[i]
				}
			}
			if client == nil || server == nil || len(spans) != 2 {
				t.Fatalf("spans: %+v", spans)
			}
			if client.SpanContext.TraceID() != server.SpanContext.TraceID() || server.Parent.SpanID() != client.SpanContext.SpanID() {
				t.Errorf("the server's span is not the client's child: client %v, server %v (parent %v)", client.SpanContext, server.SpanContext, server.Parent)
			}
			for _, s := range []*tracetest.SpanStub{client, server} {
				for key, want := range map[string]string{"rpc.system": "tensorrpc", "rpc.method": "echo-inline", "tensorrpc.operation": "Call", "tensorrpc.plane": plane, "rpc.grpc.status_code": "0", "tensorrpc.request.bytes": fmt.Sprint(n)} {
					if got := attr(s.Attributes, key); got != want {
						t.Errorf("%s span: %s = %q, want %q", s.SpanKind, key, got, want)
					}
				}
				if s.Name != "tensorrpc/Call echo-inline" {
					t.Errorf("span name %q", s.Name)
				}
			}
		}
	}
}

// eventually waits, up to a generous deadline, for cond.
// TestFetchAndSendSpansShareATrace: a Fetch's and a Send's server span,
// made once the answer has gone, is the client span's child, with the
// call's times (within the client's) and the key.
func TestFetchAndSendSpansShareATrace(t *testing.T) {
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(plane, func(t *testing.T) {
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			defer tp.Shutdown(context.Background())
			_, c := pair(t, plane, tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tp)))
			ctx := context.Background()
			got, err := c.Fetch(ctx, "w")
			if err != nil {
				t.Fatal(err)
			}
			got.Release()
			if err := c.Send(ctx, "s", tensor(4<<10)); err != nil {
				t.Fatal(err)
			}
			var spans tracetest.SpanStubs
			eventually(t, "four spans", func() bool { spans = exp.GetSpans(); return len(spans) >= 4 })
			for _, op := range []string{"Fetch", "Send"} {
				var client, server *tracetest.SpanStub
				for i := range spans {
					if attr(spans[i].Attributes, "tensorrpc.operation") != op {
						continue
					}
					switch spans[i].SpanKind {
					case trace.SpanKindClient:
						client = &spans[i]
					case trace.SpanKindServer:
						server = &spans[i]
					}
				}
				if client == nil || server == nil {
					t.Fatalf("%s: spans %+v", op, spans)
				}
				if server.Parent.SpanID() != client.SpanContext.SpanID() || server.SpanContext.TraceID() != client.SpanContext.TraceID() {
					t.Errorf("%s: the server's span is not the client's child: client %v, server %v (parent %v)", op, client.SpanContext, server.SpanContext, server.Parent)
				}
				if server.StartTime.Before(client.StartTime) || server.EndTime.After(client.EndTime) || server.EndTime.Before(server.StartTime) {
					t.Errorf("%s: the server's span (%v to %v) is not within the client's (%v to %v)", op, server.StartTime, server.EndTime, client.StartTime, client.EndTime)
				}
				if server.Name != "tensorrpc/"+op || attr(server.Attributes, "tensorrpc.plane") != plane || attr(server.Attributes, "tensorrpc.key") == "" {
					t.Errorf("%s: server span %q, attributes %v", op, server.Name, server.Attributes)
				}
			}
		})
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// histogramCounts sums the counts of histogram name's points by operation.
func histogramCounts(t *testing.T, rm metricdata.ResourceMetrics, name string) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			h, ok := m.Data.(metricdata.Histogram[float64])
			if !ok {
				t.Fatalf("%s is a %T", name, m.Data)
			}
			for _, p := range h.DataPoints {
				op, _ := p.Attributes.Value("tensorrpc.operation")
				out[op.AsString()] += p.Count
			}
		}
	}
	return out
}

// TestDurationCountsEveryCall: the duration histograms count every call
// of a mixed run of 1,000 Fetches, Sends and Calls exactly, on both sides.
func TestDurationCountsEveryCall(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	_, c := pair(t, rpc.TransportTCP, tensorrpcotel.Interceptor(tensorrpcotel.WithMeterProvider(mp), tensorrpcotel.WithSizeHistograms()))
	ctx := context.Background()
	want := map[string]uint64{}
	for i := range 1000 {
		switch i % 3 {
		case 0:
			got, err := c.Fetch(ctx, "w")
			if err != nil {
				t.Fatal(err)
			}
			got.Release()
			want["Fetch"]++
		case 1:
			if err := c.Send(ctx, fmt.Sprint("s", i%7), tensor(4<<10)); err != nil {
				t.Fatal(err)
			}
			want["Send"]++
		case 2:
			reply, err := c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{tensor(4 << 10)}})
			if err != nil {
				t.Fatal(err)
			}
			reply.Release()
			want["Call"]++
		}
	}
	// A failed call counts too, with its status code.
	if _, err := c.Fetch(ctx, "missing"); err == nil {
		t.Fatal("Fetch of a missing key succeeded")
	}
	want["Fetch"]++
	// The server records a call once its answer has gone: the last one
	// may still be on its way when the client has its answer.
	var rm metricdata.ResourceMetrics
	eventually(t, "the server's last call recorded", func() bool {
		if err := reader.Collect(ctx, &rm); err != nil {
			t.Fatal(err)
		}
		n := uint64(0)
		for _, c := range histogramCounts(t, rm, "rpc.server.duration") {
			n += c
		}
		return n >= 1001
	})
	for _, name := range []string{"rpc.client.duration", "rpc.server.duration", "rpc.client.request.size", "rpc.server.response.size"} {
		got := histogramCounts(t, rm, name)
		for op, n := range want {
			if got[op] != n {
				t.Errorf("%s counts %d %ss, want %d", name, got[op], op, n)
			}
		}
	}
	// The byte counters sum what the calls carried: 4 KiB per Send and per
	// Call each way, 64 KiB per Fetch answered.
	wantBytes := map[string]map[string]int64{
		"request.bytes":  {"Send": int64(want["Send"]) * 4 << 10, "Call": int64(want["Call"]) * 4 << 10, "Fetch": 0},
		"response.bytes": {"Send": 0, "Call": int64(want["Call"]) * 4 << 10, "Fetch": int64(want["Fetch"]-1) * 64 << 10},
	}
	for _, side := range []string{"client", "server"} {
		for what, byOp := range wantBytes {
			name := "tensorrpc." + side + "." + what
			got := sumsByOp(t, rm, name)
			for op, n := range byOp {
				if got[op] != n {
					t.Errorf("%s: %d for %s, want %d", name, got[op], op, n)
				}
			}
		}
	}
}

// sumsByOp sums the points of the int64 sum name by operation.
func sumsByOp(t *testing.T, rm metricdata.ResourceMetrics, name string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	found := false
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			found = true
			s, ok := m.Data.(metricdata.Sum[int64])
			if !ok || !s.IsMonotonic {
				t.Fatalf("%s is a %T", name, m.Data)
			}
			for _, p := range s.DataPoints {
				op, _ := p.Attributes.Value("tensorrpc.operation")
				out[op.AsString()] += p.Value
			}
		}
	}
	if !found {
		t.Errorf("no metric %s", name)
	}
	return out
}

// TestObserveStats: a Client's counters are exported as observable
// counters, and stop unregisters them.
func TestObserveStats(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	_, c := pair(t, rpc.TransportTCP, tensorrpcotel.Interceptor(tensorrpcotel.WithMeterProvider(mp)))
	stop, err := tensorrpcotel.ObserveStats("client", c.Stats, tensorrpcotel.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 5 {
		got, err := c.Fetch(ctx, "w")
		if err != nil {
			t.Fatal(err)
		}
		got.Release()
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	st := c.Stats()
	found := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if s, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, p := range s.DataPoints {
					if r, _ := p.Attributes.Value("tensorrpc.role"); r.AsString() == "client" {
						found[m.Name] = p.Value
					}
				}
			}
		}
	}
	if found["tensorrpc.transfers"] != st.Transfers || found["tensorrpc.data_plane"] != st.DataPlaneBytes || st.Transfers < 5 {
		t.Errorf("observed %v, stats %+v", found, st)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkFetch4KiB: 4 KiB Fetches over tcp without telemetry and with
// it (spans and metrics to the SDK, its batching span processor with a
// no-op exporter; all spans sampled, and one in a hundred), the
// interceptor given as WithInlineInterceptors and, for comparison, as
// WithInterceptors; and, to tell the costs apart, an inline interceptor
// that does nothing but call next, and telemetry with metrics only (a
// no-op TracerProvider: no span, no trace context on the wire), also on
// one side only ("metrics-client", "metrics-server"). The cases
// take turns, 200 calls at a time and each turn in another order
// (shuffled), so that a noisy machine slows them alike; each reports its p50, its ratio to the p50 without telemetry,
// the median over the turns of its p50 against off's in the same turn
// ("/off-paired"), and the process's CPU time per call (both sides: user
// and system). Each case has benchClients clients, a turn's calls made
// by one of them in turn.
// Server and client share the process; BenchmarkFetch4KiBTwoProcesses
// puts the servers in a process of their own.
func BenchmarkFetch4KiB(b *testing.B) { benchFetch4KiB(b, nil) }

// BenchmarkFetch4KiBTwoProcesses is BenchmarkFetch4KiB with the servers in
// a child process (this test binary again, serveBench), as a
// service and its client are deployed: the CPU time reported is the
// client's alone.
func BenchmarkFetch4KiBTwoProcesses(b *testing.B) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), benchChildEnv+"=1")
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() {
		in.Close() // the child stops its servers and exits
		cmd.Wait()
	}()
	addrs := map[string]string{}
	sc := bufio.NewScanner(out)
	for len(addrs) < len(benchModes) && sc.Scan() {
		if name, addr, ok := strings.Cut(sc.Text(), " "); ok {
			addrs[name] = addr
		}
	}
	if len(addrs) < len(benchModes) {
		b.Fatalf("the servers' process gave %d addresses, want %d", len(addrs), len(benchModes))
	}
	benchFetch4KiB(b, addrs)
}

// benchClients is how many clients (sessions, connections) each case
// has, a turn using one in turn: two connections set up alike differ
// by up to 7% in p50 for as long as they last (the 2-core VM, two
// processes: a second case without telemetry, against the first, 0.93-
// 1.01), which taking turns between connections averages out.
const benchClients = 3

// benchChildEnv makes the test binary serveBench.
const benchChildEnv = "TENSORRPC_OTEL_BENCH_SERVERS"

// serveBench is BenchmarkFetch4KiBTwoProcesses's child (this test binary
// run with benchChildEnv set): it serves each case's server, prints
// "case address" lines, and stops when its stdin closes.
func serveBench() {
	var cleanups []func()
	defer func() {
		for _, f := range slices.Backward(cleanups) {
			f()
		}
	}()
	ic := benchInterceptors(func(f func()) { cleanups = append(cleanups, f) })
	for _, m := range benchModes {
		srv, err := rpc.NewServer(append(m.server(ic), small())...)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return
		}
		ctx := context.Background()
		st, _ := srv.NewTensor(ctx, zerocopy.Uint8, []int64{4 << 10})
		srv.Publish(ctx, "small", st)
		st.Release()
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return
		}
		go srv.Serve(lis)
		cleanups = append(cleanups, srv.Stop)
		fmt.Println(m.name, lis.Addr().String())
	}
	io.Copy(io.Discard, os.Stdin)
}

// benchMode is one of BenchmarkFetch4KiB's cases: the interceptor both
// sides have (of the process's, benchIcepts), inline or not.
type benchMode struct {
	name string
	i    func(ic benchIcepts) rpc.Interceptor
	inl  bool
	side string // "client" or "server": that side alone has it
}

var benchModes = []benchMode{
	{"off", func(benchIcepts) rpc.Interceptor { return nil }, false, ""},
	{"nothing", func(ic benchIcepts) rpc.Interceptor { return ic.nothing }, true, ""},
	{"metrics-only", func(ic benchIcepts) rpc.Interceptor { return ic.metricsOnly }, true, ""},
	{"sampled-1pct", func(ic benchIcepts) rpc.Interceptor { return ic.some }, true, ""},
	{"sampled-all", func(ic benchIcepts) rpc.Interceptor { return ic.all }, true, ""},
	{"sampled-all-not-inline", func(ic benchIcepts) rpc.Interceptor { return ic.all }, false, ""},
	{"metrics-client", func(ic benchIcepts) rpc.Interceptor { return ic.metricsOnly }, true, "client"},
	{"metrics-server", func(ic benchIcepts) rpc.Interceptor { return ic.metricsOnly }, true, "server"},
	{"sampled-1pct-client", func(ic benchIcepts) rpc.Interceptor { return ic.some }, true, "client"},
	{"sampled-1pct-server", func(ic benchIcepts) rpc.Interceptor { return ic.some }, true, "server"},
}

// option gives both sides m's interceptor (nil: none).
func (m benchMode) option(ic benchIcepts) rpc.Option {
	switch i := m.i(ic); {
	case i == nil:
		return nil
	case m.inl:
		return rpc.WithInlineInterceptors(i)
	default:
		return rpc.WithInterceptors(i)
	}
}

func (m benchMode) server(ic benchIcepts) []rpc.ServerOption {
	if m.side == "client" {
		return nil
	}
	if o := m.option(ic); o != nil {
		return []rpc.ServerOption{o}
	}
	return nil
}

func (m benchMode) dial(ic benchIcepts) []rpc.DialOption {
	if m.side == "server" {
		return nil
	}
	if o := m.option(ic); o != nil {
		return []rpc.DialOption{o}
	}
	return nil
}

// benchIcepts are the interceptors of one process's cases.
type benchIcepts struct{ nothing, metricsOnly, some, all rpc.Interceptor }

// benchInterceptors makes a process's interceptors; cleanup takes what
// ends their providers.
func benchInterceptors(cleanup func(func())) benchIcepts {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	cleanup(func() { mp.Shutdown(context.Background()) })
	tracing := func(ratio float64) rpc.Interceptor {
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()),
			sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))))
		cleanup(func() { tp.Shutdown(context.Background()) })
		return tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tp), tensorrpcotel.WithMeterProvider(mp))
	}
	return benchIcepts{
		nothing:     func(ctx context.Context, _ *rpc.CallInfo, next func(context.Context) error) error { return next(ctx) },
		metricsOnly: tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tracenoop.NewTracerProvider()), tensorrpcotel.WithMeterProvider(mp)),
		some:        tracing(0.01),
		all:         tracing(1),
	}
}

// benchFetch4KiB runs the cases, against servers of this process (addrs
// nil) or at addrs (by case).
func benchFetch4KiB(b *testing.B, addrs map[string]string) {
	ic := benchInterceptors(b.Cleanup)
	type mode struct {
		name string
		cs   []*rpc.Client // benchClients of them, a turn's calls by one
		lat  []time.Duration
		cpu  time.Duration
		turn []float64 // each turn's p50, µs
	}
	var modes []*mode
	ctx := context.Background()
	for _, m := range benchModes {
		var cs []*rpc.Client
		for range benchClients {
			var c *rpc.Client
			if addrs == nil {
				var srv *rpc.Server
				srv, c = pairWith(b, rpc.TransportTCP, m.server(ic), m.dial(ic))
				t, _ := srv.NewTensor(ctx, zerocopy.Uint8, []int64{4 << 10})
				srv.Publish(ctx, "small", t)
				t.Release()
			} else {
				var err error
				c, err = rpc.Dial(ctx, addrs[m.name], append(m.dial(ic), rpc.WithTransportCredentials(insecure.NewCredentials()),
					rpc.WithTransports(rpc.TransportTCP), small())...)
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { c.Close() })
			}
			cs = append(cs, c)
		}
		modes = append(modes, &mode{name: m.name, cs: cs})
	}
	const turn = 200
	b.ResetTimer()
	// Each turn takes the cases in another order, shuffled: a case runs
	// while the one before it winds down (its pollers, its garbage), and
	// in a fixed order, even rotated, each case would always follow the
	// same one (a second case without telemetry, last in the list, had a
	// p50 1.12-1.19 times the first's, in every run).
	rng := rand.New(rand.NewPCG(1, 2))
	order := make([]int, len(modes))
	for done, r := 0, 0; done < b.N; done, r = done+turn, r+1 {
		for i := range order {
			order[i] = i
		}
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, i := range order {
			m := modes[i]
			c0 := cpuTime()
			from := len(m.lat)
			for range min(turn, b.N-done) {
				t0 := time.Now()
				got, err := m.cs[r%len(m.cs)].Fetch(ctx, "small")
				if err != nil {
					b.Fatal(err)
				}
				got.Release()
				m.lat = append(m.lat, time.Since(t0))
			}
			m.cpu += cpuTime() - c0
			m.turn = append(m.turn, p50us(slices.Clone(m.lat[from:])))
		}
	}
	b.StopTimer()
	off := modes[0]
	for _, m := range modes {
		if m.name == "off" {
			off = m
		}
	}
	offP50 := p50us(off.lat)
	for _, m := range modes {
		p50 := p50us(m.lat)
		if os.Getenv("PCT") != "" {
			n := len(m.lat)
			fmt.Fprintf(os.Stderr, "%-24s p10 %.1f p25 %.1f p50 %.1f p75 %.1f p90 %.1f\n", m.name, us(m.lat[n/10]), us(m.lat[n/4]), us(m.lat[n/2]), us(m.lat[3*n/4]), us(m.lat[9*n/10]))
		}
		b.ReportMetric(p50, m.name+"-p50-µs")
		b.ReportMetric(float64(m.cpu.Nanoseconds())/1e3/float64(len(m.lat)), m.name+"-cpu-µs")
		if m == off {
			continue
		}
		b.ReportMetric(p50/offP50, m.name+"/off")
		// Paired: each turn's p50 against off's in the same turn (the
		// cases of a turn run within milliseconds of each other), the
		// median over the turns; a noisy minute then weighs on both
		// sides of a ratio, not on one case's pooled p50.
		ratios := make([]float64, len(m.turn))
		for i := range m.turn {
			ratios[i] = m.turn[i] / off.turn[i]
		}
		slices.Sort(ratios)
		b.ReportMetric(ratios[len(ratios)/2], m.name+"/off-paired")
	}
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// p50us is the median of ds, in µs; it sorts ds.
func p50us(ds []time.Duration) float64 {
	slices.Sort(ds)
	return float64(ds[len(ds)/2].Nanoseconds()) / 1e3
}

// cpuTime is the CPU time this process has used (user and system).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestManyMethodsAreBounded: past the kinds it keeps (1,024), calls of
// methods not seen before are recorded as rpc.method "_OTHER", so that
// a server called with ever new method names does not grow its metrics
// without bound; every call is still counted.
func TestManyMethodsAreBounded(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	tel := tensorrpcotel.Interceptor(tensorrpcotel.WithMeterProvider(mp))
	// Calls of methods the server does not have (Unimplemented), through a
	// server that records them.
	_, c := pairWith(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithInlineInterceptors(tel)}, nil)
	one, err := zerocopy.New(zerocopy.Uint8, []int64{1}, make([]byte, 1))
	if err != nil {
		t.Fatal(err)
	}
	const calls = 1500
	for i := range calls {
		if _, err := c.Call(context.Background(), fmt.Sprint("m", i), &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(one)}}); status.Code(err) != grpccodes.Unimplemented {
			t.Fatalf("call %d: %v, want Unimplemented", i, err)
		}
	}
	// The server records a call once its answer has gone: the last ones
	// may still be on their way.
	var rm metricdata.ResourceMetrics
	var methods map[string]uint64
	var total uint64
	eventually(t, "every call recorded", func() bool {
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		methods, total = map[string]uint64{}, 0
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if h, ok := m.Data.(metricdata.Histogram[float64]); ok && m.Name == "rpc.server.duration" {
					for _, p := range h.DataPoints {
						v, _ := p.Attributes.Value("rpc.method")
						methods[v.AsString()] += p.Count
						total += p.Count
					}
				}
			}
		}
		return total >= calls
	})
	if total != calls || len(methods) != 1025 || methods["_OTHER"] != calls-1024 {
		t.Errorf("%d calls in %d methods, %d of them _OTHER; want %d in 1025, %d _OTHER", total, len(methods), methods["_OTHER"], calls, calls-1024)
	}
	if got := sumsByOp(t, rm, "tensorrpc.server.request.bytes")["Call"]; got != calls {
		t.Errorf("request bytes %d, want %d", got, calls)
	}
}

// TestNoopTracerCarriesTheContext: with a no-op TracerProvider (metrics
// only) the interceptor starts no span, yet the caller's trace context
// and baggage still reach the handler on every plane, as the no-op
// tracer's spans would carry them, and the call is still counted.
func TestNoopTracerCarriesTheContext(t *testing.T) {
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(plane, func(t *testing.T) {
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			defer mp.Shutdown(context.Background())
			srv, c := pair(t, plane, tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tracenoop.NewTracerProvider()), tensorrpcotel.WithMeterProvider(mp)))
			type seen struct {
				sc     trace.SpanContext
				tenant string
			}
			got := make(chan seen, 1)
			srv.Handle("look", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
				got <- seen{trace.SpanContextFromContext(ctx), baggage.FromContext(ctx).Member("tenant").Value()}
				return &rpc.Message{}, nil
			}, rpc.Inline())
			// The caller's span, from a tracer of its own.
			outer := sdktrace.NewTracerProvider()
			defer outer.Shutdown(context.Background())
			ctx, span := outer.Tracer("app").Start(context.Background(), "app")
			defer span.End()
			m, err := baggage.NewMember("tenant", "a")
			if err != nil {
				t.Fatal(err)
			}
			b, err := baggage.New(m)
			if err != nil {
				t.Fatal(err)
			}
			reply, err := c.Call(baggage.ContextWithBaggage(ctx, b), "look", &rpc.Message{})
			if err != nil {
				t.Fatal(err)
			}
			reply.Release()
			s := <-got
			if want := span.SpanContext(); s.sc.TraceID() != want.TraceID() || s.sc.SpanID() != want.SpanID() || !s.sc.IsRemote() {
				t.Errorf("the handler's span context %v, want the caller's %v, remote", s.sc, want)
			}
			if s.tenant != "a" {
				t.Errorf("the handler's baggage tenant = %q, want a", s.tenant)
			}
			var rm metricdata.ResourceMetrics
			eventually(t, "both sides' durations", func() bool {
				if err := reader.Collect(context.Background(), &rm); err != nil {
					t.Fatal(err)
				}
				return histogramCounts(t, rm, "rpc.client.duration")["Call"] == 1 && histogramCounts(t, rm, "rpc.server.duration")["Call"] == 1
			})
		})
	}
}
