package tensorrpcotel

import (
	"context"
	"maps"
	"sort"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
)

// TestInjectW3CAsThePropagators: injectW3C writes what
// propagation.TraceContext (and Baggage) write, for span contexts valid
// and not, sampled and not, with trace state, flags past the two the
// specification defines, and baggage.
func TestInjectW3CAsThePropagators(t *testing.T) {
	ts, err := trace.ParseTraceState("vendor=abc,other=x1")
	if err != nil {
		t.Fatal(err)
	}
	tid := trace.TraceID{0x0a, 0xf7, 0x65, 0x19, 0x16, 0xcd, 0x43, 0xdd, 0x84, 0x48, 0xeb, 0x21, 0x1c, 0x80, 0x31, 0x9c}
	sid := trace.SpanID{0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31}
	scs := map[string]trace.SpanContext{
		"invalid":      {},
		"unsampled":    trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}),
		"sampled":      trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}),
		"random":       trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled | trace.FlagsRandom}),
		"other flags":  trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: 0xff}),
		"trace state":  trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts}),
		"trace id max": trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, SpanID: trace.SpanID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}}),
	}
	m, err := baggage.NewMember("user", "ann")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(m)
	if err != nil {
		t.Fatal(err)
	}
	both := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	for name, sc := range scs {
		for _, withBaggage := range []bool{false, true} {
			ctx := trace.ContextWithSpanContext(context.Background(), sc)
			if withBaggage {
				ctx = baggage.ContextWithBaggage(ctx, bag)
			}
			for _, p := range []struct {
				props      propagation.TextMapPropagator
				baggageToo bool
			}{{propagation.TraceContext{}, false}, {both, true}} {
				want, got := propagation.MapCarrier{}, propagation.MapCarrier{}
				p.props.Inject(ctx, want)
				injectW3C(ctx, sc, got, p.baggageToo)
				if !maps.Equal(got, want) {
					t.Errorf("%s (baggage in ctx %v, propagating baggage %v): injectW3C wrote %v, the propagators %v", name, withBaggage, p.baggageToo, got, want)
				}
			}
		}
	}
}

// TestConfigTakesW3CWay: calls inject with injectW3C only when the
// propagator is W3C trace context (the default, with baggage, or
// propagation.TraceContext given), and through the propagator otherwise.
func TestConfigTakesW3CWay(t *testing.T) {
	for _, c := range []struct {
		name         string
		opts         []Option
		w3c, baggage bool
	}{
		{"default", nil, true, true},
		{"TraceContext", []Option{WithPropagators(propagation.TraceContext{})}, true, false},
		{"Baggage alone", []Option{WithPropagators(propagation.Baggage{})}, false, false},
		{"a composite", []Option{WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}))}, false, false},
	} {
		if got := newConfig(c.opts); got.w3c != c.w3c || got.baggage != c.baggage {
			t.Errorf("%s: w3c %v baggage %v, want %v %v", c.name, got.w3c, got.baggage, c.w3c, c.baggage)
		}
	}
}

// TestExtractW3CAsThePropagators: extractW3C finds in incoming metadata
// the span context and baggage the propagators find, for headers valid,
// malformed, upper-case, with trace state and baggage, and none.
func TestExtractW3CAsThePropagators(t *testing.T) {
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	mds := map[string]metadata.MD{
		"none":            {},
		"traceparent":     {"traceparent": {tp}},
		"two values":      {"traceparent": {tp, "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}},
		"trace state":     {"traceparent": {tp}, "tracestate": {"vendor=abc"}},
		"bad trace state": {"traceparent": {tp}, "tracestate": {"=="}},
		"upper case":      {"traceparent": {"00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"}},
		"version ff":      {"traceparent": {"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}},
		"future version":  {"traceparent": {"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-09-extra"}},
		"zero trace id":   {"traceparent": {"00-00000000000000000000000000000000-b7ad6b7169203331-01"}},
		"short":           {"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b71692033-01"}},
		"baggage":         {"traceparent": {tp}, "baggage": {"user=ann,team=ml"}},
		"baggage alone":   {"baggage": {"user=ann"}},
		"bad baggage":     {"baggage": {"=;="}},
	}
	both := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	for name, md := range mds {
		for _, p := range []struct {
			props      propagation.TextMapPropagator
			baggageToo bool
		}{{propagation.TraceContext{}, false}, {both, true}} {
			want := p.props.Extract(context.Background(), metadataCarrier(md))
			got := extractW3C(context.Background(), md, p.baggageToo)
			if ws, gs := trace.SpanContextFromContext(want), trace.SpanContextFromContext(got); !ws.Equal(gs) || ws.IsRemote() != gs.IsRemote() {
				t.Errorf("%s (baggage %v): extractW3C found %v, the propagators %v", name, p.baggageToo, gs, ws)
			}
			if wb, gb := sortedBaggage(want), sortedBaggage(got); wb != gb {
				t.Errorf("%s (baggage %v): extractW3C found baggage %q, the propagators %q", name, p.baggageToo, gb, wb)
			}
		}
	}
}

// sortedBaggage is the context's baggage members in sorted order: a
// baggage's String follows its map's order, which changes from call to
// call.
func sortedBaggage(ctx context.Context) string {
	var ms []string
	for _, m := range baggage.FromContext(ctx).Members() {
		ms = append(ms, m.String())
	}
	sort.Strings(ms)
	return strings.Join(ms, ",")
}
