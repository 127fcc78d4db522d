package rpc

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
)

// Calls carry what a gRPC call carries, on every path (a frame on the data
// plane, a unary method, a stream):
//
//   - Metadata: the client sets it as for a gRPC call, with
//     metadata.NewOutgoingContext or metadata.AppendToOutgoingContext
//     (google.golang.org/grpc/metadata); the handler reads it with
//     metadata.FromIncomingContext. A client interceptor may also add
//     entries with CallInfo.AddMetadata (no new context, no copy: for an
//     entry on every call, such as a trace context). Keys are lower case;
//     as in gRPC, a key whose value is binary ends in "-bin". On the gRPC paths it is the
//     call's gRPC metadata (so the incoming side also holds gRPC's own
//     entries, such as "user-agent"); on frames it rides the request, at
//     most MaxFrameMetadataBytes of it encoded.
//   - The deadline: the handler's context has the caller's deadline (sent
//     as the time left, as gRPC sends grpc-timeout), and a call still
//     running when it passes is cancelled on the server: its handler's
//     context is done and the caller gets DeadlineExceeded.
//
// Interceptors (WithInterceptors) see every Fetch, Send and Call, on the
// client as it is made and on the server as it is served, whatever path it
// took. gRPC's own interceptors (given with WithGRPCServerOptions or
// WithGRPCDialOptions) see only the gRPC methods: session setup, the
// streams of the fallback, and the unary methods a gRPC-only client calls.

// MaxFrameMetadataBytes bounds the encoded metadata a call carries as a
// frame; a call with more fails with ResourceExhausted before it is sent.
const MaxFrameMetadataBytes = engine.MaxFrameMetadataBytes

// Operation names what a call does.
type Operation string

// The operations an interceptor sees.
const (
	OpFetch Operation = "Fetch"
	OpSend  Operation = "Send"
	OpCall  Operation = "Call"
)

// Paths a call can take (CallInfo.Path).
const (
	PathFrame  = "frame"  // a frame on the session's data plane
	PathUnary  = "unary"  // a gRPC unary method (gRPC-only clients)
	PathStream = "stream" // a gRPC stream (the fallback)
)

// CallInfo describes one call to an interceptor. The fields that describe
// what came back (ResponseBytes) are set by the time next returns.
type CallInfo struct {
	// Op is the operation; Name the key of a Fetch or Send, or the method
	// of a Call.
	Op   Operation
	Name string
	// Client is true on the client's side of the call.
	Client bool
	// Peer is the other side: the target the client dialed, or the
	// client's address on the server.
	Peer string
	// Session is the session the call belongs to ("" for a server call
	// without one).
	Session string
	// Transport is the session's data plane (TransportSHM, ...,
	// TransportGRPC); Path how the call travelled (PathFrame, PathUnary,
	// PathStream).
	Transport, Path string
	// RequestBytes and ResponseBytes are the tensor bytes the request
	// carried (a Send's or a Call's tensors) and the answer carried (a
	// Fetch's tensor, a Call's reply tensors).
	RequestBytes, ResponseBytes int64
	// Moved says, on the client, how the tensor bytes of a Fetch or Send
	// moved, once the call has made them move (MovedInline, MovedPulled,
	// ...; "" where it was not recorded, as for Calls); Lanes how many
	// lanes carried them (0: in the frame or on the gRPC stream) and
	// Copies how many copies of them the client made.
	Moved         string
	Lanes, Copies int
	// Compression says, on the side that read the call's tensors (the
	// client for a Fetch or a Call's reply, the server for a Send or a
	// Call's request), whether one crossed the wire compressed
	// (CompressionS2, CompressionZstd, CompressionHuff) or none did
	// (CompressionOff), once read on a session that compresses (""
	// otherwise, and for tensors under 1 MiB); WireBytes how many bytes
	// crossed for those tensors, and Goodput the
	// plane's goodput (bytes a second) the decision was made with (0 when
	// this side did not decide: the mode was not auto, or on the gRPC
	// fallback, whose streams' sender decides).
	Compression string
	WireBytes   int64
	Goodput     float64
	// SampleRatio is, in auto mode on tcp, the best ratio the other side's
	// sample of the bytes showed (0: it sampled nothing: the link was
	// faster than any codec runs, or the tensor too short): with Goodput,
	// what auto decided from.
	SampleRatio float64

	// added is what AddMetadata added (key, value, ...), in addedBuf
	// while it fits.
	added    []string
	addedBuf [4]string
	// after is what AfterAnswer deferred, until the answer has gone, in
	// afterBuf while it fits (one interceptor's: no allocation a call).
	after    []func()
	afterBuf [1]func()
	// md is a server call's incoming metadata when known (mdKnown: the
	// frame paths, or once IncomingMetadata looked it up in mdCtx), or
	// as mdSrc decodes it when asked for (a Fetch answered at once).
	md      metadata.MD
	mdKnown bool
	mdCtx   context.Context
	mdSrc   lazyMetadata
}

