package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// ipcPair starts a Server and Client that both have the fake driver on
// one "host" as two "processes", the server with device memory of the
// fake's for sends. The
// cleanup checks that every opened handle is closed and every buffer the
// server allocated is freed.
func ipcPair(t *testing.T, transport string, f *fakeIPC, serverOpts []rpc.ServerOption, clientOpts []rpc.DialOption) (*rpc.Server, *rpc.Client) {
	t.Helper()
	live0, _, _ := f.counts()
	t.Cleanup(func() {
		// Registered before pair's, so it runs after the Client and
		// Server closed.
		live, opened, _ := f.counts()
		if opened != 0 {
			t.Errorf("%d IPC handles still open after Close", opened)
		}
		if live != live0 {
			t.Errorf("%d fake device buffers allocated during the test are not freed", live-live0)
		}
	})
	so := append([]rpc.ServerOption{rpc.WithIPCDriver(f), rpc.WithIPCHost("host-a"), rpc.WithIPCProcess("server"), rpc.WithDeviceAllocator(f)}, serverOpts...)
	co := append([]rpc.DialOption{rpc.WithIPCDriver(f), rpc.WithIPCHost("host-a"), rpc.WithIPCProcess("client")}, clientOpts...)
	return pair(t, transport, so, co)
}

func rejectionOf(c *rpc.Client, transport string) string {
	var rs []string
	for _, r := range c.Rejections() {
		if r.Transport == transport {
			rs = append(rs, r.Side+": "+r.Reason)
		}
	}
	return strings.Join(rs, "; ")
}

// TestIPCFetchAndSend moves device tensors both ways over CUDA IPC, bit
// exact, at 0 bytes, odd sizes and at non-zero offsets inside their
// allocations (a handle names the allocation's base: a lost offset would
// read the wrong bytes), on every data plane the session may use.
func TestIPCFetchAndSend(t *testing.T) {
	for _, tr := range []string{rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			f := newFakeIPC(1)
			s, c := ipcPair(t, tr, f, nil, nil)
			if r := rejectionOf(c, rpc.TransportCUDAIPC); r != "" {
				t.Fatalf("cuda-ipc rejected: %s", r)
			}
			ctx := ctxT(t)
			for i, n := range []int{0, 1, 4093, 1<<20 + 3} {
				key := fmt.Sprint("k", i)
				const off = 4096 + 7
				alloc, _ := f.Alloc(off + n + 64)
				src := alloc.(*fakeBuf).slice(off, n+64)
				want := make([]byte, n)
				pattern(want, byte(i+1))
				src.CopyFromHost(want, 0)
				if err := s.PublishDeviceInPlace(ctx, key, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src}); err != nil {
					t.Fatal(err)
				}
				dstAlloc, _ := f.Alloc(n + 200)
				dst := dstAlloc.(*fakeBuf).slice(100, n+50)
				dtype, shape, d, err := c.FetchToDevice(ctx, key, dst, 13)
				if err != nil {
					t.Fatalf("%d bytes: %v", n, err)
				}
				if d.Path != gpudirect.IPC || dtype != zerocopy.Uint8 || fmt.Sprint(shape) != fmt.Sprint([]int64{int64(n)}) {
					t.Fatalf("%d bytes: %v %v %+v", n, dtype, shape, d)
				}
				got := make([]byte, n)
				dst.CopyToHost(got, 13)
				if !bytes.Equal(got, want) {
					t.Fatalf("%d bytes fetched over IPC differ", n)
				}
				// A host Fetch of the device tensor is staged out.
				ht, err := s.Fetch(ctx, key)
				if err != nil || !bytes.Equal(ht.Bytes(), want) {
					t.Fatalf("host Fetch of a device tensor: %v", err)
				}
				ht.Release()

				// Send back from an offset inside dst's allocation.
				sk := key + "-sent"
				d, err = c.SendDevice(ctx, sk, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: dst, Offset: 13})
				if err != nil || d.Path != gpudirect.IPC {
					t.Fatalf("SendDevice %d bytes: %v %+v", n, err, d)
				}
				dst.CopyFromHost(bytes.Repeat([]byte{0xee}, n), 13) // the client may reuse it now
				back, err := c.Fetch(ctx, sk)
				if err != nil || !bytes.Equal(back.Bytes(), want) {
					t.Fatalf("host Fetch of %d bytes sent over IPC: %v", n, err)
				}
				back.Release()
				if ok, err := s.UnpublishDevice(ctx, key); !ok || err != nil {
					t.Fatalf("UnpublishDevice: %v %v", ok, err)
				}
				s.Unpublish(sk)
				alloc.Free()
				dstAlloc.Free()
			}
			if st := c.Stats(); st.IPC != 6 { // 3 fetches and 3 sends of more than 0 bytes
				t.Errorf("client Stats.IPC = %d, want 6", st.IPC)
			}
			if st := s.Stats(); st.IPC != 6 || st.StagedTransfers != 7 { // 4 server and 3 client host Fetches of device tensors (0 B sent is a host tensor)
				t.Errorf("server Stats: IPC %d, staged %d; want 6, 7", st.IPC, st.StagedTransfers)
			}
		})
	}
}

