package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// fetchDeviceSizes are the sizes the FetchDevice tests move: 0 B, odd
// ones, chunk boundaries and one of many chunks.
var fetchDeviceSizes = []int{0, 1, 4097, stagingChunk - 1, stagingChunk + 1, 3<<20 + 3}

// allocCounter is a FetchDevice allocator over a that counts its calls
// and checks what it is asked for.
type allocCounter struct {
	a     gpudirect.Allocator
	calls atomic.Int32
	fail  error
}

func (ac *allocCounter) alloc(t *testing.T, want int) rpc.DeviceAllocFunc {
	return func(dtype zerocopy.DType, shape []int64, n int) (gpudirect.DeviceBuffer, error) {
		ac.calls.Add(1)
		if sz, err := zerocopy.ByteSize(dtype, shape); err != nil || int(sz) != n || (want >= 0 && n != want) {
			t.Errorf("alloc asked for %v %v, %d bytes; want %d", dtype, shape, n, want)
		}
		if ac.fail != nil {
			return nil, ac.fail
		}
		if n == 0 {
			return nil, nil
		}
		return ac.a.Alloc(n)
	}
}

// publishHost publishes want under key as a host tensor of int16 where
// its size allows (the dtype and shape must arrive), else uint8.
func publishHost(t *testing.T, s *rpc.Server, key string, want []byte) (zerocopy.DType, []int64) {
	t.Helper()
	dtype, shape := zerocopy.Uint8, []int64{int64(len(want))}
	if len(want)%2 == 0 {
		dtype, shape = zerocopy.Int16, []int64{2, int64(len(want) / 4)}
		if len(want)%4 != 0 {
			shape = []int64{int64(len(want) / 2)}
		}
	}
	ht, err := s.NewTensor(ctxT(t), dtype, shape)
	if err != nil {
		t.Fatal(err)
	}
	copy(ht.Bytes(), want)
	if err := s.Publish(ctxT(t), key, ht); err != nil {
		t.Fatal(err)
	}
	ht.Release()
	return dtype, shape
}

// TestFetchDeviceStaged fetches host tensors onto the host-fake device
// with FetchDevice on every plane: bit-exact, dtype and shape as
// published, into the one buffer the allocator made (none for 0 B), the
// pinned pipelined read on the data planes (no pageable bytes past the
// inline ones), one asynchronous copy on gRPC, and every buffer given
// back.
func TestFetchDeviceStaged(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			ctx := ctxT(t)
			dev := stagingDevice(t, 50*time.Microsecond)
			var total, small int64
			for i, n := range fetchDeviceSizes {
				want := make([]byte, n)
				pattern(want, byte(i+3))
				key := fmt.Sprint("h", i)
				dtype, shape := publishHost(t, s, key, want)
				ac := &allocCounter{a: dev}
				dt, d, err := c.FetchDevice(ctx, key, ac.alloc(t, n))
				if err != nil {
					t.Fatalf("FetchDevice of %d bytes: %v", n, err)
				}
				if ac.calls.Load() != 1 || dt.DType != dtype || fmt.Sprint(dt.Shape) != fmt.Sprint(shape) || dt.Offset != 0 || d.Path != gpudirect.Staged {
					t.Fatalf("%d bytes: %d allocs, %v %v at %d, %+v", n, ac.calls.Load(), dt.DType, dt.Shape, dt.Offset, d)
				}
				if n == 0 {
					if dt.Buffer != nil {
						t.Fatal("a buffer for 0 bytes")
					}
					continue
				}
				got := make([]byte, n)
				dt.Buffer.CopyToHost(got, 0)
				if !bytes.Equal(got, want) {
					t.Fatalf("%d bytes fetched onto the device differ", n)
				}
				dt.Buffer.Free()
				total += int64(n)
				if n <= rpc.DefaultEagerThreshold {
					small += int64(n)
				}
			}
			cs := c.Stats()
			if cs.StagedTransfers != int64(len(fetchDeviceSizes)-1) || cs.PinnedStagedBytes+cs.PageableStagedBytes != total || cs.PageableStagedBytes > small {
				t.Fatalf("client stats %+v, want %d staged bytes, pinned past %d", cs, total, small)
			}
			if hs := dev.Stats(); hs.Live != 0 || hs.Streams != 0 || hs.StreamCopies == 0 {
				t.Fatalf("device %+v", hs)
			}
		})
	}
}

