// Package tensorrpcotel records OpenTelemetry traces and metrics for every
// tensorrpc call: a span per Fetch, Send and Call on each side, with W3C
// trace context carried in the call's metadata on every data plane (so
// that the client's and the server's spans share a trace), and metrics
// after OpenTelemetry's RPC semantic conventions. It is a module of its
// own, as grpc-go keeps its OpenTelemetry plug-in apart, so that the
// library does not depend on OpenTelemetry.
//
//	tel := tensorrpcotel.Interceptor() // the global TracerProvider, MeterProvider and propagator
//	srv, _ := rpc.NewServer(rpc.WithInterceptors(tel))
//	c, _ := rpc.Dial(ctx, addr, creds, rpc.WithInterceptors(tel))
//	stop, _ := tensorrpcotel.ObserveStats("client", c.Stats) // copies, leases, bytes as counters
//
// Spans are named "tensorrpc/Fetch", "tensorrpc/Send" and "tensorrpc/Call
// <method>" (keys stay out of span names: they can be many), client spans
// of kind Client, server spans of kind Server. Attributes: rpc.system
// ("tensorrpc"), rpc.service ("tensorrpc"), rpc.method (the operation, or
// the Call's method), rpc.grpc.status_code, server.address (client side),
// and tensorrpc.operation, tensorrpc.key (Fetch and Send), tensorrpc.plane,
// tensorrpc.path, tensorrpc.request.bytes, tensorrpc.response.bytes, and
// on the client how the bytes moved (tensorrpc.moved, tensorrpc.lanes,
// tensorrpc.copies; see rpc.CallInfo).
//
// Metrics (histograms, by rpc.method, tensorrpc.operation, tensorrpc.plane
// and rpc.grpc.status_code): rpc.client.duration and rpc.server.duration
// (ms), rpc.client.request.size, rpc.client.response.size,
// rpc.server.request.size and rpc.server.response.size (By, the tensor
// bytes).
package tensorrpcotel

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// ScopeName is the instrumentation scope of the tracer and meter.
const ScopeName = "github.com/tensorrpc/tensorrpc/otel"

type config struct {
	tp    trace.TracerProvider
	mp    metric.MeterProvider
	props propagation.TextMapPropagator
}

// Option configures Interceptor and ObserveStats.
type Option func(*config)

// WithTracerProvider sets the TracerProvider (default: otel's global one).
func WithTracerProvider(tp trace.TracerProvider) Option { return func(c *config) { c.tp = tp } }

// WithMeterProvider sets the MeterProvider (default: otel's global one).
func WithMeterProvider(mp metric.MeterProvider) Option { return func(c *config) { c.mp = mp } }

// WithPropagators sets how trace context travels in the call's metadata
// (default: otel's global propagator, which is W3C trace context once
// otel.SetTextMapPropagator sets it; tensorrpcotel uses W3C trace context
// and baggage when the global one is still the no-op default).
func WithPropagators(p propagation.TextMapPropagator) Option {
	return func(c *config) { c.props = p }
}