// lazyMetadata decodes a call's metadata when asked for (once; nil: none).
type lazyMetadata interface{ metadata() metadata.MD }

// IncomingMetadata is, on a server, the metadata the call carried, for
// an interceptor to read without a context lookup per key (as
// metadata.ValueFromIncomingContext does) or a copy of it all (as
// metadata.FromIncomingContext does): for a call that travelled as a
// frame, the map the handler's context carries itself, keys lowered; on
// the gRPC paths, a copy made at the first call. Do not modify it. It is
// nil when the call carried none, and on a client.
func (info *CallInfo) IncomingMetadata() metadata.MD {
	if info.Client {
		return nil
	}
	if info.mdSrc != nil {
		return info.mdSrc.metadata()
	}
	if !info.mdKnown && info.mdCtx != nil {
		info.md, _ = metadata.FromIncomingContext(info.mdCtx)
		info.mdKnown = true
	}
	return info.md
}

// AfterAnswer defers f until the call's answer has gone: on a server, for
// a call that travelled as a frame, f runs once the answer frame's Send
// has completed (on tcp as soon as it is written) where the lane's
// completions are handled, or, when the answer could not go at once,
// as it is handed to the data plane from a goroutine of its own or
// fails; so that what an interceptor records after its call (a metric,
// the end of a span) does not hold up the answer; elsewhere (the gRPC
// paths, a client) it runs as the interceptors return. f sees the
// CallInfo as the interceptors left it. Calls made in f delay the next
// frame of the lane: keep f short, and never let it block.
func (info *CallInfo) AfterAnswer(f func()) {
	if info.after == nil {
		info.after = info.afterBuf[:0]
	}
	info.after = append(info.after, f)
}

// answered runs what AfterAnswer deferred (info may be nil: no
// interceptors).
func (info *CallInfo) answered() {
	if info == nil {
		return
	}
	for _, f := range info.after {
		f()
	}
	clear(info.afterBuf[:])
	info.after = nil
}

// AddMetadata adds key (lowered) and value to the metadata the call
// carries to the server, as metadata.AppendToOutgoingContext on the
// context a client interceptor passes to next would, but without a new
// context and without the copies the metadata package makes on the way:
// for interceptors that add an entry to every call (a trace context). It
// must be called before next; on a server's CallInfo it does nothing.
func (info *CallInfo) AddMetadata(key, value string) {
	if !info.Client {
		return
	}
	if info.added == nil {
		info.added = info.addedBuf[:0]
	}
	info.added = append(info.added, strings.ToLower(key), value)
}

// addedMetadata is what interceptors added to the call ctx is under with
// AddMetadata (nil: nothing).
func addedMetadata(ctx context.Context) []string {
	if info, _ := ctx.Value(callInfoKey{}).(*CallInfo); info != nil && info.Client {
		return info.added
	}
	return nil
}

// withAddedMetadata is ctx with what interceptors added with AddMetadata
// in its outgoing metadata: for the calls made as gRPC calls (the frames
// carry it from the CallInfo, see callHeaders).
func withAddedMetadata(ctx context.Context) context.Context {
	if kv := addedMetadata(ctx); len(kv) > 0 {
		return metadata.AppendToOutgoingContext(ctx, kv...)
	}
	return ctx
}