// TestFetchDeviceIPC fetches tensors published in place on the fake
// CUDA IPC device with FetchDevice: device to device into the buffer the
// allocator made, bit-exact at 0 B and odd sizes; a host tensor of the
// same session lands in an allocated buffer staged. ipcPair's cleanup
// finds every buffer freed and every handle closed.
func TestFetchDeviceIPC(t *testing.T) {
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			f := newFakeIPC(1)
			s, c := ipcPair(t, tr, f, nil, nil)
			ctx := ctxT(t)
			ipcs := int64(0)
			for i, n := range []int{0, 1, 4093, 1<<20 + 3} {
				want := make([]byte, n)
				pattern(want, byte(i+7))
				alloc, _ := f.Alloc(n + 9)
				src := alloc.(*fakeBuf).slice(9, n)
				src.CopyFromHost(want, 0)
				key := fmt.Sprint("d", i)
				if err := s.PublishDeviceInPlace(ctx, key, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src}); err != nil {
					t.Fatal(err)
				}
				ac := &allocCounter{a: f}
				dt, d, err := c.FetchDevice(ctx, key, ac.alloc(t, n))
				if err != nil || d.Path != gpudirect.IPC || ac.calls.Load() != 1 {
					t.Fatalf("%d bytes: %v %+v, %d allocs", n, err, d, ac.calls.Load())
				}
				if n > 0 {
					ipcs++
					got := make([]byte, n)
					dt.Buffer.CopyToHost(got, 0)
					if !bytes.Equal(got, want) {
						t.Fatalf("%d bytes fetched over IPC differ", n)
					}
					dt.Buffer.Free()
				}
				if _, err := s.UnpublishDevice(ctx, key); err != nil {
					t.Fatal(err)
				}
				alloc.Free()

				// The same size published from host memory.
				publishHost(t, s, key, want)
				ac = &allocCounter{a: f}
				dt, d, err = c.FetchDevice(ctx, key, ac.alloc(t, n))
				if err != nil || d.Path == gpudirect.IPC || ac.calls.Load() != 1 {
					t.Fatalf("host tensor of %d bytes: %v %+v, %d allocs", n, err, d, ac.calls.Load())
				}
				if n > 0 {
					got := make([]byte, n)
					dt.Buffer.CopyToHost(got, 0)
					if !bytes.Equal(got, want) {
						t.Fatalf("host tensor of %d bytes differs on the device", n)
					}
					dt.Buffer.Free()
				}
				s.Unpublish(key)
			}
			if st := c.Stats(); st.IPC != ipcs {
				t.Errorf("client Stats.IPC = %d, want %d", st.IPC, ipcs)
			}
		})
	}
}

// TestFetchDeviceErrors: a key that is not published fails NotFound
// without calling the allocator; an allocator's error fails the fetch
// with its code (ResourceExhausted for a plain error) and nothing is left
// held, on the staged planes and over IPC.
func TestFetchDeviceErrors(t *testing.T) {
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC, "ipc"} {
		t.Run(tr, func(t *testing.T) {
			var s *rpc.Server
			var c *rpc.Client
			var a gpudirect.Allocator
			if tr == "ipc" {
				f := newFakeIPC(1)
				s, c = ipcPair(t, rpc.TransportSHM, f, nil, nil)
				a = f
				src, _ := f.Alloc(1 << 20)
				defer src.Free()
				if err := s.PublishDeviceInPlace(ctxT(t), "k", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{1 << 20}, Buffer: src}); err != nil {
					t.Fatal(err)
				}
				defer s.UnpublishDevice(ctxT(t), "k")
			} else {
				s, c = stagingPair(t, tr)
				a = stagingDevice(t, 0)
				publishHost(t, s, "k", make([]byte, 1<<20))
			}
			ctx := ctxT(t)
			ac := &allocCounter{a: a}
			if _, _, err := c.FetchDevice(ctx, "missing", ac.alloc(t, -1)); status.Code(err) != codes.NotFound || ac.calls.Load() != 0 {
				t.Fatalf("missing key: %v, %d allocs", err, ac.calls.Load())
			}
			if _, _, err := c.FetchDevice(ctx, "k", nil); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("nil allocator: %v", err)
			}
			ac.fail = errors.New("out of device memory")
			if _, _, err := c.FetchDevice(ctx, "k", ac.alloc(t, 1<<20)); status.Code(err) != codes.ResourceExhausted || ac.calls.Load() != 1 {
				t.Fatalf("failing allocator: %v, %d allocs", err, ac.calls.Load())
			}
			ac.fail = status.Error(codes.Unavailable, "device lost")
			if _, _, err := c.FetchDevice(ctx, "k", ac.alloc(t, 1<<20)); status.Code(err) != codes.Unavailable {
				t.Fatalf("allocator failing Unavailable: %v", err)
			}
			// A buffer too small for the tensor is freed, and refused.
			small := func(dtype zerocopy.DType, shape []int64, n int) (gpudirect.DeviceBuffer, error) {
				return a.Alloc(n / 2)
			}
			if _, _, err := c.FetchDevice(ctx, "k", small); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("short buffer: %v", err)
			}
			ac.fail = nil
			dt, _, err := c.FetchDevice(ctx, "k", ac.alloc(t, 1<<20))
			if err != nil {
				t.Fatalf("after the failures: %v", err)
			}
			dt.Buffer.Free()
			if hs, ok := a.(*gpudirect.HostAllocator); ok {
				if st := hs.Stats(); st.Live != 0 {
					t.Fatalf("%d device buffers left", st.Live)
				}
			}
		})
	}
}

