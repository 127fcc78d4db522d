// Package tensorrpcotel records OpenTelemetry traces and metrics for every
// tensorrpc call: a span per Fetch, Send and Call on each side, with W3C
// trace context carried in the call's metadata on every data plane (so
// that the client's and the server's spans share a trace), and metrics
// after OpenTelemetry's RPC semantic conventions. It is a module of its
// own, as grpc-go keeps its OpenTelemetry plug-in apart, so that the
// library does not depend on OpenTelemetry.
//
//	tel := tensorrpcotel.Interceptor() // the global TracerProvider, MeterProvider and propagator
//	srv, _ := rpc.NewServer(rpc.WithInlineInterceptors(tel))
//	c, _ := rpc.Dial(ctx, addr, creds, rpc.WithInlineInterceptors(tel))
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
// Spans get their attributes as the call ends, and only when sampled: a
// sampler sees a span's name and kind, not its attributes. On a server,
// the span ends and the metrics are recorded once the call's answer has
// gone (rpc.CallInfo.AfterAnswer), so that they do not hold it up; the
// duration is the call's work, as before. A Fetch or a Send runs no
// handler of the service's, so that its server span is made only then
// too, with the call's start and end times (its parent, the client's
// span, read from the metadata then): the context the interceptors after
// this one pass on carries the client's trace context only for a Call.
// With W3C trace context (the
// default, or WithPropagators(propagation.TraceContext{})), the client
// writes traceparent, tracestate and baggage into the call's metadata
// from its span, and the server reads them by key, as the propagators
// would but without their carrier's lookups; any other propagator is
// called as it is.
//
// Metrics, by rpc.method, tensorrpc.operation, tensorrpc.plane and
// rpc.grpc.status_code: the histograms rpc.client.duration and
// rpc.server.duration (ms); the counters tensorrpc.client.request.bytes,
// tensorrpc.client.response.bytes, tensorrpc.server.request.bytes and
// tensorrpc.server.response.bytes (By, the tensor bytes calls carried;
// kept as sums and read when the provider collects, so that a call pays
// for one histogram, not three); with WithSizeHistograms also the
// conventions' rpc.{client,server}.{request,response}.size histograms. A
// method name past the first 1,024 kinds of calls is recorded as "_OTHER".
// The histograms' recordings of calls that are not traced are held back
// and made together, which costs a call a fraction of a recording of its
// own: a collection makes them first, so that it counts every call that
// ended before it (its callback does: with the SDK, unless a view drops
// all four byte counters, when they are made 100 ms after the first at the
// latest, or once 512 of a kind wait). A traced call's are made at once,
// with its span's context for exemplars.
package tensorrpcotel

import (
	"context"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
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
	// w3c: props is W3C trace context (propagation.TraceContext), with
	// baggage when baggage is set (the default): a client call's context
	// is then written into its metadata by injectW3C, without the
	// propagators' carrier interface and string building.
	w3c, baggage bool
	sizes        bool
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
	return func(c *config) {
		c.props = p
		_, c.w3c = p.(propagation.TraceContext)
		c.baggage = false
	}
}

// WithSizeHistograms adds OpenTelemetry's RPC size histograms
// (rpc.client.request.size, rpc.client.response.size,
// rpc.server.request.size, rpc.server.response.size; By, the tensor
// bytes) to the byte counters. They cost two more histogram recordings
// per call (held back with the duration's; about 0.9 µs a side on a
// 2-core VM when made one by one, as a traced call's are), which is why
// they are off by default.
func WithSizeHistograms() Option { return func(c *config) { c.sizes = true } }

