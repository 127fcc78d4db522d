package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/gpudirect/cudatest"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// These tests move device tensors of the CUDA driver emulator (or, under
// TENSORRPC_TEST_CUDA=real, of a real GPU: scripts/device-check.sh runs
// them there): staged through pinned pool memory on streams, and between
// two processes over CUDA IPC.

// TestCUDAStaged: SendDevice and FetchToDevice of CUDA buffers, their
// copies delayed on the emulator's streams, bit-exact on every plane,
// every staged byte copied from pinned memory.
func TestCUDAStaged(t *testing.T) {
	if !cudatest.Real() {
		t.Setenv("FAKECUDA_COPY_DELAY_US", "200")
	}
	c := cudatest.Load(t)
	sizes := []int{0, 1, 4097, stagingChunk - 1, stagingChunk + 1, 3<<20 + 3}
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, cl := stagingPair(t, tr)
			ctx := ctxT(t)
			a, err := c.NewAllocator(0, 16<<20, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := a.Close(); err != nil {
					t.Errorf("device memory not returned: %v", err)
				}
			}()
			for _, n := range sizes {
				src, err := a.Alloc(n + 5)
				if err != nil {
					t.Fatal(err)
				}
				dst, err := a.Alloc(n + 3)
				if err != nil {
					t.Fatal(err)
				}
				want := make([]byte, n)
				pattern(want, byte(n))
				if err := src.CopyFromHost(want, 5); err != nil {
					t.Fatal(err)
				}
				key := fmt.Sprint("cuda/", n)
				if _, err := cl.SendDevice(ctx, key, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src, Offset: 5}); err != nil {
					t.Fatalf("SendDevice of %d bytes: %v", n, err)
				}
				if _, _, _, err := cl.FetchToDevice(ctx, key, dst, 3); err != nil {
					t.Fatalf("FetchToDevice of %d bytes: %v", n, err)
				}
				got := make([]byte, n)
				if err := dst.CopyToHost(got, 3); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("%d bytes over %s: the bytes differ", n, tr)
				}
				if !s.Unpublish(key) {
					t.Fatalf("%s was not published", key)
				}
				src.Free()
				dst.Free()
			}
			st := cl.Stats()
			if st.PinnedStagedBytes == 0 || st.PinnedArenas == 0 {
				t.Errorf("no pinned staging: %+v", st)
			}
			if err := cl.Close(); err != nil {
				t.Fatal(err)
			}
			if n := cl.Stats().PinnedArenas; n != 0 {
				t.Errorf("%d arenas still registered after Close", n)
			}
		})
	}
}

