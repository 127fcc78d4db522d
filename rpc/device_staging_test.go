package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// stagingChunk is the chunk size of the staging tests: small, so that a
// few MiB span many chunks.
const stagingChunk = 64 << 10

// stagingDevice is the device the staging tests run on: the host-fake,
// whose stream copies run late (delay), so that a missing wait for a
// copy's event shows as wrong bytes. The one place to switch the tests to
// another device (the emulated CUDA driver).
func stagingDevice(t testing.TB, delay time.Duration) *gpudirect.HostAllocator {
	t.Helper()
	return gpudirect.NewHostAllocator(gpudirect.HostCopyDelay(delay))
}

func stagingPair(t *testing.T, tr string) (*rpc.Server, *rpc.Client) {
	return pair(t, tr, []rpc.ServerOption{rpc.WithStagingChunk(stagingChunk)}, []rpc.DialOption{rpc.WithStagingChunk(stagingChunk)})
}

// TestDeviceStagedPipelined moves device tensors of odd sizes, sizes at
// chunk boundaries and one of many chunks, both ways and published, over
// every plane: bit-exact, every staging copy asynchronous from pinned
// pool memory, each arena registered once, all unregistered at Close.
func TestDeviceStagedPipelined(t *testing.T) {
	sizes := []int{0, 1, 4097, stagingChunk - 1, stagingChunk, stagingChunk + 1, 3<<20 + 3}
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			ctx := ctxT(t)
			dev := stagingDevice(t, 100*time.Microsecond)
			var own int64 // the test's own synchronous copies
			for _, n := range sizes {
				src, _ := dev.Alloc(n + 5)
				dst, _ := dev.Alloc(n + 3)
				want := make([]byte, n)
				pattern(want, byte(n))
				src.CopyFromHost(want, 5)
				own++
				key := "dev"
				if _, err := c.SendDevice(ctx, key, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src, Offset: 5}); err != nil {
					t.Fatalf("SendDevice of %d bytes: %v", n, err)
				}
				got, err := s.Fetch(ctx, key)
				if err != nil || !bytes.Equal(got.Bytes(), want) {
					t.Fatalf("%d bytes sent from the device differ (%v)", n, err)
				}
				got.Release()
				dtype, shape, _, err := c.FetchToDevice(ctx, key, dst, 3)
				if err != nil || dtype != zerocopy.Uint8 || len(shape) != 1 || shape[0] != int64(n) {
					t.Fatalf("FetchToDevice of %d bytes: %v %v %v", n, dtype, shape, err)
				}
				back := make([]byte, n)
				dst.CopyToHost(back, 3)
				own++
				if !bytes.Equal(back, want) {
					t.Fatalf("%d bytes fetched to the device differ", n)
				}
				if err := s.PublishDevice(ctx, "pub", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: dst, Offset: 3}); err != nil {
					t.Fatal(err)
				}
				got, err = c.Fetch(ctx, "pub")
				if err != nil || !bytes.Equal(got.Bytes(), want) {
					t.Fatalf("%d bytes published from the device differ (%v)", n, err)
				}
				got.Release()
				src.Free()
				dst.Free()
			}
			var total, small int64 // small: what a Fetch may get inline, and copy from the answer
			for _, n := range sizes {
				total += int64(n)
				if n <= rpc.DefaultEagerThreshold {
					small += int64(n)
				}
			}
			cs, ss, hs := c.Stats(), s.Stats(), dev.Stats()
			if cs.StagedTransfers != int64(2*len(sizes)) || cs.PinnedStagedBytes+cs.PageableStagedBytes != 2*total || cs.PageableStagedBytes > small || ss.PinnedStagedBytes != total || ss.PageableStagedBytes != 0 {
				t.Fatalf("client stats %+v, server stats %+v, want %d pinned bytes", cs, ss, total)
			}
			if sync := hs.CopiesToHost + hs.CopiesFromHost - hs.StreamCopies; sync != own {
				t.Fatalf("%d synchronous device copies, want only the test's %d (%+v)", sync, own, hs)
			}
			if hs.Streams != 0 || hs.Registered == 0 || int64(hs.Registered) != hs.Registrations || hs.Registered != cs.PinnedArenas+ss.PinnedArenas {
				t.Fatalf("device %+v; client pins %d arenas, server %d", hs, cs.PinnedArenas, ss.PinnedArenas)
			}
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
			if hs := dev.Stats(); hs.Registered != ss.PinnedArenas {
				t.Fatalf("after the client's Close, %d ranges registered, want the server's %d", hs.Registered, ss.PinnedArenas)
			}
			s.Stop()
			if hs := dev.Stats(); hs.Registered != 0 || hs.Unregistrations != hs.Registrations {
				t.Fatalf("after Close: %+v", hs)
			}
			if err := dev.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestDeviceStagedCancel cancels FetchToDevice and SendDevice while
