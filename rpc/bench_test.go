package rpc_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Benchmarks of the rpc data paths beside the ceilings of the machine,
// measured in the same run:
//
//	go test -run xxx -bench . -benchtime 20x ./rpc/
//
// memcpy and a raw loopback TCP socket are the ceilings; plain is a grpc-go
// unary call returning the bytes in a protobuf bytes field.

var benchSizes = []int{4 << 10, 1 << 20, 64 << 20, 1 << 30}

func sizeName(n int) string { return strings.ReplaceAll(bytesize.Format(int64(n)), " ", "") }

func benchPair(b *testing.B, transport string, opts ...rpc.ServerOption) (*rpc.Server, *rpc.Client, func()) {
	skipWithoutDevice(b, transport)
	ts := []string{transport}
	s, err := rpc.NewServer(append([]rpc.ServerOption{rpc.WithTransports(ts...), testPool()}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go s.Serve(lis)
	c, err := rpc.Dial(context.Background(), lis.Addr().String(), rpc.WithTransports(ts...), testPool(), insecureCreds())
	if err != nil {
		b.Fatal(err)
	}
	return s, c, func() { c.Close(); s.Stop() }
}

// fetchPair starts a pair on tr whose server publishes n bytes as "x",
// warms the client's Fetch of it up and sets b's bytes per op.
func fetchPair(b *testing.B, tr string, n int) (*rpc.Client, func()) {
	s, c, done := benchPair(b, tr)
	t, err := s.NewTensor(context.Background(), zerocopy.Uint8, []int64{int64(n)})
	if err != nil {
		done()
		b.Fatal(err)
	}
	fill(t.Bytes(), 1)
	s.Publish(context.Background(), "x", t)
	t.Release()
	warmUp(b, func() error { return fetchOnce(c, "x") })
	b.SetBytes(int64(n))
	return c, done
}

func BenchmarkFetch(b *testing.B) {
	for _, tr := range testTransports {
		for _, n := range benchSizes {
			b.Run(tr+"/"+sizeName(n), func(b *testing.B) {
				c, done := fetchPair(b, tr, n)
				defer done()
				ctx := context.Background()
				for b.Loop() {
					got, err := c.Fetch(ctx, "x")
					if err != nil {
						b.Fatal(err)
					}
					got.Release()
				}
			})
		}
	}
	b.Run("shm-lease", func(b *testing.B) {
		for _, n := range benchSizes {
			b.Run(sizeName(n), func(b *testing.B) {
				s, c, done := benchPair(b, rpc.TransportSHM)
				defer done()
				ctx := context.Background()
				t, _ := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
				s.Publish(context.Background(), "x", t)
				t.Release()
				warmUp(b, func() error { return fetchOnce(c, "x", rpc.Lease()) })
				b.SetBytes(int64(n))
				for b.Loop() {
					got, err := c.Fetch(ctx, "x", rpc.Lease())
					if err != nil {
						b.Fatal(err)
					}
					if n > rpc.DefaultEagerThreshold && !got.Leased() {
						b.Fatal("not leased")
					}
					got.Release()
				}
			})
		}
	})
}

// BenchmarkFetchStreams is BenchmarkFetch with 4 concurrent streams on
// one session (2 per GOMAXPROCS on this package's 2-core machine; run it
// with -cpu to change that): where concurrent streams queue on each other,
// with -mutexprofile and -blockprofile.
func BenchmarkFetchStreams(b *testing.B) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		for _, n := range []int{4 << 10, 1 << 20} {
			b.Run(tr+"/"+sizeName(n), func(b *testing.B) {
				c, done := fetchPair(b, tr, n)
				defer done()
				ctx := context.Background()
				b.SetParallelism(max(1, 4/runtime.GOMAXPROCS(0)))
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						got, err := c.Fetch(ctx, "x")
						if err != nil {
							b.Error(err)
							return
						}
						got.Release()
					}
				})
			})
		}
	}
}

func BenchmarkSend(b *testing.B) {
	for _, tr := range testTransports {
		for _, n := range benchSizes {
			b.Run(tr+"/"+sizeName(n), func(b *testing.B) {
				s, c, done := benchPair(b, tr)
				defer done()
				ctx := context.Background()
				t, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
				if err != nil {
					b.Fatal(err)
				}
				defer t.Release()
				warmUp(b, func() error { return c.Send(ctx, "x", t) })
				b.SetBytes(int64(n))
				for b.Loop() {
					if err := c.Send(ctx, "x", t); err != nil {
						b.Fatal(err)
					}
				}
				s.Unpublish("x")
			})
		}
	}
}