// TestIPCHandleCache: fetches from one allocation open its handle once;
// once the server no longer exports an allocation the client closes it,
// and a new allocation (even one that reused the handle's bytes) is
// opened anew, its new contents arriving.
func TestIPCHandleCache(t *testing.T) {
	f := newFakeIPC(1)
	s, c := ipcPair(t, rpc.TransportSHM, f, nil, nil)
	ctx := ctxT(t)
	const n = 1000
	alloc, _ := f.Alloc(4 * n)
	dst, _ := f.Alloc(n)
	defer dst.Free()
	fetch := func(key string, seed byte) {
		t.Helper()
		if _, _, _, err := c.FetchToDevice(ctx, key, dst, 0); err != nil {
			t.Fatal(err)
		}
		got, want := make([]byte, n), make([]byte, n)
		pattern(want, seed)
		dst.CopyToHost(got, 0)
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: stale or wrong bytes", key)
		}
	}
	publish := func(a gpudirect.DeviceBuffer, key string, off int, seed byte) {
		t.Helper()
		b := make([]byte, n)
		pattern(b, seed)
		a.CopyFromHost(b, off)
		if err := s.PublishDeviceInPlace(ctx, key, rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: a, Offset: off}); err != nil {
			t.Fatal(err)
		}
	}
	publish(alloc, "a", 0, 1)
	publish(alloc, "b", 2*n, 2)
	// The farther tensor first: the handle is opened from the
	// allocation's base to the end of what a fetch needs, and reopened
	// larger when a later one needs more.
	for range 3 {
		fetch("b", 2)
		fetch("a", 1)
	}
	if opened, _ := rpc.IPCHandleCounts(c); opened != 1 {
		t.Fatalf("opened %d handles for one allocation, want 1", opened)
	}
	s.UnpublishDevice(ctx, "a")
	s.UnpublishDevice(ctx, "b")
	// The allocation is freed; a new one takes over its handle's bytes,
	// as a driver may reuse them.
	old := alloc.(*fakeBuf).a.handle
	alloc.Free()
	alloc, _ = f.Alloc(4 * n)
	f.mu.Lock()
	delete(f.allocs, alloc.(*fakeBuf).a.handle)
	alloc.(*fakeBuf).a.handle = old
	f.allocs[old] = alloc.(*fakeBuf).a
	f.mu.Unlock()
	publish(alloc, "a", n, 3)
	fetch("a", 3)
	opened, closed := rpc.IPCHandleCounts(c)
	if opened != 2 || closed != 1 {
		t.Fatalf("after the allocation changed: opened %d, closed %d; want 2, 1", opened, closed)
	}
	s.UnpublishDevice(ctx, "a")
	alloc.Free()
}