func newConfig(opts []Option) *config {
	c := &config{tp: otel.GetTracerProvider(), mp: otel.GetMeterProvider(), props: otel.GetTextMapPropagator()}
	switch p := c.props; {
	case len(p.Fields()) == 0:
		c.props = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
		c.w3c, c.baggage = true, true
	default:
		_, c.w3c = p.(propagation.TraceContext)
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// instruments are one side's instruments.
type instruments struct {
	duration           metric.Float64Histogram
	reqSize, respSize  metric.Float64Histogram // WithSizeHistograms only
	reqBytes, respByte metric.Int64ObservableCounter
}

func newInstruments(m metric.Meter, side string, sizes bool) (instruments, error) {
	var in instruments
	var err error
	if in.duration, err = m.Float64Histogram("rpc."+side+".duration", metric.WithUnit("ms"),
		metric.WithDescription("tensorrpc calls (Fetch, Send, Call): duration, measured by the "+side)); err != nil {
		return in, err
	}
	if in.reqBytes, err = m.Int64ObservableCounter("tensorrpc."+side+".request.bytes", metric.WithUnit("By"),
		metric.WithDescription("tensor bytes the requests of calls carried")); err != nil {
		return in, err
	}
	if in.respByte, err = m.Int64ObservableCounter("tensorrpc."+side+".response.bytes", metric.WithUnit("By"),
		metric.WithDescription("tensor bytes the answers of calls carried")); err != nil {
		return in, err
	}
	if !sizes {
		return in, nil
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
// for every call, on the client (rpc.Dial's options) and on the server
// (NewServer's), telling the sides apart by CallInfo.Client. It never
// blocks as long as the providers' exporters do their I/O elsewhere (the
// SDK's batching span processor and periodic reader do; a synchronous
// span exporter does not): give it with rpc.WithInlineInterceptors, so
// that a Server still serves small calls where it reads them.
//
// Each Interceptor registers one callback with the MeterProvider (the
// byte counters); make one per provider and share it between clients and
// servers. It panics only if the MeterProvider refuses the instruments'
// names, which a conforming provider does not.
func Interceptor(opts ...Option) rpc.Interceptor {
	c := newConfig(opts)
	tracer := c.tp.Tracer(ScopeName)
	meter := c.mp.Meter(ScopeName)
	client, err := newInstruments(meter, "client", c.sizes)
	if err != nil {
		panic(fmt.Sprintf("tensorrpcotel: %v", err))
	}
	server, err := newInstruments(meter, "server", c.sizes)
	if err != nil {
		panic(fmt.Sprintf("tensorrpcotel: %v", err))
	}
	kinds := &callKinds{client: &client, server: &server}
	// The byte counters are sums kept per kind and status code, read when
	// the provider collects: a call adds to two integers. The durations
	// held back (callKinds.hold) are recorded first.
	if _, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, k := range kinds.all() {
			k.sets.Range(func(_, v any) bool {
				e := v.(*codeSet)
				e.record(k.in)
				o.ObserveInt64(k.in.reqBytes, e.req.Load(), e.set)
				o.ObserveInt64(k.in.respByte, e.resp.Load(), e.set)
				return true
			})
		}
		return nil
	}, client.reqBytes, client.respByte, server.reqBytes, server.respByte); err != nil {
		panic(fmt.Sprintf("tensorrpcotel: %v", err))
	}
	clientStart := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindClient)}
	serverStart := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer)}
	// A no-op TracerProvider (metrics only) starts no span: its spans
	// would only carry the parent's context on, which ctx already does
	// (the client injects it, the server's handler gets it).
	_, noTraces := c.tp.(tracenoop.TracerProvider)
	return func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		k := kinds.of(info)
		if !info.Client && info.Op != rpc.OpCall {
			var t trace.Tracer
			if !noTraces {
				t = tracer
			}
			return kinds.serveAnswered(ctx, c, t, info, k, next)
		}
		start := serverStart
		if info.Client {
			start = clientStart
		} else {
			ctx = c.parent(ctx, info)
		}
		// Attributes are set once, as the call ends, and only on a span
		// that records: an unsampled call pays for none.
		var span trace.Span
		if !noTraces {
			ctx, span = tracer.Start(ctx, k.name, start...)
		}
		if info.Client {
			// Into the call's metadata without a new context.
			if c.w3c {
				injectW3C(ctx, trace.SpanContextFromContext(ctx), infoCarrier{info}, c.baggage)
			} else {
				c.props.Inject(ctx, infoCarrier{info})
			}
		}
		t0 := time.Now()
		err := next(ctx)
		took := time.Since(t0)
		if info.Client {
			kinds.finish(info, k, span, took, err, time.Time{})
		} else {
			// The server's span ends, and its metrics are recorded, once
			// the answer has gone: they need not hold it up.
			info.AfterAnswer(func() { kinds.finish(info, k, span, took, err, time.Time{}) })
		}
		return err
	}
}