// How a call's bytes moved (CallInfo.Moved).
const (
	// MovedInline: inside the request or answer frame (small tensors),
	// copied between the frame and the tensor.
	MovedInline = "inline"
	// MovedPulled: read one-sided from memory the peer granted, into the
	// client's pool (Fetch) or by the server from the client's (Send);
	// Lanes > 1 when striped over several lanes.
	MovedPulled = "pulled"
	// MovedInPlace: as MovedPulled, but straight into or out of the
	// caller's own memory (rpc.Into, caller memory sent), no pool buffer.
	MovedInPlace = "in-place"
	// MovedLanded: written by the server into a pool buffer the client
	// granted with its Fetch (a landing, WithFetchLanding), before the
	// answer: no Read.
	MovedLanded = "landed"
	// MovedLeased: not moved: the client maps the server's memory (shm
	// lease).
	MovedLeased = "leased"
	// MovedRows: rows of a published tensor, read by the client from the
	// granted source in one batch.
	MovedRows = "rows"
	// MovedStream: in chunks on the gRPC fallback's stream.
	MovedStream = "stream"
)

// callInfoKey carries a call's *CallInfo in its context, from intercept
// down to where the bytes move; it is there only when something looks.
type callInfoKey struct{}

// explain records in ctx's CallInfo, if any, how the call's bytes moved.
func explain(ctx context.Context, moved string, lanes, copies int) {
	if info, _ := ctx.Value(callInfoKey{}).(*CallInfo); info != nil {
		info.Moved, info.Lanes, info.Copies = moved, lanes, copies
	}
}

// setResponse sets ResponseBytes of info, which is nil where no
// interceptor looks.
func (info *CallInfo) setResponse(n int64) {
	if info != nil {
		info.ResponseBytes = n
	}
}

// Interceptor wraps a call: it runs next, which makes (on a client) or
// serves (on a server) the call, and returns next's error or one of its
// own, a gRPC status. It may change the context next gets (add outgoing
// metadata on a client, a span on a server). On a client interceptors run
// on the caller's goroutine. On a server, those given with
// WithInterceptors run on the call's own goroutine, never on the
// goroutine that drains a lane; those given with WithInlineInterceptors
// may run on it. Time they take is the call's.
type Interceptor func(ctx context.Context, info *CallInfo, next func(context.Context) error) error

// WithInterceptors adds interceptors to a Client or Server. They chain in
// order, the first outermost, as grpc.ChainUnaryInterceptor chains: each
// call runs the first, whose next runs the second, and so on to the call.
//
// An interceptor may block (call out, take a lock for long): a Server
// with one serves every call on a goroutine of its own, so that no lane
// waits for it. That costs a small call a goroutine and a wake-up (on two
// cores a 4 KiB Fetch took about twice as long with a no-op interceptor
// as with none); interceptors that never block are given with
// WithInlineInterceptors instead.
func WithInterceptors(is ...Interceptor) Option {
	return sharedOption(func(o *options) {
		o.interceptors = append(o.interceptors[:len(o.interceptors):len(o.interceptors)], is...)
		o.mayBlock += len(is)
	})
}

// WithInlineInterceptors adds interceptors that never block: they look at
// the call, record (a span, a metric, a counter) and return, leaving any
// I/O to other goroutines (an OpenTelemetry SDK's batching processor and
// periodic reader, not a synchronous exporter). They chain with those of
// WithInterceptors in the order given, and see the same calls.
//
// On a Server they keep the frame path: calls served where a lane's frames
// are read (a Fetch of a published tensor, the calls of Inline handlers)
// still are, the interceptors running there too, while nothing else of
// that lane is read. A Server that has any interceptor given with
// WithInterceptors serves every call on a goroutine of its own. On a
// Client the two are the same.
func WithInlineInterceptors(is ...Interceptor) Option {
	return sharedOption(func(o *options) {
		o.interceptors = append(o.interceptors[:len(o.interceptors):len(o.interceptors)], is...)
	})
}

// inlineOK reports whether calls may be served on the goroutine that reads
// a lane's frames: no interceptor that may block wraps them.
func (o *options) inlineOK() bool { return o.mayBlock == 0 }

