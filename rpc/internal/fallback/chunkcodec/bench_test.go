package chunkcodec

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

const (
	benchPayload = 64 << 20
	benchChunk   = 1 << 20
)

// BenchmarkStream streams 64 MiB in 1 MiB chunks from a client to a server
// over loopback gRPC, one stream per iteration, and waits for the server's
// byte count. raw: OutChunk/InChunk through this codec on both sides.
// proto: tensorrpcpb.Chunk through grpc-go's stock protobuf codec.
// raw,unbuffered: raw with gRPC's read and write buffers disabled (no
// user-space copy in the transport, more syscalls). tcp: the same bytes
// over a bare loopback TCP connection, the ceiling.
func BenchmarkStream(b *testing.B) {
	defer leakcheck.Check(b)
	payload := randBytes(benchPayload, 1)
	variants := []struct {
		name   string
		raw    bool
		server []grpc.ServerOption
		client []grpc.DialOption
	}{
		{"codec=raw", true, nil, nil},
		{"codec=proto", false, nil, nil},
		{"codec=raw,unbuffered", true,
			[]grpc.ServerOption{grpc.ReadBufferSize(0), grpc.WriteBufferSize(0)},
			[]grpc.DialOption{grpc.WithReadBufferSize(0), grpc.WithWriteBufferSize(0)}},
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			// The server runs this codec either way; for SinkProto it
			// hands tensorrpcpb.Chunk to the stock codec it wraps.
			addr, stop := startServer(b, append(v.server, grpc.ForceServerCodecV2(New(nil)))...)
			defer stop()
			opts := append(v.client, grpc.WithDefaultCallOptions(grpc.ForceCodecV2(clientCodec(v.raw))))
			conn := dial(b, addr, opts...)
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			if err := sink(ctx, conn, v.raw, payload[:benchChunk], benchChunk, nil); err != nil { // warm up
				b.Fatal(err)
			}
			b.SetBytes(benchPayload)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if err := sink(ctx, conn, v.raw, payload, benchChunk, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("tcp", func(b *testing.B) { benchTCP(b, payload) })
}

// clientCodec is this codec for raw and grpc-go's stock protobuf codec
// otherwise, so the proto variant measures plain gRPC exactly.
func clientCodec(raw bool) encoding.CodecV2 {
	if raw {
		return New(nil)
	}
	return stockProto
}

// benchTCP writes the payload in 1 MiB writes to a loopback TCP socket
// whose reader reads into a 1 MiB buffer, then waits for a 1-byte ack.
func benchTCP(b *testing.B, payload []byte) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := lis.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, benchChunk)
		for {
			for n := 0; n < len(payload); {
				k, err := c.Read(buf[:min(len(buf), len(payload)-n)])
				if err != nil {
					return
				}
				n += k
			}
			if _, err := c.Write([]byte{1}); err != nil {
				return
			}
		}
	}()
	defer func() {
		lis.Close()
		wg.Wait()
	}()
	c, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	ack := make([]byte, 1)
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		for off := 0; off < len(payload); off += benchChunk {
			if _, err := c.Write(payload[off : off+benchChunk]); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := io.ReadFull(c, ack); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMarshal and BenchmarkUnmarshal time the codec alone on one
// 1 MiB chunk split into 16 KiB buffers, as gRPC delivers it.
func BenchmarkMarshal(b *testing.B) {
	data := mem.BufferSlice{Wrap(randBytes(benchChunk, 2), nil)}
	oc := &OutChunk{Header: testHeader(), Data: data}
	codec := New(nil)
	b.SetBytes(benchChunk)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		out, err := codec.Marshal(oc)
		if err != nil {
			b.Fatal(err)
		}
		out.Free()
	}
}

func BenchmarkUnmarshal(b *testing.B) {
	wire, _ := proto.Marshal(&tensorrpcpb.Chunk{Header: testHeader(), Data: randBytes(benchChunk, 3)})
	var in mem.BufferSlice
	for off := 0; off < len(wire); off += 16384 {
		in = append(in, mem.SliceBuffer(wire[off:min(off+16384, len(wire))]))
	}
	for _, bc := range []struct {
		name string
		run  func() error
	}{
		{"codec=raw", func() error {
			var ic InChunk
			err := New(nil).Unmarshal(in, &ic)
			ic.Free()
			return err
		}},
		{"codec=proto", func() error {
			var c tensorrpcpb.Chunk
			return stockProto.Unmarshal(in, &c)
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(benchChunk)
			b.ReportAllocs()
			for range b.N {
				if err := bc.run(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