// serveAnswered runs a Fetch or a Send on a server, a call that runs no
// handler of the service's: its server span (with tracer; none when nil)
// is made once the answer has gone, with the call's start and end times,
// its parent read from the metadata then too, so that neither holds the
// answer up.
func (ks *callKinds) serveAnswered(ctx context.Context, c *config, tracer trace.Tracer, info *rpc.CallInfo, k *callKind, next func(context.Context) error) error {
	t0 := time.Now()
	err := next(ctx)
	t1 := time.Now()
	info.AfterAnswer(func() {
		var span trace.Span
		if tracer != nil {
			_, span = tracer.Start(c.parent(ctx, info), k.name, trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(t0))
		}
		ks.finish(info, k, span, t1.Sub(t0), err, t1)
	})
	return err
}

// parent is ctx with what a server call's metadata carries of the
// client's span's context (the parent of the server's) and baggage.
func (c *config) parent(ctx context.Context, info *rpc.CallInfo) context.Context {
	md := info.IncomingMetadata()
	switch {
	case md == nil:
		return ctx
	case c.w3c:
		return extractW3C(ctx, md, c.baggage)
	}
	return c.props.Extract(ctx, metadataCarrier(md))
}

// finish ends a call's span (nil: none was started) and records its
// metrics: at once for a call whose span records (its context goes with
// the recording, for exemplars), held back for the others
// (callKinds.hold).
func (ks *callKinds) finish(info *rpc.CallInfo, k *callKind, span trace.Span, took time.Duration, err error, end time.Time) {
	ms := float64(took.Nanoseconds()) / 1e6
	var endOpts []trace.SpanEndOption
	if span != nil && !end.IsZero() {
		endOpts = []trace.SpanEndOption{trace.WithTimestamp(end)}
	}
	code := status.Code(err)
	e := k.set(code)
	e.req.Add(info.RequestBytes)
	e.resp.Add(info.ResponseBytes)
	if span == nil || !span.IsRecording() {
		if span != nil {
			span.End(endOpts...)
		}
		ks.hold(k, e, heldCall{ms, info.RequestBytes, info.ResponseBytes})
		return
	}
	attrs := make([]attribute.KeyValue, 0, len(k.span)+8)
	attrs = append(attrs, k.span...)
	if info.Op != rpc.OpCall {
		attrs = append(attrs, attribute.String("tensorrpc.key", info.Name))
	}
	if info.Client {
		attrs = append(attrs, attribute.String("server.address", info.Peer))
	}
	attrs = append(attrs,
		attribute.Int("rpc.grpc.status_code", int(code)),
		attribute.Int64("tensorrpc.request.bytes", info.RequestBytes),
		attribute.Int64("tensorrpc.response.bytes", info.ResponseBytes))
	if info.Moved != "" {
		attrs = append(attrs, attribute.String("tensorrpc.moved", info.Moved), attribute.Int("tensorrpc.lanes", info.Lanes), attribute.Int("tensorrpc.copies", info.Copies))
	}
	span.SetAttributes(attrs...)
	if err != nil {
		span.SetStatus(codes.Error, status.Convert(err).Message())
	}
	span.End(endOpts...)
	k.in.record(trace.ContextWithSpan(context.Background(), span), e, heldCall{ms, info.RequestBytes, info.ResponseBytes})
}

// record makes a call's recordings.
func (in *instruments) record(ctx context.Context, e *codeSet, c heldCall) {
	in.duration.Record(ctx, c.ms, e.options...)
	if in.reqSize != nil {
		in.reqSize.Record(ctx, float64(c.req), e.options...)
		in.respSize.Record(ctx, float64(c.resp), e.options...)
	}
}

// Recordings held back. A histogram's recording costs the SDK a check of
// its attributes, a map lookup and a lock: about 0.4 µs in a loop, and
// several times that within a call, whose work has taken the caches. A
// call that is not traced (its span does not record, so that its
// recording would offer no exemplar) leaves its duration in its codeSet
// instead, and they are recorded together: when the provider collects
// (the byte counters' callback records them before it reads the sums,
// so that a collection sees every call that ended before it), once
// maxHeld wait (in a goroutine of their own), and heldFor after the first
// of them at the latest (the provider may not call the callback: a view
// that drops the byte counters).
const maxHeld = 512

var heldFor = 100 * time.Millisecond // a variable for a test

// heldCall is a call's recording held back.
type heldCall struct {
	ms        float64
	req, resp int64
}

