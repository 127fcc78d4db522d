package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Pipelined SendDevice: the server reserves the destination, the client
// writes chunks into it as their device copies complete, then commits.

// pipelinedCopies is how many stream copies a pipelined SendDevice of n
// bytes makes: one a chunk on a data plane above the frame-inline size,
// else one for the whole tensor.
func pipelinedCopies(tr string, n int) int64 {
	if tr == rpc.TransportGRPC || n <= rpc.DefaultEagerThreshold {
		return 1
	}
	return int64((n + stagingChunk - 1) / stagingChunk)
}

// TestSendDevicePipelined sends device tensors of odd sizes, sizes at
// chunk boundaries and one of many chunks from a device whose copies run
// late: bit-exact on the server, and on the data planes a copy per chunk
// (the pipelined path); grpc keeps the whole-tensor copy. With checksums,
// the client's CRC32C of the chunks is the server's.
func TestSendDevicePipelined(t *testing.T) {
	sizes := []int{0, 1, 4097, rpc.DefaultEagerThreshold + 1, stagingChunk - 1, stagingChunk, stagingChunk + 1, 3<<20 + 3}
	for _, tr := range testTransports {
		for _, sums := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/checksums=%v", tr, sums), func(t *testing.T) {
				opts := []rpc.Option{rpc.WithStagingChunk(stagingChunk), rpc.WithChecksums(sums)}
				s, c := pair(t, tr, asServer(opts), asDial(opts))
				ctx := ctxT(t)
				dev := stagingDevice(t, 100*time.Microsecond)
				defer dev.Close()
				for _, n := range sizes {
					src, _ := dev.Alloc(n + 7)
					want := make([]byte, n)
					pattern(want, byte(n+3))
					src.CopyFromHost(want, 7)
					before := dev.Stats().StreamCopies
					if _, err := c.SendDevice(ctx, "dev", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src, Offset: 7}); err != nil {
						t.Fatalf("SendDevice of %d bytes: %v", n, err)
					}
					if got, want := dev.Stats().StreamCopies-before, pipelinedCopies(tr, n); got != want {
						t.Errorf("%d bytes: %d stream copies, want %d", n, got, want)
					}
					got, err := s.Fetch(ctx, "dev")
					if err != nil || !bytes.Equal(got.Bytes(), want) {
						t.Fatalf("%d bytes sent from the device differ (%v)", n, err)
					}
					got.Release()
					src.Free()
				}
				if st := dev.Stats(); st.Streams != 0 {
					t.Fatalf("streams left: %+v", st)
				}
			})
		}
	}
}

// TestSendDeviceTypedReplaces sends a float32 matrix, then another under
// the same key: the second replaces the first, with its shape.
func TestSendDeviceTypedReplaces(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			ctx := ctxT(t)
			dev := stagingDevice(t, 50*time.Microsecond)
			defer dev.Close()
			for i, shape := range [][]int64{{300, 257}, {129, 1000}} {
				n := int(shape[0] * shape[1] * 4)
				src, _ := dev.Alloc(n)
				want := make([]byte, n)
				pattern(want, byte(i+1))
				src.CopyFromHost(want, 0)
				if _, err := c.SendDevice(ctx, "m", rpc.DeviceTensor{DType: zerocopy.Float32, Shape: shape, Buffer: src}); err != nil {
					t.Fatal(err)
				}
				got, err := s.Fetch(ctx, "m")
				if err != nil || got.DType() != zerocopy.Float32 || fmt.Sprint(got.Shape()) != fmt.Sprint(shape) || !bytes.Equal(got.Bytes(), want) {
					t.Fatalf("send %d: %v %v %v", i, got.DType(), got.Shape(), err)
				}
				got.Release()
				src.Free()
			}
		})
	}
}

// TestSendDeviceWaiter: a Fetch waiting for the key is woken by the
// commit, and sees the whole tensor.
func TestSendDeviceWaiter(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			_, c := stagingPair(t, tr)
			ctx := ctxT(t)
			dev := stagingDevice(t, 200*time.Microsecond)
			defer dev.Close()
			const n = 1<<20 + 5
			src, _ := dev.Alloc(n)
			defer src.Free()
			want := make([]byte, n)
			pattern(want, 11)
			src.CopyFromHost(want, 0)
			type result struct {
				t   *rpc.Tensor
				err error
			}
			waited := make(chan result, 1)
			go func() {
				got, err := c.Fetch(ctx, "later", rpc.WaitForKey())
				waited <- result{got, err}
			}()
			if _, err := c.SendDevice(ctx, "later", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
				t.Fatal(err)
			}
			r := <-waited
			if r.err != nil || !bytes.Equal(r.t.Bytes(), want) {
				t.Fatalf("the waiting Fetch: %v", r.err)
			}
			r.t.Release()
		})
	}
}

