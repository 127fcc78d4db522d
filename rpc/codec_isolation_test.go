package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"reflect"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestGRPCProtoCodecUntouched: importing rpc leaves gRPC's process-wide
// "proto" codec grpc-go's own, and an ordinary protobuf service (health)
// in the same process works, on a grpc.Server of its own and on one that
// also serves tensorrpc, while tensors move over the grpc fallback.
func TestGRPCProtoCodecUntouched(t *testing.T) {
	pc := encoding.GetCodecV2("proto")
	if pc == nil {
		t.Fatal(`no "proto" codec registered`)
	}
	if _, ok := pc.(chunkcodec.Codec); ok {
		t.Fatalf(`the "proto" codec is %T: importing rpc replaced it`, pc)
	}
	typ := reflect.TypeOf(pc)
	if typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	if pkg := typ.PkgPath(); pkg != "google.golang.org/grpc/encoding/proto" || pc.Name() != "proto" {
		t.Fatalf(`the "proto" codec is %T (%q) from %q, want grpc-go's own`, pc, pc.Name(), pkg)
	}
	if b, err := pc.Marshal(&chunkcodec.OutChunk{}); err == nil {
		b.Free()
		t.Fatal(`the "proto" codec marshals a chunkcodec.OutChunk`)
	}
	if _, ok := encoding.GetCodecV2(chunkcodec.Name).(chunkcodec.Codec); !ok {
		t.Fatalf("content-subtype %q: %T, want chunkcodec.Codec", chunkcodec.Name, encoding.GetCodecV2(chunkcodec.Name))
	}

	// An ordinary protobuf service on its own grpc.Server.
	hs := health.NewServer()
	hs.SetServingStatus("other", healthpb.HealthCheckResponse_NOT_SERVING)
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	lis := listen(t)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	defer func() { gs.Stop(); <-served }()
	hcc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hcc.Close()
	checkHealth := func(ctx context.Context, cc *grpc.ClientConn) error {
		hc := healthpb.NewHealthClient(cc)
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			return err
		}
		if r.Status != healthpb.HealthCheckResponse_SERVING {
			return errors.New("overall status " + r.Status.String())
		}
		r, err = hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "other"})
		if err != nil {
			return err
		}
		if r.Status != healthpb.HealthCheckResponse_NOT_SERVING {
			return errors.New("other: status " + r.Status.String())
		}
		if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "missing"}); status.Code(err) != codes.NotFound {
			return errors.New("missing service: " + err.Error())
		}
		return nil
	}

	var codecs streamCodecs
	s, c := pair(t, rpc.TransportGRPC, []rpc.ServerOption{rpc.WithGRPCServerOptions(grpc.StreamInterceptor(codecs.record))}, nil)
	s.Handle("reverse", echoReverse)
	ctx := ctxT(t)

	// Health checks run throughout the tensor traffic.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var checks int
	var healthErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			if err := checkHealth(ctx, hcc); err != nil {
				healthErr = err
				return
			}
			checks++
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()

	in := wrapped(t, 3<<20+17, 11)
	if err := c.Send(ctx, "in", in); err != nil {
		t.Fatal(err)
	}
	got, err := s.Take(ctx, "in")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatal("sent tensor differs")
	}
	got.Release()
	out := wrapped(t, 2<<20+5, 12)
	if err := s.Publish(context.Background(), "out", out); err != nil {
		t.Fatal(err)
	}
	fetched, err := c.Fetch(ctx, "out")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fetched.Bytes(), out.Bytes()) {
		t.Fatal("fetched tensor differs")
	}
	fetched.Release()
	s.Unpublish("out")
	reply, err := c.Call(ctx, "reverse", &rpc.Message{Metadata: []byte("ab"), Tensors: []*rpc.Tensor{in}})
	if err != nil {
		t.Fatal(err)
	}
	if string(reply.Metadata) != "ba" || len(reply.Tensors) != 1 || !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
		t.Fatal("call reply differs")
	}
	reply.Release()
	if st := c.Stats(); st.StreamBytes < 2*int64(len(in.Bytes()))+int64(len(out.Bytes())) {
		t.Fatalf("client moved %d bytes over the fallback streams", st.StreamBytes)
	}
	codecs.check(t, true) // our client: the zero-copy codec on every fallback stream
	close(stop)
	wg.Wait()
	if healthErr != nil {
		t.Fatalf("health service during tensor traffic: %v", healthErr)
	}
	if checks == 0 {
		t.Fatal("no health check ran")
	}

	// Health and tensorrpc on one grpc.Server, over one ClientConn.
	s2, err := rpc.NewServer(rpc.WithTransports(rpc.TransportGRPC), testPool())
	if err != nil {
		t.Fatal(err)
	}
	gs2 := grpc.NewServer()
	healthpb.RegisterHealthServer(gs2, hs)
	s2.Register(gs2)
	lis2 := listen(t)
	served2 := make(chan error, 1)
	go func() { served2 <- gs2.Serve(lis2) }()
	cc2, err := grpc.NewClient(lis2.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c2, err := rpc.NewClient(ctx, cc2, rpc.WithTransports(rpc.TransportGRPC), testPool())
	if err != nil {
		t.Fatal(err)
	}
	if err := c2.Send(ctx, "in", in); err != nil {
		t.Fatal(err)
	}
	if err := checkHealth(ctx, cc2); err != nil {
		t.Fatalf("health on the tensorrpc server: %v", err)
	}
	got, err = s2.Take(ctx, "in")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatal("sent tensor differs (shared grpc.Server)")
	}
	got.Release()
	if err := c2.Close(); err != nil {
		t.Fatal(err)
	}
	cc2.Close()
	gs2.Stop()
	<-served2
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
	if st := s2.Pool().Stats(); st.InUse != 0 {
		t.Errorf("shared server pool: %d bytes still in use", st.InUse)
	}
}