// TestIPCRefused: without CUDA on one side, on another host, in the
// server's own process, without a GPU in common or without server device
// memory, device tensors stage
// through host memory and Rejections says why.
func TestIPCRefused(t *testing.T) {
	cases := []struct {
		name   string
		server []rpc.ServerOption
		client []rpc.DialOption
		want   string
		send   bool // SendDevice still over IPC
	}{
		{"server-without-cuda", []rpc.ServerOption{rpc.WithIPCDriver(nil)}, nil, "server: the server has no CUDA driver", false},
		{"other-host", []rpc.ServerOption{rpc.WithIPCHost("host-b")}, nil, "server: not the same host", false},
		{"same-process", []rpc.ServerOption{rpc.WithIPCProcess("client")}, nil, "server: the client is in the server's own process", false},
		{"no-common-gpu", []rpc.ServerOption{rpc.WithIPCDriver(newFakeIPC(2))}, nil, "server: no common GPU", false},
		{"no-device-allocator", []rpc.ServerOption{rpc.WithDeviceAllocator(nil)}, nil, "SendDevice stages through host memory", false},
		{"client-without-cuda", nil, []rpc.DialOption{rpc.WithIPCDriver(nil)}, "", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeIPC(1)
			s, c := ipcPair(t, rpc.TransportTCP, f, tc.server, tc.client)
			got := rejectionOf(c, rpc.TransportCUDAIPC)
			if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
				t.Fatalf("rejection %q, want %q", got, tc.want)
			}
			ctx := ctxT(t)
			const n = 5000
			src, _ := f.Alloc(n)
			defer src.Free()
			want := make([]byte, n)
			pattern(want, 9)
			src.CopyFromHost(want, 0)
			if err := s.PublishDeviceInPlace(ctx, "k", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
				t.Fatal(err)
			}
			dst, _ := f.Alloc(n)
			defer dst.Free()
			_, _, d, err := c.FetchToDevice(ctx, "k", dst, 0)
			ipc := tc.name == "no-device-allocator"
			if err != nil || (d.Path == gpudirect.IPC) != ipc {
				t.Fatalf("FetchToDevice: %v %+v", err, d)
			}
			got2 := make([]byte, n)
			dst.CopyToHost(got2, 0)
			if !bytes.Equal(got2, want) {
				t.Fatal("fetched bytes differ")
			}
			d, err = c.SendDevice(ctx, "sent", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: dst})
			if err != nil || d.Path != gpudirect.Staged {
				t.Fatalf("SendDevice: %v %+v", err, d)
			}
			s.UnpublishDevice(ctx, "k")
		})
	}
}

// forgedBuf exports a handle other than its own.
type forgedBuf struct {
	*fakeBuf
	forge func(*gpudirect.IPCHandle)
}

func (b forgedBuf) IPCHandle() (gpudirect.IPCHandle, error) {
	h, err := b.fakeBuf.IPCHandle()
	b.forge(&h)
	return h, err
}

// TestIPCBadHandles: a client's handle that does not open, reaches past
// its allocation or overflows fails the SendDevice (DataLoss or
// InvalidArgument) and leaves the server serving.
func TestIPCBadHandles(t *testing.T) {
	f := newFakeIPC(1)
	s, c := ipcPair(t, rpc.TransportSHM, f, nil, nil)
	ctx := ctxT(t)
	const n = 4096
	a, _ := f.Alloc(n)
	defer a.Free()
	for _, tc := range []struct {
		name  string
		forge func(*gpudirect.IPCHandle)
		code  codes.Code
	}{
		{"unknown-handle", func(h *gpudirect.IPCHandle) { h.Handle[0] ^= 0xff }, codes.DataLoss},
		{"past-the-allocation", func(h *gpudirect.IPCHandle) { h.Offset = n - 10 }, codes.DataLoss},
		{"overflowing-offset", func(h *gpudirect.IPCHandle) { h.Offset = math.MaxInt64 - 100 }, codes.InvalidArgument},
	} {
		buf := forgedBuf{a.(*fakeBuf), tc.forge}
		_, err := c.SendDevice(ctx, "bad", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: buf})
		if status.Code(err) != tc.code {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.code)
		}
	}
	if _, err := c.SendDevice(ctx, "good", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: a}); err != nil {
		t.Fatalf("a good SendDevice after bad ones: %v", err)
	}
	s.Unpublish("good")
}