// hold holds c back in e, a set of k's.
func (ks *callKinds) hold(k *callKind, e *codeSet, c heldCall) {
	e.mu.Lock()
	e.held = append(e.held, c)
	full := len(e.held) >= maxHeld
	e.mu.Unlock()
	if full && e.recording.CompareAndSwap(false, true) {
		go func() {
			e.record(k.in)
			e.recording.Store(false)
		}()
	}
	if !ks.timerSet.Load() && ks.timerSet.CompareAndSwap(false, true) {
		time.AfterFunc(heldFor, ks.recordHeld)
	}
}

// recordHeld records what every kind holds back.
func (ks *callKinds) recordHeld() {
	ks.timerSet.Store(false)
	for _, k := range ks.all() {
		k.sets.Range(func(_, v any) bool {
			v.(*codeSet).record(k.in)
			return true
		})
	}
}

// record records what e holds back; a collection that calls it while a
// full set is being recorded waits for it, so that it sees that set's
// calls too.
func (e *codeSet) record(in *instruments) {
	e.recordMu.Lock()
	defer e.recordMu.Unlock()
	e.mu.Lock()
	held := e.held
	e.held, e.spare = e.spare[:0], nil
	e.mu.Unlock()
	if len(held) == 0 {
		e.spare = held
		return
	}
	ctx := context.Background()
	for _, c := range held {
		in.record(ctx, e, c)
	}
	e.spare = held[:0]
}

// kindKey names a kind of call: what its span's name and start attributes
// and its metrics' attributes are made of.
type kindKey struct {
	op                  rpc.Operation
	method, plane, path string
	client              bool
}

// callKind is what calls of one kind share, made once: the span's name,
// its attributes, and the metrics' attribute sets by status code.
type callKind struct {
	name   string
	client bool
	in     *instruments         // the side's
	span   []attribute.KeyValue // the span's attributes but the key, the peer and the outcome
	base   []attribute.KeyValue // the metrics' attributes but the code
	sets   sync.Map             // grpccodes.Code -> *codeSet
}

// codeSet is the metrics' attribute set of the calls of one kind that
// ended with one status code, and their byte sums.
type codeSet struct {
	set       metric.MeasurementOption
	options   []metric.RecordOption // set, as a recording takes it
	req, resp atomic.Int64
	// held is the recordings held back (mu); spare, the slice they are
	// moved to while recorded (recordMu, held while recording).
	mu        sync.Mutex
	held      []heldCall
	recordMu  sync.Mutex
	spare     []heldCall
	recording atomic.Bool // a full set is being recorded
}

// set is the codeSet of calls of k that ended with code.
func (k *callKind) set(code grpccodes.Code) *codeSet {
	if v, ok := k.sets.Load(code); ok {
		return v.(*codeSet)
	}
	e := &codeSet{set: metric.WithAttributeSet(attribute.NewSet(append(k.base[:len(k.base):len(k.base)], attribute.Int("rpc.grpc.status_code", int(code)))...))}
	e.options = []metric.RecordOption{e.set}
	v, _ := k.sets.LoadOrStore(code, e)
	return v.(*codeSet)
}

// callKinds keeps the kinds of calls seen so far: making one sorts and
// allocates, which a call need not pay each time. Methods are few; past
// maxKinds kinds, calls of a method not seen yet are recorded with
// rpc.method "_OTHER" (as OpenTelemetry's conventions do for methods a
// server does not know), so that neither memory nor the metrics'
// cardinality grows without bound.
type callKinds struct {
	m  atomic.Pointer[map[kindKey]*callKind] // read without a lock, replaced whole
	mu sync.Mutex                            // held to replace m
	// client and server are the sides' instruments.
	client, server *instruments
	// timerSet: recordHeld will run (heldFor after a recording was held).
	timerSet atomic.Bool
}

const maxKinds = 1024

func (ks *callKinds) of(info *rpc.CallInfo) *callKind {
	key := kindKey{info.Op, info.Name, info.Transport, info.Path, info.Client}
	if info.Op != rpc.OpCall {
		key.method = string(info.Op) // keys are not a kind: they can be many
	}
	m := ks.m.Load()
	if m != nil {
		if k, ok := (*m)[key]; ok {
			return k
		}
		if len(*m) >= maxKinds {
			key.method = "_OTHER"
			if k, ok := (*m)[key]; ok {
				return k
			}
		}
	}
	return ks.add(key, info)
}

