//go:build linux && cgo

package gpudirect_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/gpudirect/cudatest"
)

// These tests drive the CUDA binding's streams, events, host registration
// and IPC handles against the driver emulator (or, under
// TENSORRPC_TEST_CUDA=real, a real GPU).

func hostMemory(t *testing.T, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func fillPattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
}

// deviceBuffers allocates an arena and two buffers of n bytes, the second
// at a non-zero offset in the arena (its allocation).
func deviceBuffers(t *testing.T, c *gpudirect.CUDA, n int) (*gpudirect.CUDAAllocator, gpudirect.AsyncBuffer, gpudirect.AsyncBuffer) {
	t.Helper()
	a, err := c.NewAllocator(0, 4*n+4<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	var bufs []gpudirect.AsyncBuffer
	for range 2 {
		b, err := a.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		ab, ok := b.(gpudirect.AsyncBuffer)
		if !ok {
			t.Fatalf("a CUDA buffer (%T) is not an AsyncBuffer: the driver lacks streams", b)
		}
		bufs = append(bufs, ab)
	}
	t.Cleanup(func() {
		for _, b := range bufs {
			b.Free()
		}
		if err := a.Close(); err != nil {
			t.Errorf("closing the allocator: %v", err)
		}
	})
	return a, bufs[0], bufs[1]
}

func wait(t *testing.T, st gpudirect.Stream) {
	t.Helper()
	ev, err := st.Record()
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ev.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestCUDAStreamCopies: pinned copies both ways and device to device, on
// a stream, bit-exact at odd sizes and offsets.
func TestCUDAStreamCopies(t *testing.T) {
	c := cudatest.Load(t)
	const n = 1<<20 + 3
	_, b0, b1 := deviceBuffers(t, c, n)
	host := hostMemory(t, 2<<20)
	reg := b0.HostRegistrar()
	if reg == nil {
		t.Fatal("no HostRegistrar")
	}
	if err := reg.RegisterHost(host); err != nil {
		t.Fatal(err)
	}
	defer reg.UnregisterHost(host)
	st, err := b0.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	want := make([]byte, n)
	fillPattern(want, 3)
	copy(host, want)
	if err := st.CopyFromHost(b0, 0, host[:n]); err != nil {
		t.Fatal(err)
	}
	if err := st.CopyDevice(b1, 5, b0, 0, n-5); err != nil {
		t.Fatal(err)
	}
	wait(t, st) // host is read by the copy until then
	clear(host)
	if err := st.CopyToHost(host[:n-5], b1, 5); err != nil {
		t.Fatal(err)
	}
	wait(t, st)
	if !bytes.Equal(host[:n-5], want[:n-5]) {
		t.Fatal("bytes differ after host → device → device → host")
	}
	for _, size := range []int{0, 1, 4097} {
		if err := st.CopyToHost(host[:size], b0, n-size); err != nil {
			t.Fatalf("%d bytes: %v", size, err)
		}
	}
	wait(t, st)
	if err := st.CopyToHost(host[:2], b0, n-1); err == nil {
		t.Error("a copy past the buffer's end was enqueued")
	}
}

// TestCUDAEmulatorShowsMissingWait: with copies delayed, the bytes of an
// asynchronous copy into registered memory are not there before its event
// completes, so code that reads them without waiting fails its tests.
func TestCUDAEmulatorShowsMissingWait(t *testing.T) {
	// The emulator's, also under TENSORRPC_TEST_CUDA=real: what this
	// checks is the emulator (the real driver's copies are too fast to show
	// a missing wait reliably).
	t.Setenv("FAKECUDA_COPY_DELAY_US", "20000")
	c := emulator(t)
	const n = 64 << 10
	_, b0, _ := deviceBuffers(t, c, n)
	host := hostMemory(t, n)
	want := make([]byte, n)
	fillPattern(want, 9)
	if err := b0.CopyFromHost(want, 0); err != nil {
		t.Fatal(err)
	}
	reg := b0.HostRegistrar()
	if err := reg.RegisterHost(host); err != nil {
		t.Fatal(err)
	}
	defer reg.UnregisterHost(host)
	st, err := b0.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.CopyToHost(host, b0, 0); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(host, want) {
		t.Fatal("the copy's bytes were there before its event: a missing wait would go unnoticed")
	}
	wait(t, st)
	if !bytes.Equal(host, want) {
		t.Fatal("the bytes are wrong after the wait")
	}
	// Pageable (unregistered) memory is copied synchronously, as the
	// driver does.
	page := make([]byte, n)
	if err := st.CopyToHost(page, b0, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(page, want) {
		t.Error("a copy into pageable memory returned before its bytes were there")
	}
}

// emulator loads the driver emulator whatever TENSORRPC_TEST_CUDA says.
func emulator(t *testing.T) *gpudirect.CUDA {
	t.Helper()
	c, err := gpudirect.LoadCUDA(gpudirect.WithCUDALibrary(cudatest.Library(t)))
	if err != nil {
		t.Fatalf("loading the CUDA driver emulator: %v", err)
	}
	return c
}

func cudaCode(err error) int {
	var ce *gpudirect.CUDAError
	if errors.As(err, &ce) {
		return ce.Code
	}
	return -1
}

// TestCUDAHostRegisterErrors: the driver's errors for registering memory
// twice or in part, and unregistering what is not registered.
func TestCUDAHostRegisterErrors(t *testing.T) {
	c := cudatest.Load(t)
	reg := c.HostRegistrar(0)
	if reg == nil {
		t.Fatal("no HostRegistrar")
	}
	host := hostMemory(t, 1<<20)
	if err := reg.RegisterHost(host); err != nil {
		t.Fatal(err)
	}
	if err := reg.RegisterHost(host); cudaCode(err) != 712 {
		t.Errorf("registering twice: %v, want CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (712)", err)
	}
	if err := reg.RegisterHost(host[4096:8192]); cudaCode(err) != 712 {
		t.Errorf("registering part of a registered range: %v, want 712", err)
	}
	if err := reg.UnregisterHost(host); err != nil {
		t.Fatal(err)
	}
	if err := reg.UnregisterHost(host); cudaCode(err) != 713 {
		t.Errorf("unregistering twice: %v, want CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED (713)", err)
	}
}

// TestCUDAFailSwitch: FAKECUDA_FAIL fails the chosen call of an entry
// point, and the binding reports the driver's error.
func TestCUDAFailSwitch(t *testing.T) {
	// The failure switch is the emulator's: it runs on the emulator also
	// under TENSORRPC_TEST_CUDA=real.
	t.Setenv("FAKECUDA_FAIL", "cuMemcpyHtoDAsync:2:2")
	c := emulator(t)
	_, b0, _ := deviceBuffers(t, c, 4096)
	st, err := b0.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	src := hostMemory(t, 4096)
	if err := st.CopyFromHost(b0, 0, src); err != nil {
		t.Fatalf("first copy: %v", err)
	}
	if err := st.CopyFromHost(b0, 0, src); cudaCode(err) != 2 || !strings.Contains(err.Error(), "cuMemcpyHtoDAsync") {
		t.Errorf("second copy: %v, want CUDA_ERROR_OUT_OF_MEMORY (2) from cuMemcpyHtoDAsync", err)
	}
}

const ipcChildEnv = "GPUDIRECT_TEST_IPC_CHILD"

// TestCUDAIPCTwoProcesses: a buffer at a non-zero offset in its
// allocation, exported, is opened by another process, which reads its
// bytes and writes new ones that the exporter sees; opened at the
// allocation's base (the offset forgotten) it reads other bytes. Opening
// the handle in the exporting process fails, as with the driver.
func TestCUDAIPCTwoProcesses(t *testing.T) {
	c := cudatest.Load(t)
	const n = 256<<10 + 5
	_, b0, b1 := deviceBuffers(t, c, n)
	first := make([]byte, n)
	fillPattern(first, 0x11)
	if err := b0.CopyFromHost(first, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, n)
	fillPattern(want, 0x22)
	if err := b1.CopyFromHost(want, 0); err != nil {
		t.Fatal(err)
	}
	x, ok := b1.(gpudirect.IPCExporter)
	if !ok {
		t.Fatal("a CUDA buffer is not an IPCExporter")
	}
	h, err := x.IPCHandle()
	if err != nil {
		t.Fatal(err)
	}
	if h.Offset == 0 || h.Len != n {
		t.Fatalf("handle of the second buffer: offset %d, length %d", h.Offset, h.Len)
	}
	if _, err := c.OpenIPC(h); err == nil {
		t.Error("OpenIPC in the exporting process succeeded")
	}
	enc := func(h gpudirect.IPCHandle) string {
		var b []byte
		b = append(b, h.Handle[:]...)
		b = append(b, h.UUID[:]...)
		return hex.EncodeToString(b)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCUDAIPCChild$", "-test.v")
	cmd.Env = append(os.Environ(), ipcChildEnv+"="+enc(h), "GPUDIRECT_TEST_IPC_OFFSET="+strconv.FormatInt(h.Offset, 10), "GPUDIRECT_TEST_IPC_LEN="+strconv.FormatInt(h.Len, 10))
	if !cudatest.Real() {
		cmd.Env = append(cmd.Env, "GPUDIRECT_TEST_CUDA_LIB="+cudatest.Library(t))
	}
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestCUDAIPCChild") {
		t.Fatalf("the child process: %v\n%s", err, out)
	}
	got := make([]byte, n)
	if err := b1.CopyToHost(got, 0); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, n)
	fillPattern(back, 0x33)
	if !bytes.Equal(got, back) {
		t.Error("the child's writes through the handle are not in the exporter's buffer")
	}
}

// TestCUDAIPCChild is the other process of TestCUDAIPCTwoProcesses (the
// helper-process pattern of os/exec's tests): run without its
// environment, as in every ordinary run, it returns at once.
func TestCUDAIPCChild(t *testing.T) {
	enc := os.Getenv(ipcChildEnv)
	if enc == "" {
		return
	}
	raw, err := hex.DecodeString(enc)
	if err != nil || len(raw) != 80 {
		t.Fatalf("handle %q: %v", enc, err)
	}
	var h gpudirect.IPCHandle
	copy(h.Handle[:], raw[:64])
	copy(h.UUID[:], raw[64:])
	h.Offset, h.Len = atoi(t, os.Getenv("GPUDIRECT_TEST_IPC_OFFSET")), atoi(t, os.Getenv("GPUDIRECT_TEST_IPC_LEN"))
	var c *gpudirect.CUDA
	if lib := os.Getenv("GPUDIRECT_TEST_CUDA_LIB"); lib != "" {
		if c, err = gpudirect.LoadCUDA(gpudirect.WithCUDALibrary(lib)); err != nil {
			t.Fatal(err)
		}
	} else {
		c = cudatest.Load(t)
	}
	n := int(h.Len)
	b, err := c.OpenIPC(h)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if err := b.CopyToHost(got, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, n)
	fillPattern(want, 0x22)
	if !bytes.Equal(got, want) {
		t.Fatal("the opened handle's bytes differ from the exporter's")
	}
	back := make([]byte, n)
	fillPattern(back, 0x33)
	if err := b.CopyFromHost(back, 0); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	// The same handle without its offset names the allocation's base:
	// other bytes (the first buffer's).
	stale := h
	stale.Offset = 0
	sb, err := c.OpenIPC(stale)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Free()
	if err := sb.CopyToHost(got, 0); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(got, back) {
		t.Error("opened at the allocation's base, the handle still reads the buffer's bytes: a forgotten offset would go unnoticed")
	}
}

func atoi(t *testing.T, s string) int64 {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCUDAWrapChecksTheAllocation: wrapped memory must lie in one
// allocation.
func TestCUDAWrapChecksTheAllocation(t *testing.T) {
	c := cudatest.Load(t)
	_, b0, _ := deviceBuffers(t, c, 4096)
	ord, p, ok := gpudirect.CUDAPointer(b0)
	if !ok {
		t.Fatal("CUDAPointer of an allocator's buffer")
	}
	w, err := c.Wrap(ord, p, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := w.(gpudirect.AsyncBuffer); !ok {
		t.Error("a wrapped buffer is not an AsyncBuffer")
	}
	if err := w.Free(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wrap(ord, p, 1<<30); err == nil {
		t.Error("wrapping past the allocation's end succeeded")
	}
}