// intercept runs work through the interceptors is, in order. An error
// that is not a gRPC status becomes Unknown.
func intercept(ctx context.Context, is []Interceptor, info *CallInfo, work func(context.Context) error) error {
	var err error
	switch len(is) {
	case 0:
		return work(ctx)
	case 1: // the common case, without the chain's closures
		err = is[0](ctx, info, work)
	default:
		var run func(i int, ctx context.Context) error
		run = func(i int, ctx context.Context) error {
			if i == len(is) {
				return work(ctx)
			}
			return is[i](ctx, info, func(ctx context.Context) error { return run(i+1, ctx) })
		}
		err = run(0, ctx)
	}
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); !ok {
		return status.Error(codes.Unknown, err.Error())
	}
	return err
}

// callHeaders is what a request frame made under ctx carries before its
// body (frameHeaders), nil when nothing; with room for more bytes after
// it (the body's raw part, appended next).
func callHeaders(ctx context.Context, more int) ([]byte, error) {
	md, _ := metadata.FromOutgoingContext(ctx)
	added := addedMetadata(ctx)
	if _, ok := ctx.Deadline(); len(md) == 0 && len(added) == 0 && !ok {
		return nil, nil
	}
	n := 4 + 11 + more // the length, a timeout
	for k, vs := range md {
		for _, v := range vs {
			n += 16 + len(k) + len(v)
		}
	}
	for _, s := range added {
		n += 8 + len(s)
	}
	b, _, err := encodeHeaders(make([]byte, 0, n), md, added, ctx)
	return b, err
}

// appendHeaders appends to b what a request frame carries besides its
// body (frameHeaders): a u32 length and a CallHeaders with the outgoing
// metadata and the time left to ctx's deadline, encoded by hand (the
// common case, a deadline alone, costs no allocation but b's). It reports
// false (and appends nothing) when there is nothing to carry.
func appendHeaders(b []byte, ctx context.Context) ([]byte, bool, error) {
	md, _ := metadata.FromOutgoingContext(ctx)
	return encodeHeaders(b, md, addedMetadata(ctx), ctx)
}

// encodeHeaders is appendHeaders with ctx's outgoing metadata md and
// what interceptors added to the call (key, value, ...; AddMetadata).
func encodeHeaders(b []byte, md metadata.MD, added []string, ctx context.Context) ([]byte, bool, error) {
	dl, hasDeadline := ctx.Deadline()
	if len(md) == 0 && len(added) == 0 && !hasDeadline {
		return b, false, nil
	}
	off := len(b)
	b = binary.LittleEndian.AppendUint32(b, 0)
	for k, vs := range md {
		for _, v := range vs {
			b = appendHeader(b, k, v)
		}
	}
	for i := 0; i+1 < len(added); i += 2 {
		b = appendHeader(b, added[i], added[i+1])
	}
	if n := len(b) - off - 4; n > MaxFrameMetadataBytes {
		return b[:off], false, status.Errorf(codes.ResourceExhausted, "tensorrpc: call metadata of %d bytes encoded, over the %d a call may carry (rpc.MaxFrameMetadataBytes)", n, MaxFrameMetadataBytes)
	}
	if hasDeadline {
		left := time.Until(dl)
		if left <= 0 {
			return b[:off], false, status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
		}
		b = protowire.AppendTag(b, 2, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(max(left.Microseconds(), 1)))
	}
	binary.LittleEndian.PutUint32(b[off:], uint32(len(b)-off-4))
	return b, true, nil
}

// appendHeader appends one entry, a Header{key = 1, value = 2} as
// CallHeaders.metadata = 1.
func appendHeader(b []byte, k, v string) []byte {
	n := protowire.SizeTag(1) + protowire.SizeBytes(len(k)) + protowire.SizeTag(2) + protowire.SizeBytes(len(v))
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(n))
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, k)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	return protowire.AppendString(b, v)
}

// headers is a request's CallHeaders: its deadline, and its metadata,
// decoded from entries by decode.
type headers struct {
	md      metadata.MD // nil: none, or not decoded yet
	entries string      // the encoded CallHeaders when it has metadata entries not yet decoded
	timeout time.Duration
}