func newConfig(opts []Option) *config {
	c := &config{tp: otel.GetTracerProvider(), mp: otel.GetMeterProvider(), props: otel.GetTextMapPropagator()}
	if len(c.props.Fields()) == 0 {
		c.props = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// instruments are one side's histograms.
type instruments struct {
	duration, reqSize, respSize metric.Float64Histogram
}

func newInstruments(m metric.Meter, side string) (instruments, error) {
	var in instruments
	var err error
	if in.duration, err = m.Float64Histogram("rpc."+side+".duration", metric.WithUnit("ms"),
		metric.WithDescription("tensorrpc calls (Fetch, Send, Call): duration, measured by the "+side)); err != nil {
		return in, err
	}
	if in.reqSize, err = m.Float64Histogram("rpc."+side+".request.size", metric.WithUnit("By"),
		metric.WithDescription("tensor bytes a call's request carried")); err != nil {
		return in, err
	}
	if in.respSize, err = m.Float64Histogram("rpc."+side+".response.size", metric.WithUnit("By"),
		metric.WithDescription("tensor bytes a call's answer carried")); err != nil {
		return in, err
	}
	return in, nil
}

// Interceptor returns an rpc.Interceptor that records a span and metrics
// for every call, on the client (rpc.Dial's WithInterceptors) and on the
// server (NewServer's), telling the sides apart by CallInfo.Client. It
// panics only if the MeterProvider refuses the instruments' names, which
// a conforming provider does not.
func Interceptor(opts ...Option) rpc.Interceptor {
	c := newConfig(opts)
	tracer := c.tp.Tracer(ScopeName)
	meter := c.mp.Meter(ScopeName)
	client, err := newInstruments(meter, "client")
	if err != nil {
		panic(fmt.Sprintf("tensorrpcotel: %v", err))
	}
	server, err := newInstruments(meter, "server")
	if err != nil {
		panic(fmt.Sprintf("tensorrpcotel: %v", err))
	}
	var sets attrSets
	return func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		method := string(info.Op)
		name := "tensorrpc/" + method
		if info.Op == rpc.OpCall {
			method = info.Name
			name = "tensorrpc/Call " + info.Name
		}
		attrs := []attribute.KeyValue{
			attribute.String("rpc.system", "tensorrpc"),
			attribute.String("rpc.service", "tensorrpc"),
			attribute.String("rpc.method", method),
			attribute.String("tensorrpc.operation", string(info.Op)),
			attribute.String("tensorrpc.plane", info.Transport),
			attribute.String("tensorrpc.path", info.Path),
		}
		in, kind := server, trace.SpanKindServer
		if info.Client {
			in, kind = client, trace.SpanKindClient
		} else if md, ok := metadata.FromIncomingContext(ctx); ok {
			// The client's span is the parent of the server's: its context
			// came in the call's metadata.
			ctx = c.props.Extract(ctx, metadataCarrier(md))
		}
		spanAttrs := append([]attribute.KeyValue(nil), attrs...)
		if info.Op != rpc.OpCall {
			spanAttrs = append(spanAttrs, attribute.String("tensorrpc.key", info.Name))
		}
		if info.Client {
			spanAttrs = append(spanAttrs, attribute.String("server.address", info.Peer))
		}
		ctx, span := tracer.Start(ctx, name, trace.WithSpanKind(kind), trace.WithAttributes(spanAttrs...))
		if info.Client {
			var kv appendCarrier
			c.props.Inject(ctx, &kv)
			if len(kv) > 0 {
				ctx = metadata.AppendToOutgoingContext(ctx, kv...)
			}
		}
		start := time.Now()
		err := next(ctx)
		ms := float64(time.Since(start).Nanoseconds()) / 1e6
		code := status.Code(err)
		span.SetAttributes(
			attribute.Int("rpc.grpc.status_code", int(code)),
			attribute.Int64("tensorrpc.request.bytes", info.RequestBytes),
			attribute.Int64("tensorrpc.response.bytes", info.ResponseBytes),
		)
		if info.Moved != "" {
			span.SetAttributes(attribute.String("tensorrpc.moved", info.Moved), attribute.Int("tensorrpc.lanes", info.Lanes), attribute.Int("tensorrpc.copies", info.Copies))
		}
		if err != nil {
			span.SetStatus(codes.Error, status.Convert(err).Message())
		}
		span.End()
		set := metric.WithAttributeSet(sets.of(setKey{info.Op, method, info.Transport, info.Path, code}, func() attribute.Set {
			return attribute.NewSet(append(attrs, attribute.Int("rpc.grpc.status_code", int(code)))...)
		}))
		in.duration.Record(ctx, ms, set)
		in.reqSize.Record(ctx, float64(info.RequestBytes), set)
		in.respSize.Record(ctx, float64(info.ResponseBytes), set)
		return err
	}
}

// setKey names a metric attribute set: what the metrics are broken down
// by.
type setKey struct {
	op                  rpc.Operation
	method, plane, path string
	code                grpccodes.Code
}

// attrSets keeps the attribute sets made so far: making one sorts and
// allocates, which a call need not pay each time. Methods are few; should
// a server see very many, past maxSets new sets are made and not kept.
type attrSets struct {
	m     sync.Map
	count atomic.Int64
}

const maxSets = 4096

func (a *attrSets) of(k setKey, build func() attribute.Set) attribute.Set {
	if v, ok := a.m.Load(k); ok {
		return v.(attribute.Set)
	}
	s := build()
	if a.count.Add(1) <= maxSets {
		a.m.Store(k, s)
	}
	return s
}

// appendCarrier collects what a propagator injects, as key-value pairs for
// metadata.AppendToOutgoingContext (cheaper than copying the outgoing
// metadata).
type appendCarrier []string

func (a *appendCarrier) Get(string) string     { return "" }
func (a *appendCarrier) Set(key, value string) { *a = append(*a, key, value) }
func (a *appendCarrier) Keys() []string {
	var keys []string
	for i := 0; i < len(*a); i += 2 {
		keys = append(keys, (*a)[i])
	}
	return keys
}

// metadataCarrier is gRPC metadata as a TextMapCarrier.
type metadataCarrier metadata.MD

func (m metadataCarrier) Get(key string) string {
	if v := metadata.MD(m).Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

func (m metadataCarrier) Set(key, value string) { metadata.MD(m).Set(key, value) }

func (m metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	return keys
}

// ObserveStats exports a Client's or a Server's counters (stats, e.g.
// c.Stats or srv.Stats) as OpenTelemetry observable counters named
// tensorrpc.<counter> (transfers, errors, copies, copied bytes, leases,
// inline and data-plane bytes, staged and direct device transfers, CUDA
// IPC transfers), each with the attribute tensorrpc.role = role. Call stop
// to unregister them.
func ObserveStats(role string, stats func() rpc.Stats, opts ...Option) (stop func() error, err error) {
	c := newConfig(opts)
	m := c.mp.Meter(ScopeName)
	type counter struct {
		name, unit, desc string
		get              func(rpc.Stats) int64
	}
	counters := []counter{
		{"tensorrpc.transfers", "{transfer}", "tensors moved", func(s rpc.Stats) int64 { return s.Transfers }},
		{"tensorrpc.errors", "{error}", "transfers that failed", func(s rpc.Stats) int64 { return s.Errors }},
		{"tensorrpc.copies", "{copy}", "CPU copies of tensor bytes", func(s rpc.Stats) int64 { return s.Copies }},
		{"tensorrpc.copied", "By", "tensor bytes copied by the CPU", func(s rpc.Stats) int64 { return s.CopiedBytes }},
		{"tensorrpc.leases", "{lease}", "tensors leased (mapped, not moved)", func(s rpc.Stats) int64 { return s.Leases }},
		{"tensorrpc.inline", "By", "tensor bytes moved inside frames", func(s rpc.Stats) int64 { return s.InlineBytes }},
		{"tensorrpc.data_plane", "By", "tensor bytes moved over the data plane", func(s rpc.Stats) int64 { return s.DataPlaneBytes }},
		{"tensorrpc.staged", "{transfer}", "device tensors staged through host memory", func(s rpc.Stats) int64 { return s.StagedTransfers }},
		{"tensorrpc.direct", "{transfer}", "device tensors moved directly", func(s rpc.Stats) int64 { return s.DirectTransfers }},
		{"tensorrpc.ipc", "{transfer}", "device tensors moved over CUDA IPC", func(s rpc.Stats) int64 { return s.IPC }},
	}
	roleAttr := metric.WithAttributes(attribute.String("tensorrpc.role", role))
	var insts []metric.Observable
	obs := make([]metric.Int64ObservableCounter, len(counters))
	for i, ct := range counters {
		if obs[i], err = m.Int64ObservableCounter(ct.name, metric.WithUnit(ct.unit), metric.WithDescription(ct.desc)); err != nil {
			return nil, err
		}
		insts = append(insts, obs[i])
	}
	reg, err := m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := stats()
		for i, ct := range counters {
			o.ObserveInt64(obs[i], ct.get(s), roleAttr)
		}
		return nil
	}, insts...)
	if err != nil {
		return nil, err
	}
	return reg.Unregister, nil
}