// TestFetchDeviceCancel cancels FetchDevice mid-transfer (slow device
// copies, or an IPC copy held back): ctx's error, and the buffer the
// allocator made is freed (after the copy into it ended); the session
// still works.
func TestFetchDeviceCancel(t *testing.T) {
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC, "ipc"} {
		t.Run(tr, func(t *testing.T) {
			const n = 4 << 20
			want := make([]byte, n)
			pattern(want, 5)
			var s *rpc.Server
			var c *rpc.Client
			var live func() int
			var a gpudirect.Allocator
			var f *fakeIPC
			if tr == "ipc" {
				f = newFakeIPC(1)
				s, c = ipcPair(t, rpc.TransportSHM, f, nil, nil)
				src, _ := f.Alloc(n)
				defer src.Free()
				src.CopyFromHost(want, 0)
				if err := s.PublishDeviceInPlace(ctxT(t), "big", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
					t.Fatal(err)
				}
				defer s.UnpublishDevice(ctxT(t), "big")
				a, live = f, func() int { l, _, _ := f.counts(); return l - 1 }
				f.gate = make(chan struct{})
				go func() {
					time.Sleep(60 * time.Millisecond)
					close(f.gate)
				}()
			} else {
				s, c = stagingPair(t, tr)
				dev := stagingDevice(t, 2*time.Millisecond)
				a, live = dev, func() int { return dev.Stats().Live }
				publishHost(t, s, "big", want)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Millisecond)
			ac := &allocCounter{a: a}
			_, _, err := c.FetchDevice(ctx, "big", ac.alloc(t, n))
			cancel()
			if err == nil {
				t.Log("faster than the deadline")
			} else if code := status.Code(err); code != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("cancelled FetchDevice: %v", err)
			} else if l := live(); l != 0 {
				t.Fatalf("%d device buffers left after a cancelled FetchDevice", l)
			}
			if f != nil {
				<-f.gate
				f.gate = nil
			}
			ac = &allocCounter{a: a}
			dt, _, err := c.FetchDevice(ctxT(t), "big", ac.alloc(t, n))
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, n)
			dt.Buffer.CopyToHost(got, 0)
			dt.Buffer.Free()
			if !bytes.Equal(got, want) {
				t.Fatal("fetched after a cancelled fetch: bytes differ")
			}
		})
	}
}

// TestPublishDeviceReleased: PublishDeviceInPlace's Released runs once,
// when the publish ends by replacement, unpublish, take or the server's
// close (and at once when the publish fails), never while published.
func TestPublishDeviceReleased(t *testing.T) {
	for _, end := range []string{"replace", "unpublish", "take", "close", "fail"} {
		t.Run(end, func(t *testing.T) {
			f := newFakeIPC(1)
			s, c := ipcPair(t, rpc.TransportSHM, f, nil, nil)
			ctx := ctxT(t)
			src, _ := f.Alloc(5000)
			defer src.Free()
			var released atomic.Int32
			tensor := rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{5000}, Buffer: src}
			if end == "fail" {
				tensor.Offset = 1 // does not fit
			}
			err := s.PublishDeviceInPlace(ctx, "k", tensor, rpc.Released(func() { released.Add(1) }))
			if end == "fail" {
				if status.Code(err) != codes.InvalidArgument || released.Load() != 1 {
					t.Fatalf("failed publish: %v, released %d times", err, released.Load())
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			dt, d, err := c.FetchDevice(ctx, "k", (&allocCounter{a: f}).alloc(t, 5000))
			if err != nil || d.Path != gpudirect.IPC {
				t.Fatalf("%v %+v", err, d)
			}
			dt.Buffer.Free()
			if released.Load() != 0 {
				t.Fatal("released while published")
			}
			switch end {
			case "replace":
				publishHost(t, s, "k", []byte{1})
			case "unpublish":
				s.UnpublishDevice(ctx, "k")
			case "take":
				tk, err := s.Take(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				tk.Release()
			case "close":
				s.Stop()
			}
			deadline := time.Now().Add(5 * time.Second)
			for released.Load() == 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond) // the client's release of its transfer is asynchronous
			}
			if released.Load() != 1 {
				t.Fatalf("released %d times after %s", released.Load(), end)
			}
		})
	}
}
