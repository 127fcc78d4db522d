package chunkcodec

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// The test service, written by hand as a client with only a .proto could
// describe it:
//
//	service Echo {
//	  rpc Unary(FetchRequest) returns (FetchResponse);
//	  rpc Echo(stream Chunk) returns (stream Chunk);      // sends every chunk back
//	  rpc SinkRaw(stream Chunk) returns (stream Chunk);   // counts bytes, replies once
//	  rpc SinkProto(stream Chunk) returns (stream Chunk); // same, via tensorrpcpb.Chunk
//	  rpc EchoAny(stream Chunk) returns (stream Chunk);   // Echo through ServerStream
//	}
const svcName = "tensorrpc.chunkcodec.test.Echo"

var testDesc = grpc.ServiceDesc{
	ServiceName: svcName,
	HandlerType: (*any)(nil),
	Methods:     []grpc.MethodDesc{{MethodName: "Unary", Handler: unaryHandler}},
	Streams: []grpc.StreamDesc{
		{StreamName: "Echo", Handler: echoHandler, ServerStreams: true, ClientStreams: true},
		{StreamName: "SinkRaw", Handler: sinkRawHandler, ServerStreams: true, ClientStreams: true},
		{StreamName: "SinkProto", Handler: sinkProtoHandler, ServerStreams: true, ClientStreams: true},
		{StreamName: "EchoAny", Handler: echoAnyHandler, ServerStreams: true, ClientStreams: true},
	},
}

func method(i int) (*grpc.StreamDesc, string) {
	return &testDesc.Streams[i], "/" + svcName + "/" + testDesc.Streams[i].StreamName
}

func unaryHandler(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
	var req tensorrpcpb.FetchRequest
	if err := dec(&req); err != nil {
		return nil, err
	}
	return &tensorrpcpb.FetchResponse{InlineData: []byte(req.Key), TransferId: 42}, nil
}

// echoHandler sends every chunk back as it arrives, forwarding the received
// buffers without a copy, and checks the bytes against the CRC32C and
// length that the header announced.
func echoHandler(_ any, stream grpc.ServerStream) error {
	var want *tensorrpcpb.TensorMeta
	var crc uint32
	var total uint64
	for {
		var in InChunk
		err := stream.RecvMsg(&in)
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if in.Header != nil && len(in.Header.Tensors) > 0 {
			want = in.Header.Tensors[0]
		}
		for _, b := range in.Data {
			crc = crc32.Update(crc, castagnoli, b.ReadOnlyData())
		}
		total += uint64(in.Len())
		err = stream.SendMsg(&OutChunk{Header: in.Header, Data: in.Data})
		in.Free()
		if err != nil {
			return err
		}
	}
	if want == nil {
		return status.Error(codes.InvalidArgument, "no header")
	}
	if total != want.ByteLength || crc != want.GetCrc32C() {
		return status.Errorf(codes.DataLoss, "server got %d bytes crc %08x, header says %d bytes crc %08x",
			total, crc, want.ByteLength, want.GetCrc32C())
	}
	return nil
}

// echoAnyHandler is echoHandler through ServerStream, so that it serves
// clients of either codec; it names the codec it saw in the response
// header "x-codec".
func echoAnyHandler(srv any, stream grpc.ServerStream) error {
	codec := "proto"
	if Incoming(stream.Context()) {
		codec = Name
	}
	if err := stream.SetHeader(metadata.Pairs("x-codec", codec)); err != nil {
		return err
	}
	return echoHandler(srv, ServerStream(stream))
}

func sinkReply(total uint64) *tensorrpcpb.ChunkHeader {
	return &tensorrpcpb.ChunkHeader{Tensors: []*tensorrpcpb.TensorMeta{{ByteLength: total}}}
}

func sinkRawHandler(_ any, stream grpc.ServerStream) error {
	var total uint64
	for {
		var in InChunk
		err := stream.RecvMsg(&in)
		if err == io.EOF {
			return stream.SendMsg(&OutChunk{Header: sinkReply(total)})
		}
		if err != nil {
			return err
		}
		total += uint64(in.Len())
		in.Free()
	}
}

func sinkProtoHandler(_ any, stream grpc.ServerStream) error {
	var total uint64
	for {
		var in tensorrpcpb.Chunk
		err := stream.RecvMsg(&in)
		if err == io.EOF {
			return stream.SendMsg(&tensorrpcpb.Chunk{Header: sinkReply(total)})
		}
		if err != nil {
			return err
		}
		total += uint64(len(in.Data))
	}
}

// startServer serves the test service on a loopback port until stop.
func startServer(tb testing.TB, opts ...grpc.ServerOption) (addr string, stop func()) {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	s := grpc.NewServer(opts...)
	s.RegisterService(&testDesc, struct{}{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := s.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			tb.Errorf("Serve: %v", err)
		}
	}()
	return lis.Addr().String(), func() {
		s.Stop()
		wg.Wait()
	}
}

func dial(tb testing.TB, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return conn
}

// sink streams payload in chunks of chunkSize to SinkRaw (raw) or SinkProto
// and checks the byte count the server replies with.
func sink(ctx context.Context, conn *grpc.ClientConn, raw bool, payload []byte, chunkSize int, release func()) error {
	m := 2
	if raw {
		m = 1
	}
	desc, name := method(m)
	stream, err := conn.NewStream(ctx, desc, name)
	if err != nil {
		return err
	}
	for off := 0; off < len(payload); off += chunkSize {
		p := payload[off:min(off+chunkSize, len(payload))]
		if raw {
			oc := &OutChunk{Data: mem.BufferSlice{Wrap(p, release)}}
			err = stream.SendMsg(oc)
			oc.Free()
		} else {
			err = stream.SendMsg(&tensorrpcpb.Chunk{Data: p})
		}
		if err != nil {
			return err
		}
	}
	if err := stream.CloseSend(); err != nil {
		return err
	}
	var got uint64
	if raw {
		var in InChunk
		err = stream.RecvMsg(&in)
		in.Free()
		if in.Header != nil && len(in.Header.Tensors) == 1 {
			got = in.Header.Tensors[0].ByteLength
		}
	} else {
		var in tensorrpcpb.Chunk
		err = stream.RecvMsg(&in)
		got = in.GetHeader().GetTensors()[0].GetByteLength()
	}
	if err != nil {
		return err
	}
	if got != uint64(len(payload)) {
		return fmt.Errorf("server counted %d bytes, sent %d", got, len(payload))
	}
	if err := stream.RecvMsg(new(tensorrpcpb.Chunk)); err != io.EOF {
		return fmt.Errorf("after the reply: %v, want EOF", err)
	}
	return nil
}
