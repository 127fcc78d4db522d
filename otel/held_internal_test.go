package tensorrpcotel

import (
	"context"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// durations is how many calls rpc.client.duration counted so far.
func durations(t *testing.T, r sdkmetric.Reader) uint64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "rpc.client.duration" {
				continue
			}
			for _, p := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				n += p.Count
			}
		}
	}
	return n
}

// calls runs n client Fetches through tel, each doing nothing.
func calls(tel rpc.Interceptor, n int) {
	next := func(context.Context) error { return nil }
	for range n {
		tel(context.Background(), &rpc.CallInfo{Op: rpc.OpFetch, Client: true, Name: "k", Transport: rpc.TransportTCP}, next)
	}
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestHeldRecordingsAreCollected: a call's duration, held back, is in
// the very next collection (the byte counters' callback records what is
// held first), and without that callback (a view drops the byte
// counters, so that the provider never calls it) heldFor later.
func TestHeldRecordingsAreCollected(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	tel := Interceptor(WithMeterProvider(mp), WithTracerProvider(tracenoop.NewTracerProvider()))
	var want uint64
	for _, n := range []int{1, 99, maxHeld - 1, maxHeld, 3 * maxHeld} {
		calls(tel, n)
		want += uint64(n) // cumulative
		if got := durations(t, reader); got != want {
			t.Fatalf("after %d more calls, rpc.client.duration counts %d calls, want %d", n, got, want)
		}
	}

	dropped := sdkmetric.NewManualReader()
	mp2 := sdkmetric.NewMeterProvider(sdkmetric.WithReader(dropped), sdkmetric.WithView(sdkmetric.NewView(
		sdkmetric.Instrument{Name: "tensorrpc.*"}, sdkmetric.Stream{Aggregation: sdkmetric.AggregationDrop{}})))
	defer mp2.Shutdown(context.Background())
	tel = Interceptor(WithMeterProvider(mp2), WithTracerProvider(tracenoop.NewTracerProvider()))
	calls(tel, 10)
	waitFor(t, "the held durations recorded without the callback", func() bool { return durations(t, dropped) == 10 })
}

// TestFullHeldSetIsRecorded: maxHeld durations held back are recorded
// without a collection or the timer (here an hour).
func TestFullHeldSetIsRecorded(t *testing.T) {
	defer func(d time.Duration) { heldFor = d }(heldFor)
	heldFor = time.Hour
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader), sdkmetric.WithView(sdkmetric.NewView(
		sdkmetric.Instrument{Name: "tensorrpc.*"}, sdkmetric.Stream{Aggregation: sdkmetric.AggregationDrop{}})))
	defer mp.Shutdown(context.Background())
	tel := Interceptor(WithMeterProvider(mp), WithTracerProvider(tracenoop.NewTracerProvider()))
	calls(tel, maxHeld-1)
	if got := durations(t, reader); got != 0 {
		t.Fatalf("%d of %d held durations recorded before the set was full", got, maxHeld-1)
	}
	calls(tel, 1)
	waitFor(t, "a full set recorded", func() bool { return durations(t, reader) == maxHeld })
}
