package rpc_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// BenchmarkGRPCOptions measures what ordinary gRPC options cost the fast
// path: 4 KiB Fetch and Call p50 with one harmless option and a
// pass-through interceptor on each side, against default options, in the
// same run (calls alternate between the two pairs in rounds, so drift in
// the machine's speed hits both alike):
//
//	go test -run xxx -bench GRPCOptions -benchtime 4000x ./rpc/
//
// It reports each side's p50 in µs and their ratio (options/default; 1.0
// means the options cost nothing).
func BenchmarkGRPCOptions(b *testing.B) {
	pass := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		return h(ctx, req)
	}
	passClient := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	withOpts := func(plane string) endpoints {
		return start(b, plane,
			[]rpc.ServerOption{rpc.WithGRPCServerOptions(grpc.MaxRecvMsgSize(64<<20), grpc.ChainUnaryInterceptor(pass))},
			[]rpc.DialOption{rpc.WithGRPCDialOptions(grpc.WithUserAgent("bench/1"), grpc.WithChainUnaryInterceptor(passClient))})
	}
	for _, plane := range []string{rpc.TransportSHM, rpc.TransportTCP} {
		for _, op := range []string{"Fetch", "Call"} {
			b.Run(fmt.Sprintf("%s/%s-4KiB", plane, op), func(b *testing.B) {
				pairs := []endpoints{start(b, plane, nil, nil), withOpts(plane)}
				calls := make([]func() error, len(pairs))
				for i, e := range pairs {
					ctx := context.Background()
					x, err := e.srv.NewTensor(ctx, zerocopy.Uint8, []int64{4 << 10})
					if err != nil {
						b.Fatal(err)
					}
					e.srv.Publish(ctx, "x", x)
					e.srv.Handle("echo", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
						return &rpc.Message{Tensors: req.Tensors}, nil
					})
					arg, err := e.c.NewTensor(ctx, zerocopy.Uint8, []int64{4 << 10})
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { x.Release(); arg.Release() })
					c := e.c
					calls[i] = func() error {
						t, err := c.Fetch(ctx, "x")
						if err == nil {
							t.Release()
						}
						return err
					}
					if op == "Call" {
						calls[i] = func() error {
							m, err := c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{arg}})
							if err == nil {
								m.Release()
							}
							return err
						}
					}
					for range 200 { // warm up
						if err := calls[i](); err != nil {
							b.Fatal(err)
						}
					}
				}
				lat := make([][]time.Duration, len(pairs))
				const round = 100
				b.ResetTimer()
				for done := 0; done < b.N; done += round {
					for i, call := range calls {
						for range min(round, b.N-done) {
							t0 := time.Now()
							if err := call(); err != nil {
								b.Fatal(err)
							}
							lat[i] = append(lat[i], time.Since(t0))
						}
					}
				}
				b.StopTimer()
				p50 := func(d []time.Duration) float64 {
					slices.Sort(d)
					return float64(d[len(d)/2].Nanoseconds()) / 1e3
				}
				def, opt := p50(lat[0]), p50(lat[1])
				b.ReportMetric(def, "default-p50-µs")
				b.ReportMetric(opt, "options-p50-µs")
				b.ReportMetric(opt/def, "ratio")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