// BenchmarkCall calls a method that returns its request tensor, from one
// caller and from 16 (-cpu sets GOMAXPROCS, not the callers).
func BenchmarkCall(b *testing.B) {
	for _, tr := range testTransports {
		for _, n := range []int{4 << 10, 1 << 20} {
			for _, callers := range []int{1, 16} {
				b.Run(fmt.Sprintf("%s/%s/callers=%d", tr, sizeName(n), callers), func(b *testing.B) {
					s, c, done := benchPair(b, tr)
					defer done()
					s.Handle("echo", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
						out := &rpc.Message{Tensors: in.Tensors}
						in.Tensors = nil
						return out, nil
					})
					ctx := context.Background()
					t, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
					if err != nil {
						b.Fatal(err)
					}
					defer t.Release()
					call := func() error {
						reply, err := c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{t}})
						reply.Release()
						return err
					}
					warmUp(b, call)
					b.SetBytes(2 * int64(n))
					b.SetParallelism(max(1, callers/runtime.GOMAXPROCS(0)))
					if callers == 1 {
						for b.Loop() {
							if err := call(); err != nil {
								b.Fatal(err)
							}
						}
						return
					}
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if err := call(); err != nil {
								b.Error(err)
								return
							}
						}
					})
				})
			}
		}
	}
}

// BenchmarkEagerThreshold fetches tensors around the threshold both inline
// and over the data plane, to place the threshold where the two meet.
func BenchmarkEagerThreshold(b *testing.B) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		for _, mode := range []string{"inline", "dataplane"} {
			for _, n := range []int{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20} {
				b.Run(fmt.Sprintf("%s/%s/%s", tr, mode, sizeName(n)), func(b *testing.B) {
					threshold := 0
					if mode == "inline" {
						threshold = 8 << 20
					}
					s, c, done := benchPair(b, tr, rpc.WithEagerThreshold(threshold))
					defer done()
					ctx := context.Background()
					t, _ := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
					s.Publish(context.Background(), "x", t)
					t.Release()
					warmUp(b, func() error { return fetchOnce(c, "x") })
					b.SetBytes(int64(n))
					for b.Loop() {
						got, err := c.Fetch(ctx, "x")
						if err != nil {
							b.Fatal(err)
						}
						got.Release()
					}
				})
			}
		}
	}
}

// warmUp runs op twice before timing starts, so that the pools' arenas are
// mapped and pinned and the data planes' mappings made: what a long-running
// service pays once.
func warmUp(b *testing.B, op func() error) {
	for range 2 {
		if err := op(); err != nil {
			b.Fatal(err)
		}
	}
}

func fetchOnce(c *rpc.Client, key string, opts ...rpc.FetchOption) error {
	got, err := c.Fetch(context.Background(), key, opts...)
	if err == nil {
		got.Release()
	}
	return err
}

// BenchmarkMemcpy is the ceiling of shm copy mode.
func BenchmarkMemcpy(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(sizeName(n), func(b *testing.B) {
			src, dst := make([]byte, n), make([]byte, n)
			fill(src, 1)
			fill(dst, 2)
			b.SetBytes(int64(n))
			for b.Loop() {
				copy(dst, src)
			}
		})
	}
}

// BenchmarkRawTCP moves n bytes over a loopback TCP socket and waits for a
// one-byte acknowledgement: the ceiling of the tcp data plane.
func BenchmarkRawTCP(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(sizeName(n), func(b *testing.B) {
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer lis.Close()
			go func() {
				conn, err := lis.Accept()
				if err != nil {
					return
				}
				defer conn.Close()
				buf := make([]byte, n)
				for {
					if _, err := io.ReadFull(conn, buf); err != nil {
						return
					}
					if _, err := conn.Write([]byte{1}); err != nil {
						return
					}
				}
			}()
			conn, err := net.Dial("tcp", lis.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			src := make([]byte, n)
			ack := make([]byte, 1)
			b.SetBytes(int64(n))
			for b.Loop() {
				if _, err := conn.Write(src); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(conn, ack); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// plainService is a grpc-go service that returns n bytes in a protobuf
// bytes field: what a user would write without tensorrpc.
var plainDesc = grpc.ServiceDesc{
	ServiceName: "bench.Plain",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Get",
		Handler: func(srv any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			var req pb.FetchRequest
			if err := dec(&req); err != nil {
				return nil, err
			}
			return &pb.FetchResponse{InlineData: srv.([]byte)}, nil
		},
	}},
}

func BenchmarkPlainGRPC(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(sizeName(n), func(b *testing.B) {
			gs := grpc.NewServer(grpc.MaxSendMsgSize(2 << 30))
			gs.RegisterService(&plainDesc, make([]byte, n))
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			go gs.Serve(lis)
			defer gs.Stop()
			cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(2<<30)))
			if err != nil {
				b.Fatal(err)
			}
			defer cc.Close()
			b.SetBytes(int64(n))
			for b.Loop() {
				var resp pb.FetchResponse
				if err := cc.Invoke(context.Background(), "/bench.Plain/Get", &pb.FetchRequest{Key: "x"}, &resp); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
