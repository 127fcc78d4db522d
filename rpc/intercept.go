package rpc

import (
	"context"
	"encoding/binary"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

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
//     metadata.FromIncomingContext. Keys are lower case; as in gRPC, a key
//     whose value is binary ends in "-bin". On the gRPC paths it is the
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
}

// Interceptor wraps a call: it runs next, which makes (on a client) or
// serves (on a server) the call, and returns next's error or one of its
// own, a gRPC status. It may change the context next gets (add outgoing
// metadata on a client, a span on a server). Interceptors run on the
// call's own goroutine (the caller's on a client, the call's on a server),
// never on the goroutine that drains a lane; time they take is the
// call's.
type Interceptor func(ctx context.Context, info *CallInfo, next func(context.Context) error) error

// WithInterceptors adds interceptors to a Client or Server. They chain in
// order, the first outermost, as grpc.ChainUnaryInterceptor chains: each
// call runs the first, whose next runs the second, and so on to the call.
func WithInterceptors(is ...Interceptor) Option {
	return sharedOption(func(o *options) { o.interceptors = append(o.interceptors, is...) })
}

// intercept runs work through the interceptors is, in order. An error
// that is not a gRPC status becomes Unknown.
func intercept(ctx context.Context, is []Interceptor, info *CallInfo, work func(context.Context) error) error {
	if len(is) == 0 {
		return work(ctx)
	}
	var run func(i int, ctx context.Context) error
	run = func(i int, ctx context.Context) error {
		if i == len(is) {
			return work(ctx)
		}
		return is[i](ctx, info, func(ctx context.Context) error { return run(i+1, ctx) })
	}
	err := run(0, ctx)
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); !ok {
		return status.Error(codes.Unknown, err.Error())
	}
	return err
}

// callHeaders is what a request frame made under ctx carries before its
// body (frameHeaders), nil when nothing.
func callHeaders(ctx context.Context) ([]byte, error) {
	b, _, err := appendHeaders(nil, ctx)
	return b, err
}

// appendHeaders appends to b what a request frame carries besides its
// body (frameHeaders): a u32 length and a CallHeaders with the outgoing
// metadata and the time left to ctx's deadline. It reports false (and
// appends nothing) when there is nothing to carry.
func appendHeaders(b []byte, ctx context.Context) ([]byte, bool, error) {
	md, _ := metadata.FromOutgoingContext(ctx)
	dl, hasDeadline := ctx.Deadline()
	if len(md) == 0 && !hasDeadline {
		return b, false, nil
	}
	h := &pb.CallHeaders{}
	for k, vs := range md {
		for _, v := range vs {
			h.Metadata = append(h.Metadata, &pb.Header{Key: k, Value: []byte(v)})
		}
	}
	if n := proto.Size(h); n > MaxFrameMetadataBytes {
		return b, false, status.Errorf(codes.ResourceExhausted, "tensorrpc: call metadata of %d bytes encoded, over the %d a call may carry (rpc.MaxFrameMetadataBytes)", n, MaxFrameMetadataBytes)
	}
	if hasDeadline {
		left := time.Until(dl)
		if left <= 0 {
			return b, false, status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
		}
		h.TimeoutMicros = uint64(max(left.Microseconds(), 1))
	}
	off := len(b)
	b = binary.LittleEndian.AppendUint32(b, 0)
	b, err := proto.MarshalOptions{}.MarshalAppend(b, h)
	if err != nil {
		return b[:off], false, status.Errorf(codes.Internal, "tensorrpc: encoding call headers: %v", err)
	}
	binary.LittleEndian.PutUint32(b[off:], uint32(len(b)-off-4))
	return b, true, nil
}

// splitHeaders splits a request frame's body that carries headers into
// them and the rest.
func splitHeaders(body []byte) (*pb.CallHeaders, []byte, error) {
	if len(body) < 4 {
		return nil, nil, fmt.Errorf("%w: headers in a body of %d bytes", wire.ErrInvalidFrame, len(body))
	}
	n := binary.LittleEndian.Uint32(body)
	if uint64(n) > uint64(len(body)-4) || n > MaxFrameMetadataBytes+16 {
		return nil, nil, fmt.Errorf("%w: headers of %d bytes in a body of %d", wire.ErrInvalidFrame, n, len(body))
	}
	h := &pb.CallHeaders{}
	if err := proto.Unmarshal(body[4:4+n], h); err != nil {
		return nil, nil, fmt.Errorf("%w: headers: %v", wire.ErrInvalidFrame, err)
	}
	return h, body[4+n:], nil
}

// withHeaders is the context a frame call runs under: parent with the
// caller's metadata and deadline, and the function that ends it.
func withHeaders(parent context.Context, h *pb.CallHeaders) (context.Context, context.CancelFunc) {
	if h == nil {
		return context.WithCancel(parent)
	}
	ctx := parent
	if len(h.Metadata) > 0 {
		md := metadata.MD{}
		for _, e := range h.Metadata {
			md.Append(e.Key, string(e.Value))
		}
		ctx = metadata.NewIncomingContext(ctx, md)
	}
	if h.TimeoutMicros > 0 {
		return context.WithTimeout(ctx, time.Duration(min(h.TimeoutMicros, uint64(1<<62)/1000))*time.Microsecond)
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
	info := &CallInfo{Op: op, Name: name, Path: path, RequestBytes: reqBytes, Transport: TransportGRPC}
	if len(s.opts.interceptors) == 0 {
		return work(ctx, info)
	}
	if ss != nil {
		info.Session, info.Transport, info.Peer = ss.id, ss.transport, ss.addr
	} else {
		info.Peer = peerAddr(ctx)
	}
	return intercept(ctx, s.opts.interceptors, info, func(ctx context.Context) error { return work(ctx, info) })
}

// metaBytes is the sum of metas' byte lengths.
func metaBytes(metas []*pb.TensorMeta) int64 {
	var n int64
	for _, m := range metas {
		n += int64(m.GetByteLength())
	}
	return n
}
