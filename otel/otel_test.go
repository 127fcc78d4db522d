package tensorrpcotel_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	tensorrpcotel "github.com/tensorrpc/tensorrpc/otel"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

func small() rpc.Option {
	return rpc.WithPoolOptions(mempool.WithArenaSize(4<<20), mempool.WithLimit(64<<20))
}

// pair starts a server and dials it over plane, both with tel (none when
// nil), and
// publishes "w" (64 KiB) and handles "echo".
func pair(t testing.TB, plane string, tel rpc.Interceptor) (*rpc.Server, *rpc.Client) {
	t.Helper()
	var so []rpc.ServerOption
	var do []rpc.DialOption
	if tel != nil {
		so, do = []rpc.ServerOption{rpc.WithInterceptors(tel)}, []rpc.DialOption{rpc.WithInterceptors(tel)}
	}
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
		t.Run(plane, func(t *testing.T) {
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			defer tp.Shutdown(context.Background())
			_, c := pair(t, plane, tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tp)))
			reply, err := c.Call(context.Background(), "echo", &rpc.Message{Tensors: []*rpc.Tensor{tensor(1 << 20)}})
			if err != nil {
				t.Fatal(err)
			}
			reply.Release()
			spans := exp.GetSpans()
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
				for key, want := range map[string]string{"rpc.system": "tensorrpc", "rpc.method": "echo", "tensorrpc.operation": "Call", "tensorrpc.plane": plane, "rpc.grpc.status_code": "0", "tensorrpc.request.bytes": "1048576"} {
					if got := attr(s.Attributes, key); got != want {
						t.Errorf("%s span: %s = %q, want %q", s.SpanKind, key, got, want)
					}
				}
				if s.Name != "tensorrpc/Call echo" {
					t.Errorf("span name %q", s.Name)
				}
			}
		})
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
	_, c := pair(t, rpc.TransportTCP, tensorrpcotel.Interceptor(tensorrpcotel.WithMeterProvider(mp)))
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
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"rpc.client.duration", "rpc.server.duration", "rpc.client.request.size", "rpc.server.response.size"} {
		got := histogramCounts(t, rm, name)
		for op, n := range want {
			if got[op] != n {
				t.Errorf("%s counts %d %ss, want %d", name, got[op], op, n)
			}
		}
	}
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

// BenchmarkFetch4KiB: a 4 KiB Fetch over tcp without and with telemetry
// (spans and metrics to the SDK with no exporter doing I/O).
func BenchmarkFetch4KiB(b *testing.B) {
	for _, on := range []bool{false, true} {
		b.Run(fmt.Sprintf("telemetry=%v", on), func(b *testing.B) {
			var tel rpc.Interceptor // off: no interceptor at all
			if on {
				tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewNoopExporter()))
				mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
				defer tp.Shutdown(context.Background())
				defer mp.Shutdown(context.Background())
				tel = tensorrpcotel.Interceptor(tensorrpcotel.WithTracerProvider(tp), tensorrpcotel.WithMeterProvider(mp))
			}
			srv, c := pair(b, rpc.TransportTCP, tel)
			ctx := context.Background()
			t, _ := srv.NewTensor(ctx, zerocopy.Uint8, []int64{4 << 10})
			srv.Publish(ctx, "small", t)
			t.Release()
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				got, err := c.Fetch(ctx, "small")
				if err != nil {
					b.Fatal(err)
				}
				got.Release()
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
		})
	}
}