// TestGRPCPlainProtoClient drives a Server's fallback streams the way a
// client with only tensorrpc.proto does: a generated client over a
// ClientConn with gRPC's default proto codec (content-type
// application/grpc, and application/grpc+proto), a session opened by
// hand, and Chunks of a size of its own choosing.
func TestGRPCPlainProtoClient(t *testing.T) {
	for _, v := range []struct {
		name string
		opts []grpc.CallOption
	}{
		{"default", nil},
		{"content-subtype proto", []grpc.CallOption{grpc.CallContentSubtype("proto")}},
	} {
		t.Run(v.name, func(t *testing.T) { testPlainProtoClient(t, v.opts) })
	}
}

func testPlainProtoClient(t *testing.T, opts []grpc.CallOption) {
	var codecs streamCodecs
	s, err := rpc.NewServer(rpc.WithTransports(rpc.TransportGRPC), testPool(), rpc.WithGRPCServerOptions(grpc.StreamInterceptor(codecs.record)))
	if err != nil {
		t.Fatal(err)
	}
	s.Handle("reverse", echoReverse)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(opts...))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		cc.Close()
		s.Stop()
		<-served
		if st := s.Pool().Stats(); st.InUse != 0 {
			t.Errorf("server pool: %d bytes still in use", st.InUse)
		}
		leakcheck.Check(t)
	}()
	ctx := ctxT(t)
	api := pb.NewTensorRPCClient(cc)

	// The session, as tensorrpc.proto describes it: a handshake offering no
	// data plane, answered by a handshake and a choice of TRANSPORT_GRPC.
	sctx, endSession := context.WithCancel(ctx)
	defer endSession()
	sess, err := api.Session(sctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{
		ProtocolVersion: rpc.ProtocolVersion, ClientName: "plain-proto"}}}); err != nil {
		t.Fatal(err)
	}
	r, err := sess.Recv()
	if err != nil {
		t.Fatal(err)
	}
	id := r.GetHandshake().GetSessionId()
	if id == "" {
		t.Fatalf("handshake response %v", r)
	}
	if r, err = sess.Recv(); err != nil || r.GetChoice().GetTransport() != pb.Transport_TRANSPORT_GRPC {
		t.Fatalf("choice %v, %v; want TRANSPORT_GRPC", r, err)
	}

	// SendStream: a float32 tensor of a few MiB in odd-sized chunks.
	const n = 3<<20/4 + 1001
	payload := make([]byte, 4*n)
	pattern(payload, 21)
	meta := &pb.TensorMeta{Key: "in", Dtype: pb.DType_DTYPE_FLOAT32, Shape: []int64{n}, ByteLength: uint64(len(payload))}
	ss, err := api.SendStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ss.Send(&pb.Chunk{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{meta}}}); err != nil {
		t.Fatal(err)
	}
	for off := 0; off < len(payload); off += 777777 {
		if err := ss.Send(&pb.Chunk{Data: payload[off:min(off+777777, len(payload))]}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ss.CloseAndRecv(); err != nil {
		t.Fatalf("SendStream: %v", err)
	}
	got, err := s.Take(ctx, "in")
	if err != nil {
		t.Fatal(err)
	}
	if got.DType() != zerocopy.Float32 || len(got.Shape()) != 1 || got.Shape()[0] != n || !bytes.Equal(got.Bytes(), payload) {
		t.Fatalf("server received %v, or its bytes differ", got)
	}
	got.Release()

	// FetchStream of a published tensor.
	out := wrapped(t, 5<<20+3, 22)
	if err := s.Publish(context.Background(), "out", out); err != nil {
		t.Fatal(err)
	}
	fs, err := api.FetchStream(ctx, &pb.FetchRequest{SessionId: id, Key: "out"})
	if err != nil {
		t.Fatal(err)
	}
	first, err := fs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if h := first.GetHeader(); len(first.Data) != 0 || len(h.GetTensors()) != 1 || h.Tensors[0].ByteLength != uint64(len(out.Bytes())) || h.Tensors[0].Key != "out" {
		t.Fatalf("first chunk %v", first)
	}
	var fetched []byte
	for {
		ch, err := fs.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if ch.Header != nil || len(ch.Data) == 0 || len(ch.Data) > fallback.ChunkSize {
			t.Fatalf("data chunk with header %v and %d bytes", ch.Header, len(ch.Data))
		}
		fetched = append(fetched, ch.Data...)
	}
	if !bytes.Equal(fetched, out.Bytes()) {
		t.Fatalf("fetched %d bytes, differ from the %d published", len(fetched), len(out.Bytes()))
	}
	s.Unpublish("out")

	// CallStream: request and reply.
	cs, err := api.CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := cs.Send(&pb.Chunk{Header: &pb.ChunkHeader{Method: "reverse", Metadata: []byte("xy"), Tensors: []*pb.TensorMeta{meta}}}); err != nil {
		t.Fatal(err)
	}
	if err := cs.Send(&pb.Chunk{Data: payload}); err != nil {
		t.Fatal(err)
	}
	if err := cs.CloseSend(); err != nil {
		t.Fatal(err)
	}
	first, err = cs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if h := first.GetHeader(); string(h.GetMetadata()) != "yx" || len(h.GetTensors()) != 1 || h.Tensors[0].ByteLength != uint64(len(payload)) {
		t.Fatalf("reply header %v", first)
	}
	var replied []byte
	for {
		ch, err := cs.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		replied = append(replied, ch.Data...)
	}
	if !bytes.Equal(replied, payload) {
		t.Fatal("call reply bytes differ")
	}

	codecs.check(t, false) // the server saw proto clients

	// The error paths are the same as for our own clients.
	sendBad := func(chunks ...*pb.Chunk) error {
		ss, err := api.SendStream(ctx)
		if err != nil {
			return err
		}
		for _, c := range chunks {
			if err := ss.Send(c); err != nil {
				break // the status comes from CloseAndRecv
			}
		}
		_, err = ss.CloseAndRecv()
		return err
	}
	hdr := &pb.Chunk{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{{Key: "bad", Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{8}, ByteLength: 8}}}}
	for name, c := range map[string][]*pb.Chunk{
		"short":         {hdr, {Data: make([]byte, 7)}},
		"long":          {hdr, {Data: make([]byte, 9)}},
		"second header": {hdr, hdr},
		"data first":    {{Data: make([]byte, 8)}},
		"header data":   {{Header: hdr.Header, Data: make([]byte, 8)}},
		"two tensors":   {{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{meta, meta}}}},
	} {
		if err := sendBad(c...); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	if s.Unpublish("bad") {
		t.Error("a malformed stream published its tensor")
	}

	// End the session: close the stream and wait for the server's end.
	if err := sess.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Recv(); err != io.EOF {
		t.Fatalf("session end: %v", err)
	}
	if st := s.Stats(); st.StreamBytes < int64(3*len(payload)+len(out.Bytes())) {
		t.Errorf("server moved %d bytes over the fallback streams", st.StreamBytes)
	}
}

