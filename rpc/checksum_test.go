package rpc_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestChecksumsEndToEnd: with WithChecksums on both sides every path sends
// a CRC32C and verifies it; the bytes arrive intact.
func TestChecksumsEndToEnd(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithChecksums(true)}, []rpc.DialOption{rpc.WithChecksums(true)})
			ctx := ctxT(t)
			s.Handle("echo", func(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
				out := make([]*rpc.Tensor, len(req.Tensors))
				for i, x := range req.Tensors {
					out[i] = rpc.WrapTensor(x.Tensor)
				}
				return &rpc.Message{Tensors: out}, nil
			})
			for _, n := range []int{0, 100, 1 << 20} {
				in := wrapped(t, n, byte(n))
				if err := c.Send(ctx, "k", in); err != nil {
					t.Fatal(err)
				}
				got, err := c.Fetch(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got.Bytes(), in.Bytes()) {
					t.Fatal("data differs")
				}
				got.Release()
				reply, err := c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{in}})
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
					t.Fatal("call data differs")
				}
				reply.Release()
			}
		})
	}
}

// TestReadYourWrites: a Fetch after a Send returned sees that Send's
// tensor, also when an older tensor is published under the key, on every
// plane and for inline and data-plane sizes alike.
func TestReadYourWrites(t *testing.T) {
	pairs := 10000
	if rpctest.Race {
		pairs = 1000
	}
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			_, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			small, err := c.NewTensor(ctx, zerocopy.Uint64, []int64{1})
			if err != nil {
				t.Fatal(err)
			}
			defer small.Release()
			large, err := c.NewTensor(ctx, zerocopy.Uint64, []int64{(rpc.DefaultEagerThreshold + 8) / 8})
			if err != nil {
				t.Fatal(err)
			}
			defer large.Release()
			for i := range pairs {
				x := small
				if i%2 == 1 {
					x = large
				}
				v, _ := zerocopy.View[uint64](x.Tensor)
				v[0] = uint64(i)
				if err := c.Send(ctx, "ryw", x); err != nil {
					t.Fatal(err)
				}
				got, err := c.Fetch(ctx, "ryw")
				if err != nil {
					t.Fatal(err)
				}
				g, _ := zerocopy.View[uint64](got.Tensor)
				if len(g) != len(v) || g[0] != uint64(i) {
					t.Fatalf("pair %d: fetched %d values starting %d, want %d values starting %d", i, len(g), g[0], len(v), i)
				}
				got.Release()
			}
		})
	}
}
