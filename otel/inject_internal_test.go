package tensorrpcotel

import (
	"context"
	"maps"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
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
