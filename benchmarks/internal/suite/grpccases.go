package suite

import (
	"context"
	"fmt"
	"math"
	"net"

	flatbuffers "github.com/google/flatbuffers/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/fbcodec"
	"github.com/tensorrpc/tensorrpc/benchmarks/internal/tensorfb"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// What a team would write without tensorrpc: a unary gRPC method that
// returns the tensor in one message, as a protobuf bytes field or a
// FlatBuffers vector, optionally compressed.

// grpcSettings are the knobs of a gRPC case.
type grpcSettings struct {
	tuned      bool
	flatbuf    bool
	compressor string // grpc encoding name, "" for none
	// echo: the request carries the n bytes too, and the reply is the
	// request's bytes (a call moving n bytes each way).
	echo bool
}

// Tuned settings: stream and connection windows well above one transfer's
// bandwidth-delay product (which disables gRPC's BDP estimator, so the
// window is large from the first byte), 1 MiB socket read/write buffers
// instead of 32 KiB, and message limits that admit 1 GiB.
const (
	tunedStreamWindow = 64 << 20
	tunedConnWindow   = 256 << 20
	tunedIOBuffer     = 1 << 20
	maxMessage        = math.MaxInt32
)

// Default settings change only what a 1 GiB reply needs: the client's
// receive limit (4 MiB by default). The server's send limit is already
// MaxInt32.
func (g grpcSettings) serverOptions() []grpc.ServerOption {
	opts := []grpc.ServerOption{grpc.MaxSendMsgSize(maxMessage)}
	if g.echo && !g.tuned {
		// The request is as large as the reply: raise the server's
		// receive limit (4 MiB by default) too.
		opts = append(opts, grpc.MaxRecvMsgSize(maxMessage))
	}
	if g.tuned {
		opts = append(opts,
			grpc.InitialWindowSize(tunedStreamWindow),
			grpc.InitialConnWindowSize(tunedConnWindow),
			grpc.ReadBufferSize(tunedIOBuffer),
			grpc.WriteBufferSize(tunedIOBuffer),
			grpc.MaxRecvMsgSize(maxMessage))
	}
	if g.flatbuf {
		opts = append(opts, grpc.ForceServerCodecV2(fbcodec.Codec{}))
	}
	return opts
}

func (g grpcSettings) dialOptions() []grpc.DialOption {
	call := []grpc.CallOption{grpc.MaxCallRecvMsgSize(maxMessage)}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if g.tuned {
		opts = append(opts,
			grpc.WithInitialWindowSize(tunedStreamWindow),
			grpc.WithInitialConnWindowSize(tunedConnWindow),
			grpc.WithReadBufferSize(tunedIOBuffer),
			grpc.WithWriteBufferSize(tunedIOBuffer))
		call = append(call, grpc.MaxCallSendMsgSize(maxMessage))
	}
	if g.flatbuf {
		call = append(call, grpc.ForceCodecV2(fbcodec.Codec{}))
	}
	if g.compressor != "" {
		// The server answers with the compressor of the request.
		call = append(call, grpc.UseCompressor(g.compressor))
	}
	return append(opts, grpc.WithDefaultCallOptions(call...))
}

const (
	protoMethod = "/tensorbench.Bytes/Get"
	echoMethod  = "/tensorbench.Bytes/Echo"
	fbMethod    = "/tensorbench.FlatBuffers/Get"
)

// bytesService returns payload[:n] for a request of n, in a protobuf
// BytesValue (a message whose only field is `bytes value = 1`); its Echo
// method returns the BytesValue of the request, the same bytes.
func bytesService(payload []byte) *grpc.ServiceDesc {
	return &grpc.ServiceDesc{
		ServiceName: "tensorbench.Bytes",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Get",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var req wrapperspb.UInt64Value
				if err := dec(&req); err != nil {
					return nil, err
				}
				if req.Value > uint64(len(payload)) {
					return nil, status.Errorf(codes.OutOfRange, "asked for %d bytes of %d", req.Value, len(payload))
				}
				return &wrapperspb.BytesValue{Value: payload[:req.Value]}, nil
			},
		}, {
			MethodName: "Echo",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var req wrapperspb.BytesValue
				if err := dec(&req); err != nil {
					return nil, err
				}
				return &wrapperspb.BytesValue{Value: req.Value}, nil
			},
		}},
	}
}

// flatBuffersService encodes payload[:n] into a tensorfb.Tensor for every
// request: the copy into the builder is the FlatBuffers encoding cost.
func flatBuffersService(payload []byte, dtype zerocopy.DType, builders *fbcodec.BuilderPool) *grpc.ServiceDesc {
	return &grpc.ServiceDesc{
		ServiceName: "tensorbench.FlatBuffers",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Get",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var f fbcodec.Frame
				if err := dec(&f); err != nil {
					return nil, err
				}
				req := tensorfb.GetRootAsFetchRequest(f.Bytes(), 0)
				n := req.Size()
				f.Free()
				if n > uint64(len(payload)) {
					return nil, status.Errorf(codes.OutOfRange, "asked for %d bytes of %d", n, len(payload))
				}
				b := builders.Get(int(n) + fbSlack)
				encodeTensorFB(b.Builder, tensorKey, uint8(dtype), shapeOf(int(n), dtype), payload[:n])
				return b, nil
			},
		}},
	}
}

// fbSlack is room in a builder for a tensor's fields beside its bytes.
const fbSlack = 4096