// TestSendDeviceConcurrent: SendDevice of different keys from several
// goroutines at once, each bit-exact.
func TestSendDeviceConcurrent(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			ctx := ctxT(t)
			dev := stagingDevice(t, 50*time.Microsecond)
			defer dev.Close()
			const senders, rounds = 4, 3
			var wg sync.WaitGroup
			errs := make(chan error, senders)
			for g := range senders {
				wg.Go(func() {
					n := 5*stagingChunk/2 + 1000*g + 1
					src, _ := dev.Alloc(n)
					defer src.Free()
					key := fmt.Sprintf("k%d", g)
					for r := range rounds {
						want := make([]byte, n)
						pattern(want, byte(16*g+r))
						src.CopyFromHost(want, 0)
						if _, err := c.SendDevice(ctx, key, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src}); err != nil {
							errs <- fmt.Errorf("%s round %d: %w", key, r, err)
							return
						}
						got, err := s.Fetch(ctx, key)
						if err != nil {
							errs <- err
							return
						}
						same := bytes.Equal(got.Bytes(), want)
						got.Release()
						if !same {
							errs <- fmt.Errorf("%s round %d: bytes differ", key, r)
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

// TestSendDeviceCancelled cancels SendDevice while chunks are in flight
// (copies slowed to 1 ms each), at several points: ctx's error, nothing
// published under the key, and once the server has had the releases, it
// holds no pool memory; the package's end-of-test checks find no
// goroutine or buffer left. The session still works.
func TestSendDeviceCancelled(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			dev := stagingDevice(t, time.Millisecond)
			defer dev.Close()
			const n = 2 << 20 // 32 chunks: about 32 ms of copies
			src, _ := dev.Alloc(n)
			defer src.Free()
			want := make([]byte, n)
			pattern(want, 5)
			src.CopyFromHost(want, 0)
			cancelled := 0
			for _, after := range []time.Duration{0, 200 * time.Microsecond, 2 * time.Millisecond, 10 * time.Millisecond, 25 * time.Millisecond} {
				ctx, cancel := context.WithTimeout(context.Background(), after)
				_, err := c.SendDevice(ctx, "sent", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src})
				cancel()
				if err == nil {
					// Faster than the deadline: then it is published whole.
					got, err := s.Fetch(ctxT(t), "sent")
					if err != nil || !bytes.Equal(got.Bytes(), want) {
						t.Fatalf("a SendDevice that returned nil: %v", err)
					}
					got.Release()
					s.Unpublish("sent")
					continue
				}
				cancelled++
				if code := status.Code(err); code != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("cancelled after %v: %v", after, err)
				}
				if got, err := s.Fetch(ctxT(t), "sent"); err == nil {
					got.Release()
					t.Fatalf("cancelled after %v, yet published", after)
				}
			}
			if cancelled == 0 {
				t.Log("every SendDevice beat its deadline")
			}
			waitFor(t, "the server to free the reservations", func() bool { return s.Pool().Stats().InUse == 0 })
			if st := dev.Stats(); st.Streams != 0 {
				t.Fatalf("streams left: %+v", st)
			}
			if _, err := c.SendDevice(ctxT(t), "sent", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
				t.Fatal(err)
			}
			got, err := s.Fetch(ctxT(t), "sent")
			if err != nil || !bytes.Equal(got.Bytes(), want) {
				t.Fatalf("after cancelled sends: %v", err)
			}
			got.Release()
		})
	}
}

// failingStream fails its copies to the host from the failAt-th on.
type failingStream struct {
	gpudirect.Stream
	n, failAt *int
}

func (f failingStream) CopyToHost(dst []byte, src gpudirect.DeviceBuffer, offset int) error {
	*f.n++
	if *f.n >= *f.failAt {
		return errors.New("injected copy failure")
	}
	return f.Stream.CopyToHost(dst, src, offset)
}

// failingBuffer is a host-fake buffer whose streams fail a copy.
type failingBuffer struct {
	gpudirect.AsyncBuffer
	n, failAt int
}

func (f *failingBuffer) NewStream() (gpudirect.Stream, error) {
	st, err := f.AsyncBuffer.NewStream()
	return failingStream{st, &f.n, &f.failAt}, err
}

// TestSendDeviceCopyFails: a device copy that fails midway fails
// SendDevice (Internal, naming the device), publishes nothing and frees
// the reservation.
func TestSendDeviceCopyFails(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := stagingPair(t, tr)
			dev := stagingDevice(t, 100*time.Microsecond)
			defer dev.Close()
			const n = 1 << 20
			b, _ := dev.Alloc(n)
			defer b.Free()
			src := &failingBuffer{AsyncBuffer: b.(gpudirect.AsyncBuffer), failAt: 6}
			_, err := c.SendDevice(ctxT(t), "broken", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src})
			if status.Code(err) != codes.Internal {
				t.Fatalf("a failed copy: %v", err)
			}
			if got, err := s.Fetch(ctxT(t), "broken"); err == nil {
				got.Release()
				t.Fatal("published after a failed copy")
			}
			waitFor(t, "the server to free the reservation", func() bool { return s.Pool().Stats().InUse == 0 })
		})
	}
}

// TestSendDeviceOldServer: a server from before reserved Sends does not
// announce them in its handshake; SendDevice then copies the whole
// tensor off the device and Sends it.
func TestSendDeviceOldServer(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			opts := []rpc.Option{rpc.WithStagingChunk(stagingChunk)}
			s, c := pair(t, tr, append(asServer(opts), rpc.ServeWithoutReservations()), asDial(opts))
			ctx := ctxT(t)
			dev := stagingDevice(t, 100*time.Microsecond)
			defer dev.Close()
			const n = 3*stagingChunk + 1
			src, _ := dev.Alloc(n)
			defer src.Free()
			want := make([]byte, n)
			pattern(want, 8)
			src.CopyFromHost(want, 0)
			before := dev.Stats().StreamCopies
			if _, err := c.SendDevice(ctx, "old", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
				t.Fatal(err)
			}
			if copies := dev.Stats().StreamCopies - before; copies != 1 {
				t.Fatalf("%d stream copies, want 1 (the whole tensor, then a Send)", copies)
			}
			got, err := s.Fetch(ctx, "old")
			if err != nil || !bytes.Equal(got.Bytes(), want) {
				t.Fatalf("from an old server: %v", err)
			}
			got.Release()
		})
	}
}