// runCUDAServer is the child of TestCUDAIPC: a server with the CUDA
// driver that publishes "dev" (size bytes of pattern 7 at offset 4096 of
// its allocation) in place on its device, and prints its address.
func runCUDAServer(size int, opts []rpc.Option) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, err); return 1 }
	var c *gpudirect.CUDA
	var err error
	if lib := os.Getenv("TENSORRPC_TEST_CUDA_LIB"); lib != "" {
		c, err = gpudirect.LoadCUDA(gpudirect.WithCUDALibrary(lib))
	} else {
		c, err = gpudirect.LoadCUDA()
	}
	if err != nil {
		return fail(err)
	}
	a, err := c.NewAllocator(0, size+16<<20, nil)
	if err != nil {
		return fail(err)
	}
	pad, err := a.Alloc(4096)
	if err != nil {
		return fail(err)
	}
	defer pad.Free()
	b, err := a.Alloc(size)
	if err != nil {
		return fail(err)
	}
	defer b.Free()
	want := make([]byte, size)
	fill(want, 7)
	if err := b.CopyFromHost(want, 0); err != nil {
		return fail(err)
	}
	s, err := rpc.NewServer(append(asServer(opts), rpc.WithCUDA(c), rpc.WithDeviceAllocator(a))...)
	if err != nil {
		return fail(err)
	}
	if err := s.PublishDeviceInPlace(context.Background(), "dev", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(size)}, Buffer: b}); err != nil {
		return fail(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	return serveUntilStopped(s, lis)
}

// TestCUDAIPC: a client process fetches a device tensor another process
// published in place, over CUDA IPC (device to device, host memory never
// touched), and sends one back, on shm and tcp sessions.
func TestCUDAIPC(t *testing.T) {
	lib := ""
	if !cudatest.Real() {
		lib = cudatest.Library(t)
	}
	c := cudatest.Load(t)
	const n = 1<<20 + 7
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP} {
		t.Run(tr, func(t *testing.T) {
			ch := startChild(t, "cuda-server", tr, n, "TENSORRPC_TEST_CUDA_LIB="+lib)
			cl := dialChild(t, ch, tr, rpc.WithCUDA(c))
			defer cl.Close()
			for _, r := range cl.Rejections() {
				if r.Transport == rpc.TransportCUDAIPC {
					t.Fatalf("CUDA IPC refused: %+v", r)
				}
			}
			a, err := c.NewAllocator(0, 8<<20, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := a.Close(); err != nil {
					t.Errorf("device memory not returned: %v", err)
				}
			}()
			dst, err := a.Alloc(n + 1)
			if err != nil {
				t.Fatal(err)
			}
			defer dst.Free()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, _, d, err := cl.FetchToDevice(ctx, "dev", dst, 1)
			if err != nil {
				t.Fatal(err)
			}
			if d.Path != gpudirect.IPC {
				t.Errorf("FetchToDevice took %v (%s), want CUDA IPC", d.Path, d.Reason)
			}
			got := make([]byte, n)
			if err := dst.CopyToHost(got, 1); err != nil {
				t.Fatal(err)
			}
			want := make([]byte, n)
			fill(want, 7)
			if !bytes.Equal(got, want) {
				t.Fatal("the bytes fetched over CUDA IPC differ")
			}
			if _, err := cl.SendDevice(ctx, "back", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: dst, Offset: 1}); err != nil {
				t.Fatal(err)
			}
			if st := cl.Stats(); st.IPC != 2 || st.PinnedStagedBytes+st.PageableStagedBytes != 0 {
				t.Errorf("stats after a fetch and a send over CUDA IPC: %+v", st)
			}
		})
	}
}

// TestCUDAOneProcess: a Server and a Client of one process, both with the
// CUDA driver (the Python package's tests, or any program that serves and
// fetches itself), do not use CUDA IPC, whose handles the driver opens
// only in another process than the one that exported them: the session
// refuses it, saying why, and a device tensor published in place is
// fetched onto the device staged, bit-exact.
func TestCUDAOneProcess(t *testing.T) {
	c := cudatest.Load(t)
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP} {
		t.Run(tr, func(t *testing.T) {
			a, err := c.NewAllocator(0, 8<<20, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := a.Close(); err != nil {
					t.Errorf("device memory not returned: %v", err)
				}
			}()
			s, cl := pair(t, tr, []rpc.ServerOption{rpc.WithCUDA(c), rpc.WithDeviceAllocator(a)}, []rpc.DialOption{rpc.WithCUDA(c)})
			if got := rejectionOf(cl, rpc.TransportCUDAIPC); !strings.Contains(got, "server: the client is in the server's own process") {
				t.Fatalf("CUDA IPC rejection %q, want the one of a client in the server's process", got)
			}
			const n = 1<<20 + 7
			src, err := a.Alloc(n)
			if err != nil {
				t.Fatal(err)
			}
			want := make([]byte, n)
			fill(want, 7)
			if err := src.CopyFromHost(want, 0); err != nil {
				t.Fatal(err)
			}
			released := make(chan struct{})
			ctx := ctxT(t)
			if err := s.PublishDeviceInPlace(ctx, "dev", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}, rpc.Released(func() { close(released) })); err != nil {
				t.Fatal(err)
			}
			got, d, err := cl.FetchDevice(ctx, "dev", func(_ zerocopy.DType, _ []int64, n int) (gpudirect.DeviceBuffer, error) { return a.Alloc(n) })
			if err != nil {
				t.Fatal(err)
			}
			defer got.Buffer.Free()
			if d.Path == gpudirect.IPC {
				t.Errorf("FetchDevice took CUDA IPC (%s) within one process", d.Reason)
			}
			b := make([]byte, n)
			if err := got.Buffer.CopyToHost(b, got.Offset); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(b, want) {
				t.Fatal("the bytes fetched differ")
			}
			if !s.Unpublish("dev") {
				t.Fatal("dev was not published")
			}
			<-released
			src.Free()
		})
	}
}