// encodeTensorFB encodes one tensorfb.Tensor into b, which must be reset.
func encodeTensorFB(b *flatbuffers.Builder, key string, dtype uint8, shape []int64, data []byte) {
	dataOff := b.CreateByteVector(data)
	keyOff := b.CreateString(key)
	tensorfb.TensorStartShapeVector(b, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		b.PrependInt64(shape[i])
	}
	shapeOff := b.EndVector(len(shape))
	tensorfb.TensorStart(b)
	tensorfb.TensorAddKey(b, keyOff)
	tensorfb.TensorAddDtype(b, dtype)
	tensorfb.TensorAddShape(b, shapeOff)
	tensorfb.TensorAddData(b, dataOff)
	b.FinishWithFileIdentifier(tensorfb.TensorEnd(b), []byte("TBT1"))
}

type grpcSession struct {
	settings grpcSettings
	size     int
	data     []byte // the payload: what an echo stream sends
	server   *grpc.Server
	conn     *grpc.ClientConn
}

func openGRPC(g grpcSettings) func(context.Context, *caseEnv) (session, error) {
	return func(_ context.Context, env *caseEnv) (session, error) {
		s := &grpcSession{settings: g, size: len(env.data), data: env.data}
		s.server = grpc.NewServer(g.serverOptions()...)
		if g.flatbuf {
			s.server.RegisterService(flatBuffersService(env.data, env.payload.DType, &fbcodec.BuilderPool{}), struct{}{})
		} else {
			s.server.RegisterService(bytesService(env.data), struct{}{})
		}
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		go s.server.Serve(lis)
		s.conn, err = grpc.NewClient(lis.Addr().String(), g.dialOptions()...)
		if err != nil {
			s.server.Stop()
			return nil, err
		}
		return s, nil
	}
}

func (s *grpcSession) transport() string {
	switch {
	case s.settings.flatbuf:
		return "grpc+flatbuffers"
	case s.settings.compressor != "":
		return "grpc+proto+" + s.settings.compressor
	case s.settings.echo:
		return "grpc+proto+echo"
	}
	return "grpc+proto"
}

func (s *grpcSession) close() error {
	err := s.conn.Close()
	s.server.Stop()
	return err
}

// newStream is one goroutine issuing calls: streams share the session's
// HTTP/2 connection, as concurrent calls on one ClientConn do.
func (s *grpcSession) newStream() (stream, error) {
	if s.settings.flatbuf {
		return &fbStream{s: s, req: flatbuffers.NewBuilder(64)}, nil
	}
	if s.settings.echo {
		return &echoStream{s: s, req: &wrapperspb.BytesValue{Value: s.data}}, nil
	}
	return &protoStream{s: s}, nil
}

// echoStream sends the payload in a protobuf bytes field and receives it
// back in another.
type echoStream struct {
	s    *grpcSession
	req  *wrapperspb.BytesValue
	last []byte
}

func (e *echoStream) do(ctx context.Context) error {
	e.last = nil
	var resp wrapperspb.BytesValue
	if err := e.s.conn.Invoke(ctx, echoMethod, e.req, &resp); err != nil {
		return err
	}
	if len(resp.Value) != e.s.size {
		return fmt.Errorf("protobuf reply carries %d bytes, want %d", len(resp.Value), e.s.size)
	}
	e.last = resp.Value
	return nil
}

func (e *echoStream) received() []byte { return e.last }
func (e *echoStream) close() error     { return nil }

// protoStream receives the tensor in a protobuf bytes field.
type protoStream struct {
	s    *grpcSession
	last []byte
}

func (p *protoStream) do(ctx context.Context) error {
	p.last = nil
	var resp wrapperspb.BytesValue
	if err := p.s.conn.Invoke(ctx, protoMethod, wrapperspb.UInt64(uint64(p.s.size)), &resp); err != nil {
		return err
	}
	if len(resp.Value) != p.s.size {
		return fmt.Errorf("protobuf reply carries %d bytes, want %d", len(resp.Value), p.s.size)
	}
	p.last = resp.Value
	return nil
}

func (p *protoStream) received() []byte { return p.last }
func (p *protoStream) close() error     { return nil }

// fbStream receives the tensor in a FlatBuffers vector, read in place in
// the received frame; the stream keeps the last frame until its next
// transfer, for the check.
type fbStream struct {
	s     *grpcSession
	req   *flatbuffers.Builder
	frame fbcodec.Frame
	data  []byte
}

func (f *fbStream) free() {
	f.frame.Free()
	f.data = nil
}

func (f *fbStream) do(ctx context.Context) error {
	f.free()
	req := f.req
	req.Reset()
	key := req.CreateString(tensorKey)
	tensorfb.FetchRequestStart(req)
	tensorfb.FetchRequestAddKey(req, key)
	tensorfb.FetchRequestAddSize(req, uint64(f.s.size))
	req.Finish(tensorfb.FetchRequestEnd(req))
	if err := f.s.conn.Invoke(ctx, fbMethod, req, &f.frame); err != nil {
		return err
	}
	data := tensorfb.GetRootAsTensor(f.frame.Bytes(), 0).DataBytes()
	if got := len(data); got != f.s.size {
		f.free()
		return fmt.Errorf("flatbuffers reply carries %d bytes, want %d", got, f.s.size)
	}
	f.data = data
	return nil
}

func (f *fbStream) received() []byte { return f.data }

func (f *fbStream) close() error {
	f.free()
	return nil
}