// TestIPCCancelledMidCopy: a FetchToDevice cancelled while its device
// copy runs fails Canceled only once the copy has finished, so nothing
// lands in dst after it returns, and releases the server's tensor.
func TestIPCCancelledMidCopy(t *testing.T) {
	f := newFakeIPC(1)
	s, c := ipcPair(t, rpc.TransportSHM, f, nil, nil)
	const n = 1 << 16
	src, _ := f.Alloc(n)
	defer src.Free()
	want := make([]byte, n)
	pattern(want, 4)
	src.CopyFromHost(want, 0)
	if err := s.PublishDeviceInPlace(ctxT(t), "k", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
		t.Fatal(err)
	}
	dst, _ := f.Alloc(n)
	defer dst.Free()
	f.gate = make(chan struct{})
	var opened atomic.Bool
	ctx, cancel := context.WithCancel(ctxT(t))
	go func() {
		time.Sleep(50 * time.Millisecond)
		cancel()
		time.Sleep(50 * time.Millisecond)
		opened.Store(true)
		close(f.gate)
	}()
	_, _, _, err := c.FetchToDevice(ctx, "k", dst, 0)
	if status.Code(err) != codes.Canceled {
		t.Fatalf("cancelled FetchToDevice: %v", err)
	}
	if !opened.Load() {
		t.Fatal("FetchToDevice returned while its copy was still pending")
	}
	got := make([]byte, n)
	dst.CopyToHost(got, 0)
	if !bytes.Equal(got, want) {
		t.Fatal("the copy that ran past the cancel is not whole")
	}
	wctx, wcancel := context.WithTimeout(ctxT(t), 5*time.Second)
	defer wcancel()
	if _, err := s.UnpublishDevice(wctx, "k"); err != nil {
		t.Fatalf("UnpublishDevice after a cancelled fetch: %v", err)
	}
}

// TestIPCCancelled: a FetchToDevice whose context ended fails with its
// status and holds nothing on the server.
func TestIPCCancelled(t *testing.T) {
	f := newFakeIPC(1)
	s, c := ipcPair(t, rpc.TransportSHM, f, nil, nil)
	src, _ := f.Alloc(1 << 16)
	defer src.Free()
	if err := s.PublishDeviceInPlace(ctxT(t), "k", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{1 << 16}, Buffer: src}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctxT(t))
	cancel()
	dst, _ := f.Alloc(1 << 16)
	defer dst.Free()
	if _, _, _, err := c.FetchToDevice(ctx, "k", dst, 0); status.Code(err) != codes.Canceled {
		t.Fatalf("cancelled FetchToDevice: %v", err)
	}
	wctx, wcancel := context.WithTimeout(ctxT(t), 5e9)
	defer wcancel()
	if _, err := s.UnpublishDevice(wctx, "k"); err != nil {
		t.Fatalf("UnpublishDevice after a cancelled fetch: %v", err)
	}
}

// TestIPCReleasesCoalesced: the transfers of FetchToDevices made close
// together are given back to the server together, after them, every one
// of them: UnpublishDevice (which waits for the tensor's transfers to be
// given back) returns, and the ReleaseDevice calls name each transfer
// once. How many calls that takes depends on the machine's speed; the
// test logs it.
func TestIPCReleasesCoalesced(t *testing.T) {
	var calls, ids atomic.Int64
	count := grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if r, ok := req.(*pb.ReleaseRequest); ok && strings.HasSuffix(info.FullMethod, "/ReleaseDevice") {
			calls.Add(1)
			ids.Add(int64(len(r.TransferIds)))
		}
		return h(ctx, req)
	})
	f := newFakeIPC(1)
	s, c := ipcPair(t, rpc.TransportSHM, f, []rpc.ServerOption{rpc.WithGRPCServerOptions(count)}, nil)
	const n, fetches = 4 << 10, 100
	src, _ := f.Alloc(n)
	defer src.Free()
	if err := s.PublishDeviceInPlace(ctxT(t), "k", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{n}, Buffer: src}); err != nil {
		t.Fatal(err)
	}
	dst, _ := f.Alloc(n)
	defer dst.Free()
	for range fetches {
		if _, _, d, err := c.FetchToDevice(ctxT(t), "k", dst, 0); err != nil || d.Path != gpudirect.IPC {
			t.Fatalf("FetchToDevice: %v (%s)", err, d.Path)
		}
	}
	wctx, cancel := context.WithTimeout(ctxT(t), 5*time.Second)
	defer cancel()
	if _, err := s.UnpublishDevice(wctx, "k"); err != nil {
		t.Fatalf("UnpublishDevice after %d fetches: %v", fetches, err)
	}
	if ids.Load() != fetches {
		t.Errorf("ReleaseDevice named %d transfers, want %d", ids.Load(), fetches)
	}
	t.Logf("%d transfers given back in %d ReleaseDevice calls", ids.Load(), calls.Load())
}