// chunks are in flight (copies slowed to 2 ms each): ctx's error, and the
// package's end-of-test checks find no pool buffer, grant or goroutine
// left; the device has no stream left.
func TestDeviceStagedCancel(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			dev := stagingDevice(t, 2*time.Millisecond)
			const n = 4 << 20
			buf, _ := dev.Alloc(n)
			defer buf.Free()
			want := make([]byte, n)
			pattern(want, 3)
			buf.CopyFromHost(want, 0)
			if err := s.PublishDevice(ctxT(t), "big", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: buf}); err != nil {
				t.Fatal(err)
			}
			for _, op := range []string{"fetch", "send"} {
				ctx, cancel := context.WithTimeout(context.Background(), 15*time.Millisecond)
				var err error
				if op == "fetch" {
					_, _, _, err = c.FetchToDevice(ctx, "big", buf, 0)
				} else {
					_, err = c.SendDevice(ctx, "sent", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: buf})
				}
				cancel()
				if err == nil {
					continue // it was faster than the deadline: nothing to check
				}
				if code := status.Code(err); code != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("%s cancelled mid-transfer: %v", op, err)
				}
			}
			if hs := dev.Stats(); hs.Streams != 0 {
				t.Fatalf("streams left: %+v", hs)
			}
			// The session still works.
			dst, _ := dev.Alloc(n)
			defer dst.Free()
			if _, _, _, err := c.FetchToDevice(ctxT(t), "big", dst, 0); err != nil {
				t.Fatal(err)
			}
			back := make([]byte, n)
			dst.CopyToHost(back, 0)
			if !bytes.Equal(back, want) {
				t.Fatal("fetched after a cancelled transfer: bytes differ")
			}
		})
	}
}

// syncDevBuffer is a device buffer with synchronous copies only (no
// streams): staging keeps the synchronous path for it.
type syncDevBuffer struct{ directBuffer }

func (d *syncDevBuffer) Direct() (m verbs.Memory, ok bool) { return m, false }

// TestDeviceStagedSync: a plain DeviceBuffer stages synchronously,
// counted as pageable.
func TestDeviceStagedSync(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			_, c := stagingPair(t, tr)
			ctx := ctxT(t)
			n := 3*stagingChunk + 1
			src := &syncDevBuffer{directBuffer{b: make([]byte, n)}}
			pattern(src.b, 9)
			if _, err := c.SendDevice(ctx, "k", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src}); err != nil {
				t.Fatal(err)
			}
			dst := &syncDevBuffer{directBuffer{b: make([]byte, n)}}
			if _, _, _, err := c.FetchToDevice(ctx, "k", dst, 0); err != nil || !bytes.Equal(dst.b, src.b) {
				t.Fatalf("FetchToDevice: %v", err)
			}
			if st := c.Stats(); st.PageableStagedBytes != int64(2*n) || st.PinnedStagedBytes != 0 || st.PinnedArenas != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}