// splitHeaders splits a request frame's body that carries headers into
// them, decoded, and the rest.
func splitHeaders(body []byte) (headers, []byte, error) {
	h, rest, err := cutHeaders(body)
	h.decode()
	return h, rest, err
}

// cutHeaders splits a request frame's body that carries headers into
// them and the rest, reading the deadline and checking the metadata
// entries, which decode decodes (from a copy of them: the frame's body
// may be reused). It reads CallHeaders with protowire: unknown fields
// are skipped, as protobuf would.
func cutHeaders(body []byte) (headers, []byte, error) {
	var h headers
	if len(body) < 4 {
		return h, nil, fmt.Errorf("%w: headers in a body of %d bytes", wire.ErrInvalidFrame, len(body))
	}
	n := binary.LittleEndian.Uint32(body)
	if uint64(n) > uint64(len(body)-4) || n > MaxFrameMetadataBytes+16 {
		return h, nil, fmt.Errorf("%w: headers of %d bytes in a body of %d", wire.ErrInvalidFrame, n, len(body))
	}
	p, rest := body[4:4+n], body[4+n:]
	all := p
	bad := func(what string) (headers, []byte, error) {
		return headers{}, nil, fmt.Errorf("%w: headers: %s", wire.ErrInvalidFrame, what)
	}
	entries := false
	for len(p) > 0 {
		num, typ, k := protowire.ConsumeTag(p)
		if k < 0 {
			return bad("a bad tag")
		}
		p = p[k:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			e, k := protowire.ConsumeBytes(p)
			if k < 0 {
				return bad("a bad metadata entry")
			}
			p = p[k:]
			if _, _, err := decodeHeader(e); err != nil {
				return bad(err.Error())
			}
			entries = true
		case num == 2 && typ == protowire.VarintType:
			v, k := protowire.ConsumeVarint(p)
			if k < 0 {
				return bad("a bad timeout")
			}
			p = p[k:]
			h.timeout = time.Duration(min(v, uint64(1<<62)/1000)) * time.Microsecond
		default:
			k := protowire.ConsumeFieldValue(num, typ, p)
			if k < 0 {
				return bad("a bad field")
			}
			p = p[k:]
		}
	}
	if entries {
		h.entries = string(all)
	}
	return h, rest, nil
}

// decode decodes the metadata entries cutHeaders checked, once. Keys and
// values are cut from the one copy of the headers, and the values'
// slices from one array: a call's metadata costs a few allocations, not
// a few per entry.
func (h *headers) decode() metadata.MD {
	if h.entries == "" {
		return h.md
	}
	all := h.entries
	h.entries = ""
	p := unsafe.Slice(unsafe.StringData(all), len(all)) // read only
	// At most the tag bytes (values may hold that byte too): room for
	// the first few, which is what calls carry; more append.
	vals := make([]string, 0, min(bytes.Count(p, []byte{1<<3 | byte(protowire.BytesType)}), 8))
	cut := func(b []byte) string { // b views p
		if len(b) == 0 {
			return ""
		}
		off := len(all) - cap(b)
		return all[off : off+len(b)]
	}
	md := make(metadata.MD, cap(vals))
	for len(p) > 0 {
		num, typ, k := protowire.ConsumeTag(p)
		p = p[k:]
		if num != 1 || typ != protowire.BytesType {
			p = p[protowire.ConsumeFieldValue(num, typ, p):]
			continue
		}
		e, k := protowire.ConsumeBytes(p)
		p = p[k:]
		kb, vb, _ := decodeHeader(e) // checked by cutHeaders
		key := strings.ToLower(cut(kb))
		if len(vals) < cap(vals) && len(md[key]) == 0 {
			vals = append(vals, cut(vb))
			md[key] = vals[len(vals)-1 : len(vals) : len(vals)]
		} else {
			md[key] = append(md[key], cut(vb))
		}
	}
	h.md = md
	return md
}

