package rpc_test

import (
	"context"

	"fmt"
	"google.golang.org/grpc/credentials/insecure"
	"net"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Example is the README's usage example.
func Example() {
	ctx := context.Background()
	srv, _ := rpc.NewServer()
	lis, _ := net.Listen("tcp", "127.0.0.1:0")
	go srv.Serve(lis)
	defer srv.Stop()

	w, _ := srv.NewTensor(ctx, zerocopy.Float32, []int64{1024, 1024})
	v, _ := zerocopy.View[float32](w.Tensor)
	for i := range v {
		v[i] = 0.5
	}
	srv.Publish(context.Background(), "weights", w)
	w.Release()
	srv.Handle("norm", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		v, _ := zerocopy.View[float32](req.Tensors[0].Tensor)
		s := float32(0)
		for _, x := range v {
			s += x * x
		}
		out, _ := zerocopy.FromSlice([]float32{s})
		return &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(out)}}, nil
	})

	c, _ := rpc.Dial(ctx, lis.Addr().String(), rpc.WithTransportCredentials(insecure.NewCredentials()))
	defer c.Close()
	t, _ := c.Fetch(ctx, "weights")
	reply, _ := c.Call(ctx, "norm", &rpc.Message{Tensors: []*rpc.Tensor{t}})
	sum, _ := zerocopy.View[float32](reply.Tensors[0].Tensor)
	fmt.Println(sum[0])
	reply.Release()
	t.Release()
	// Output: 262144
}