// streamCodecs records, per fallback method, whether the server saw the
// chunkcodec content-subtype on its streams (chunkcodec.Incoming).
type streamCodecs struct {
	mu   sync.Mutex
	seen map[string][]bool
}

func (sc *streamCodecs) record(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	sc.mu.Lock()
	if sc.seen == nil {
		sc.seen = map[string][]bool{}
	}
	sc.seen[info.FullMethod] = append(sc.seen[info.FullMethod], chunkcodec.Incoming(ss.Context()))
	sc.mu.Unlock()
	return h(srv, ss)
}

// check fails unless each fallback method ran, every time with the
// chunkcodec codec (want) or every time without.
func (sc *streamCodecs) check(t *testing.T, want bool) {
	t.Helper()
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for _, m := range []string{pb.TensorRPC_FetchStream_FullMethodName, pb.TensorRPC_SendStream_FullMethodName, pb.TensorRPC_CallStream_FullMethodName} {
		if len(sc.seen[m]) == 0 {
			t.Errorf("%s: no stream", m)
		}
		for _, got := range sc.seen[m] {
			if got != want {
				t.Errorf("%s: chunkcodec content-subtype %v, want %v", m, got, want)
			}
		}
	}
	if got := sc.seen[pb.TensorRPC_Session_FullMethodName]; len(got) == 0 || got[0] {
		t.Errorf("session stream: chunkcodec content-subtype %v, want a stream without it", got)
	}
}
