package rpc_test

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// BenchmarkStaged measures staged device transfers of 64 MiB against a
// plain Fetch and Send of the same bytes, on a host-fake device whose
// copies run at 8 GB/s (HostCopyBandwidth): with pipelining a staged
// FetchToDevice or SendDevice takes about the time of its slower stage,
// not the sum of the copy and the transfer. SendDevice/whole is the path
// without pipelining (a server from before reserved Sends: the whole
// tensor copied off the device, then a Send), for comparison.
func BenchmarkStaged(b *testing.B) {
	const n = 64 << 20
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		b.Run(tr, func(b *testing.B) {
			e := start(b, tr, nil, nil)
			old := start(b, tr, []rpc.ServerOption{rpc.ServeWithoutReservations()}, nil)
			ctx := ctxT(b)
			dev := gpudirect.NewHostAllocator(gpudirect.HostCopyBandwidth(8e9))
			buf, _ := dev.Alloc(n)
			defer buf.Free()
			dt := rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: buf}
			if err := e.srv.PublishDevice(ctx, "k", dt); err != nil {
				b.Fatal(err)
			}
			host, err := e.c.NewTensor(ctx, zerocopy.Uint8, []int64{n})
			if err != nil {
				b.Fatal(err)
			}
			defer host.Release()
			for _, op := range []string{"Fetch", "FetchToDevice", "Send", "SendDevice", "SendDevice/whole"} {
				b.Run(op, func(b *testing.B) {
					b.SetBytes(n)
					for b.Loop() {
						var err error
						switch op {
						case "Fetch":
							var t *rpc.Tensor
							if t, err = e.c.Fetch(ctx, "k"); err == nil {
								t.Release()
							}
						case "FetchToDevice":
							_, _, _, err = e.c.FetchToDevice(ctx, "k", buf, 0)
						case "Send":
							err = e.c.Send(ctx, "s", host)
						case "SendDevice":
							_, err = e.c.SendDevice(ctx, "s", dt)
						case "SendDevice/whole":
							_, err = old.c.SendDevice(ctx, "s", dt)
						}
						if err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		})
	}
}