// decodeHeader decodes one Header (key = 1, value = 2): views of e.
func decodeHeader(e []byte) (key, value []byte, err error) {
	for len(e) > 0 {
		num, typ, k := protowire.ConsumeTag(e)
		if k < 0 {
			return nil, nil, errors.New("a bad metadata tag")
		}
		e = e[k:]
		if typ != protowire.BytesType || (num != 1 && num != 2) {
			if k = protowire.ConsumeFieldValue(num, typ, e); k < 0 {
				return nil, nil, errors.New("a bad metadata field")
			}
			e = e[k:]
			continue
		}
		v, k := protowire.ConsumeBytes(e)
		if k < 0 {
			return nil, nil, errors.New("a bad metadata string")
		}
		e = e[k:]
		if num == 1 {
			key = v
		} else {
			value = v
		}
	}
	return key, value, nil
}

// withHeaders is the context a frame call runs under: parent with the
// caller's metadata and deadline, and the function that ends it.
func withHeaders(parent context.Context, h headers) (context.Context, context.CancelFunc) {
	ctx := parent
	if h.md != nil {
		ctx = metadata.NewIncomingContext(ctx, h.md)
	}
	if h.timeout > 0 {
		return context.WithTimeout(ctx, h.timeout)
	}
	return context.WithCancel(ctx)
}

// tensorBytes is the sum of ts' byte lengths.
func tensorBytes(ts []*Tensor) int64 {
	var n int64
	for _, t := range ts {
		if t != nil && t.Valid() {
			n += int64(len(t.Bytes()))
		}
	}
	return n
}

// intercept runs the work of a call the server serves through its
// interceptors. ss is the call's session (nil for a call without one);
// work sets what came back in info.
func (s *Server) intercept(ctx context.Context, ss *serverSession, op Operation, name, path string, reqBytes int64, work func(context.Context, *CallInfo) error) error {
	info, err := s.interceptAnswer(ctx, ss, op, name, path, reqBytes, nil, false, work)
	info.answered()
	return err
}

// interceptAnswer is intercept for a caller that answers the call itself
// and then runs what the interceptors deferred until then
// (info.answered; info is nil when there are no interceptors). md is the
// call's incoming metadata, when mdKnown (a frame's headers); otherwise
// IncomingMetadata looks it up in ctx.
func (s *Server) interceptAnswer(ctx context.Context, ss *serverSession, op Operation, name, path string, reqBytes int64, md metadata.MD, mdKnown bool, work func(context.Context, *CallInfo) error) (*CallInfo, error) {
	if len(s.opts.interceptors) == 0 {
		return nil, work(ctx, nil)
	}
	ic := &icall{}
	return &ic.info, s.interceptCall(ctx, ss, ic, op, name, path, reqBytes, md, mdKnown, nil, workFunc(work))
}

// interceptCall is interceptAnswer with the call's icall given (part of
// a larger allocation of the caller's) and its work w, for a Server that
// has interceptors; src, if not nil, decodes the call's metadata when
// asked for (ctx does not carry it then: ic answers for it).
func (s *Server) interceptCall(ctx context.Context, ss *serverSession, ic *icall, op Operation, name, path string, reqBytes int64, md metadata.MD, mdKnown bool, src lazyMetadata, w callWork) error {
	ic.Context, ic.w = ctx, w
	ic.info = CallInfo{Op: op, Name: name, Path: path, RequestBytes: reqBytes, Transport: TransportGRPC, md: md, mdKnown: mdKnown, mdSrc: src}
	if !mdKnown {
		ic.info.mdCtx = ctx
	}
	if ss != nil {
		ic.info.Session, ic.info.Transport, ic.info.Peer = ss.id, ss.transport, ss.addr
	} else {
		ic.info.Peer = peerAddr(ctx)
	}
	return intercept(ic, s.opts.interceptors, &ic.info, ic.next)
}

// icall is an intercepted call in one allocation: its CallInfo, the
// context its interceptors get (the call's, carrying the CallInfo, as
// context.WithValue would make it), and the work they wrap.
type icall struct {
	context.Context // the call's
	info            CallInfo
	w               callWork
}

