package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestDeviceTensorsStaged moves tensors of a stand-in device (host memory
// behind the device-memory interface) over every data plane: with no
// GPUDirect here, each goes through the staging path, and says why.
func TestDeviceTensorsStaged(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			dev := gpudirect.NewHostAllocator()
			const n = 300000
			src, err := dev.Alloc(n + 64)
			if err != nil {
				t.Fatal(err)
			}
			want := make([]byte, n)
			pattern(want, 8)
			if err := src.CopyFromHost(want, 64); err != nil {
				t.Fatal(err)
			}
			d, err := c.SendDevice(ctx, "dev", rpc.DeviceTensor{DType: zerocopy.Float32, Shape: []int64{n / 4}, Buffer: src, Offset: 64})
			if err != nil {
				t.Fatal(err)
			}
			if d.Path != gpudirect.Staged || !strings.Contains(d.Reason, "host staging") {
				t.Fatalf("SendDevice decision: %+v", d)
			}
			got, err := s.Fetch(ctx, "dev")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), want) || got.DType() != zerocopy.Float32 {
				t.Fatal("sent device tensor differs")
			}
			got.Release()

			dst, err := dev.Alloc(n)
			if err != nil {
				t.Fatal(err)
			}
			dtype, shape, d, err := c.FetchToDevice(ctx, "dev", dst, 0)
			if err != nil {
				t.Fatal(err)
			}
			if d.Path != gpudirect.Staged || dtype != zerocopy.Float32 || fmt.Sprint(shape) != fmt.Sprint([]int64{n / 4}) {
				t.Fatalf("FetchToDevice: %v %v %+v", dtype, shape, d)
			}
			back := make([]byte, n)
			if err := dst.CopyToHost(back, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back, want) {
				t.Fatal("fetched device tensor differs")
			}
			if err := s.PublishDevice(context.Background(), "dev2", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: dst}); err != nil {
				t.Fatal(err)
			}
			got, err = c.Fetch(ctx, "dev2")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), want) {
				t.Fatal("published device tensor differs")
			}
			got.Release()
			if _, err := c.SendDevice(ctx, "bad", rpc.DeviceTensor{DType: zerocopy.Float32, Shape: []int64{n}, Buffer: src}); err == nil {
				t.Fatal("a device tensor larger than its buffer was sent")
			}
			if st := c.Stats(); st.StagedTransfers != 2 || st.DirectTransfers != 0 {
				t.Fatalf("stats: %+v", st)
			}
			hs := dev.Stats()
			if hs.CopiesToHost < 1 || hs.CopiesFromHost < 1 {
				t.Fatalf("device copies: %+v", hs)
			}
			src.Free()
			dst.Free()
			if err := dev.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// directBuffer is a stand-in device buffer whose memory the data plane may
// use directly, as it would a GPU's under GPUDirect RDMA.
type directBuffer struct{ b []byte }

func (d *directBuffer) Device() string { return "direct-fake:0" }
func (d *directBuffer) Len() int       { return len(d.b) }
func (d *directBuffer) CopyToHost(dst []byte, off int) error {
	copy(dst, d.b[off:])
	return nil
}
func (d *directBuffer) CopyFromHost(src []byte, off int) error {
	copy(d.b[off:], src)
	return nil
}
func (d *directBuffer) Direct() (verbs.Memory, bool) { return verbs.Memory{Bytes: d.b}, true }
func (d *directBuffer) Free() error                  { return nil }

// TestDeviceTensorsDirect runs the direct path (device memory registered
// with the data plane, read and written one-sided, no staging copy) with a
// stand-in device on tcp, whose provider registers any host memory, on one
// lane and striped over three.
func TestDeviceTensorsDirect(t *testing.T) {
	for _, mode := range []string{"frames", "lanes"} {
		t.Run(mode, func(t *testing.T) {
			var copts []rpc.DialOption
			var sopts []rpc.ServerOption
			n := 300000
			switch mode {
			case "lanes":
				copts, sopts = append(copts, rpc.WithLanes(3)), append(sopts, rpc.WithLanes(3))
				n = engine.StripeMin + 2*engine.StripePart
			}
			s, c := pair(t, rpc.TransportTCP, sopts, copts)
			rpc.SetDevicePlan(c, func(gpudirect.DeviceBuffer) gpudirect.Decision {
				return gpudirect.Decision{Path: gpudirect.Direct, Reason: "test"}
			})
			ctx := ctxT(t)
			src := &directBuffer{b: make([]byte, n+64)}
			pattern(src.b[64:], 5)
			d, err := c.SendDevice(ctx, "dev", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src, Offset: 64})
			if err != nil || d.Path != gpudirect.Direct {
				t.Fatalf("SendDevice: %+v, %v", d, err)
			}
			got, err := s.Fetch(ctx, "dev")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), src.b[64:]) {
				t.Fatal("sent device tensor differs")
			}
			got.Release()
			dst := &directBuffer{b: make([]byte, n+8)}
			dtype, shape, d, err := c.FetchToDevice(ctx, "dev", dst, 8)
			if err != nil || d.Path != gpudirect.Direct || dtype != zerocopy.Uint8 || len(shape) != 1 || shape[0] != int64(n) {
				t.Fatalf("FetchToDevice: %v %v %+v %v", dtype, shape, d, err)
			}
			if !bytes.Equal(dst.b[8:], src.b[64:]) {
				t.Fatal("fetched device tensor differs")
			}
			if st := c.Stats(); st.DirectTransfers != 2 || st.StagedTransfers != 0 {
				t.Fatalf("stats: %d direct, %d staged", st.DirectTransfers, st.StagedTransfers)
			}
		})
	}
}