// add makes the kind key names and adds it, unless another call did.
// Kinds are few (past maxKinds, one more per operation, plane, path and
// side: "_OTHER"), so that copying the map to add one is cheap in all.
func (ks *callKinds) add(key kindKey, info *rpc.CallInfo) *callKind {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	old := ks.m.Load()
	if old != nil {
		if k, ok := (*old)[key]; ok {
			return k
		}
	}
	k := &callKind{name: "tensorrpc/" + key.method, client: info.Client, in: ks.server}
	if info.Client {
		k.in = ks.client
	}
	if info.Op == rpc.OpCall {
		k.name = "tensorrpc/Call " + key.method
	}
	k.base = []attribute.KeyValue{
		attribute.String("rpc.system", "tensorrpc"),
		attribute.String("rpc.service", "tensorrpc"),
		attribute.String("rpc.method", key.method),
		attribute.String("tensorrpc.operation", string(info.Op)),
		attribute.String("tensorrpc.plane", info.Transport),
	}
	k.span = append(k.base[:len(k.base):len(k.base)], attribute.String("tensorrpc.path", info.Path))
	m := make(map[kindKey]*callKind, 1)
	if old != nil {
		m = maps.Clone(*old)
	}
	m[key] = k
	ks.m.Store(&m)
	return k
}

// all is the kinds seen so far.
func (ks *callKinds) all() []*callKind {
	m := ks.m.Load()
	if m == nil {
		return nil
	}
	return slices.Collect(maps.Values(*m))
}

// injectW3C sets in carrier (a client call's metadata) what
// propagation.TraceContext, followed with baggage by propagation.Baggage,
// injects from ctx, whose span's context is sc: tracestate when not
// empty, traceparent, baggage when ctx carries any; no trace context for
// an invalid sc. It skips what makes the propagators' way slower: looking
// the span up in ctx, a strings.Builder, a composite's loop.
func injectW3C(ctx context.Context, sc trace.SpanContext, carrier propagation.TextMapCarrier, baggageToo bool) {
	if sc.IsValid() {
		if ts := sc.TraceState(); ts.Len() > 0 {
			carrier.Set("tracestate", ts.String())
		}
		carrier.Set("traceparent", traceparent(sc))
	}
	if baggageToo {
		if b := baggage.FromContext(ctx); b.Len() > 0 {
			carrier.Set("baggage", b.String())
		}
	}
}

// extractW3C is ctx with what propagation.TraceContext, followed with
// baggage by propagation.Baggage, extracts from a server call's incoming
// metadata md (keys lowered, as the frames and gRPC carry them), without
// a composite's loop, and baggage looked for only when md has it.
func extractW3C(ctx context.Context, md metadata.MD, baggageToo bool) context.Context {
	ctx = propagation.TraceContext{}.Extract(ctx, loweredCarrier(md))
	if baggageToo && len(md["baggage"]) > 0 {
		ctx = propagation.Baggage{}.Extract(ctx, loweredCarrier(md))
	}
	return ctx
}

// loweredCarrier is incoming metadata as a TextMapCarrier read with keys
// already lowered (the W3C propagators' own): a map lookup a key.
type loweredCarrier metadata.MD

func (m loweredCarrier) Get(key string) string {
	if v := m[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

func (m loweredCarrier) Set(key, value string) { m[key] = []string{value} }

func (m loweredCarrier) Keys() []string { return slices.Collect(maps.Keys(m)) }

// traceparent is sc as a W3C traceparent header, version 00: the
// sampled and random flags only, as propagation.TraceContext writes it.
func traceparent(sc trace.SpanContext) string {
	var b [55]byte
	tid, sid := sc.TraceID(), sc.SpanID()
	flags := [1]byte{byte(sc.TraceFlags() & (trace.FlagsSampled | trace.FlagsRandom))}
	b[0], b[1], b[2], b[35], b[52] = '0', '0', '-', '-', '-'
	hex.Encode(b[3:35], tid[:])
	hex.Encode(b[36:52], sid[:])
	hex.Encode(b[53:55], flags[:])
	return string(b[:])
}

// infoCarrier puts what a propagator injects into a client call's
// metadata (rpc.CallInfo.AddMetadata: no new context, no copy of the
// outgoing metadata).
type infoCarrier struct{ info *rpc.CallInfo }

func (c infoCarrier) Get(string) string     { return "" }
func (c infoCarrier) Set(key, value string) { c.info.AddMetadata(key, value) }
func (c infoCarrier) Keys() []string        { return nil }

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