// Value is the call's CallInfo for callInfoKey, the call's context's
// value otherwise.
func (c *icall) Value(key any) any {
	if _, ok := key.(callInfoKey); ok {
		return &c.info
	}
	if c.info.mdSrc != nil && key == incomingMDKey {
		// The call's metadata, decoded now, as metadata.NewIncomingContext
		// would have put it in ctx.
		if md := c.info.mdSrc.metadata(); md != nil {
			return md
		}
	}
	return c.Context.Value(key)
}

// incomingMDKey is the key under which gRPC's metadata package looks for
// a server call's incoming metadata in a context (learnt by asking a
// context that notes the keys it is asked for), so that an icall can
// answer it with metadata it decodes only then; nil, and metadata goes in
// contexts with metadata.NewIncomingContext, if that is not how the
// package finds it (a context answering the key with an MD must be read
// by FromIncomingContext and ValueFromIncomingContext).
var incomingMDKey = func() any {
	p := &keyProbe{Context: context.Background()}
	metadata.FromIncomingContext(p)
	if len(p.keys) != 1 {
		return nil
	}
	a := &keyProbe{Context: context.Background(), answer: p.keys[0], md: metadata.MD{"k": {"v"}}}
	md, ok := metadata.FromIncomingContext(a)
	if v := metadata.ValueFromIncomingContext(a, "k"); !ok || len(md["k"]) != 1 || md["k"][0] != "v" || len(v) != 1 || v[0] != "v" {
		return nil
	}
	return p.keys[0]
}()

// keyProbe is a context that notes the keys it is asked for, and answers
// md for answer.
type keyProbe struct {
	context.Context
	keys   []any
	answer any
	md     metadata.MD
}

func (p *keyProbe) Value(key any) any {
	if p.answer != nil && key == p.answer {
		return p.md
	}
	p.keys = append(p.keys, key)
	return p.Context.Value(key)
}

// next runs the call's work: the next of its last interceptor.
func (c *icall) next(ctx context.Context) error { return c.w.work(ctx, &c.info) }

// callWork is a call's work, which its interceptors wrap.
type callWork interface {
	work(ctx context.Context, info *CallInfo) error
}

// workFunc is a function as a callWork.
type workFunc func(context.Context, *CallInfo) error

func (f workFunc) work(ctx context.Context, info *CallInfo) error { return f(ctx, info) }

// metaBytes is the sum of metas' byte lengths.
func metaBytes(metas []*pb.TensorMeta) int64 {
	var n int64
	for _, m := range metas {
		n += int64(m.GetByteLength())
	}
	return n
}

// logCalls is the path explainer: at debug level (TENSORRPC_LOG=debug, or
// WithLogger with a debug handler) every call is logged once it ends, with
// its operation, key or method, data plane and path and, on the client,
// how its bytes moved, over how many lanes and with how many copies.
func logCalls(log *slog.Logger) Interceptor {
	return func(ctx context.Context, info *CallInfo, next func(context.Context) error) error {
		t0 := time.Now()
		err := next(ctx)
		side := "server"
		if info.Client {
			side = "client"
		}
		attrs := []slog.Attr{
			slog.String("side", side), slog.String("op", string(info.Op)), slog.String("name", info.Name),
			slog.String("plane", info.Transport), slog.String("path", info.Path),
			slog.Int64("request_bytes", info.RequestBytes), slog.Int64("response_bytes", info.ResponseBytes),
		}
		if info.Moved != "" {
			attrs = append(attrs, slog.String("moved", info.Moved), slog.Int("lanes", info.Lanes), slog.Int("copies", info.Copies))
		}
		attrs = append(attrs, slog.Duration("took", time.Since(t0)), slog.String("code", status.Code(err).String()))
		log.LogAttrs(ctx, slog.LevelDebug, "tensorrpc: call", attrs...)
		return err
	}
}

// withCallLog adds logCalls to o's interceptors when its logger logs at
// debug level.
func (o *options) withCallLog() {
	if o.logger != nil && o.logger.Enabled(context.Background(), slog.LevelDebug) {
		// Logging writes: it may block, so it keeps calls off the frame path.
		o.interceptors = append(o.interceptors[:len(o.interceptors):len(o.interceptors)], logCalls(o.logger))
		o.mayBlock++
	}
}
