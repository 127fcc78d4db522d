//go:build cgo

package main

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>

// trpc_libcuda_mapped reports whether libcuda.so.1 is loaded in the
// process already (by PyTorch, say), without loading it.
static int trpc_libcuda_mapped(void) {
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (h == NULL) {
		return 0;
	}
	dlclose(h);
	return 1;
}
*/
import "C"

import (
	"os"
	"sync"

	"google.golang.org/grpc/codes"

	"github.com/tensorrpc/tensorrpc/gpudirect"
)

// The CUDA driver of device tensors (ABI version 5), loaded on the first
// call that needs it: from $TENSORRPC_CUDA_LIBRARY when set (a driver
// emulator in tests, a libcuda.so elsewhere), else libcuda.so.1.

// cudaLibraryEnv names the environment variable that chooses the driver.
const cudaLibraryEnv = "TENSORRPC_CUDA_LIBRARY"

// cudaDriver holds the driver once loaded. A failed load is not
// remembered: a later call tries again (the environment may have changed,
// and a failure costs only a dlopen).
var cudaDriver struct {
	mu   sync.Mutex
	cuda *gpudirect.CUDA
}

// loadCUDA returns the driver, loading it on the first call. Without one
// it fails with FailedPrecondition and a message that starts "no CUDA
// driver".
func loadCUDA() (*gpudirect.CUDA, error) {
	cudaDriver.mu.Lock()
	defer cudaDriver.mu.Unlock()
	if cudaDriver.cuda != nil {
		return cudaDriver.cuda, nil
	}
	var opts []gpudirect.CUDAOption
	from := "libcuda.so.1"
	if path := os.Getenv(cudaLibraryEnv); path != "" {
		opts = append(opts, gpudirect.WithCUDALibrary(path))
		from = path
	}
	c, err := gpudirect.LoadCUDA(opts...)
	if err != nil {
		return nil, errorf(codes.FailedPrecondition, "no CUDA driver for device tensors (%s, %s to choose another): %v", from, cudaLibraryEnv, err)
	}
	cudaDriver.cuda = c
	return c, nil
}

// sessionCUDA returns the driver for the CUDA IPC of a new Client or
// Server (rpc.WithCUDA), or nil, when loading it costs nothing worth
// saying: the library loaded it already (a device call), or
// $TENSORRPC_CUDA_LIBRARY names one, or libcuda.so.1 is loaded in the
// process already (a CUDA build of PyTorch that initialised CUDA). A
// process that never touched CUDA does not load it for a CPU-only
// Client. Without it, CUDA tensors still move, staged through host
// memory.
func sessionCUDA() *gpudirect.CUDA {
	cudaDriver.mu.Lock()
	c := cudaDriver.cuda
	cudaDriver.mu.Unlock()
	if c != nil {
		return c
	}
	if os.Getenv(cudaLibraryEnv) == "" && C.trpc_libcuda_mapped() == 0 {
		return nil
	}
	c, _ = loadCUDA()
	return c
}

// cudaDevice returns the driver after checking that it has the device with
// this ordinal (InvalidArgument when not).
func cudaDevice(ordinal int) (*gpudirect.CUDA, error) {
	c, err := loadCUDA()
	if err != nil {
		return nil, err
	}
	if n := len(c.Devices()); ordinal < 0 || ordinal >= n {
		return nil, errorf(codes.InvalidArgument, "no CUDA device %d: the driver lists %d (cuda:0 to cuda:%d)", ordinal, n, n-1)
	}
	return c, nil
}

// wrapCUDA describes n bytes of the caller's device memory at ptr on the
// device ordinal as a DeviceBuffer; Free forgets it (the memory stays the
// caller's).
func wrapCUDA(c *gpudirect.CUDA, ordinal int, ptr uint64, n int) (gpudirect.DeviceBuffer, error) {
	b, err := c.Wrap(ordinal, ptr, n)
	if err != nil {
		return nil, errorf(codes.InvalidArgument, "cuda:%d memory at %#x (%d bytes): %v", ordinal, ptr, n, err)
	}
	return b, nil
}

// Device memory for tensors fetched onto a device: tensors up to
// sharedArenaMax bytes are carved from arenas of sharedArenaSize bytes
// (one cuMemAlloc each, added while they are full); a larger tensor gets
// an allocation of its own, freed with it. An arena is freed when its last
// tensor goes, except one empty arena per device kept for the next fetch.
const (
	sharedArenaSize = 64 << 20
	sharedArenaMax  = 16 << 20
)

type deviceArena struct {
	alloc     *gpudirect.CUDAAllocator
	ordinal   int
	size      int
	live      int // buffers carved and not freed; guarded by deviceMem.mu
	dedicated bool
}

// deviceAlloc is n bytes of device memory the library owns.
type deviceAlloc struct {
	buf     gpudirect.DeviceBuffer // nil when n is 0
	arena   *deviceArena
	ordinal int
	ptr     uint64
	n       int
}

var deviceMem = struct {
	mu     sync.Mutex
	arenas map[int][]*deviceArena // by ordinal
}{arenas: map[int][]*deviceArena{}}

// allocDevice allocates n bytes on the device ordinal.
func allocDevice(c *gpudirect.CUDA, ordinal, n int) (*deviceAlloc, error) {
	if n == 0 {
		return &deviceAlloc{ordinal: ordinal}, nil
	}
	deviceMem.mu.Lock()
	defer deviceMem.mu.Unlock()
	if n <= sharedArenaMax {
		for _, a := range deviceMem.arenas[ordinal] {
			if a.dedicated {
				continue
			}
			if buf, err := a.alloc.Alloc(n); err == nil {
				return a.carved(buf, n)
			}
		}
	}
	size := sharedArenaSize
	if n > sharedArenaMax {
		size = n
	}
	alloc, err := c.NewAllocator(ordinal, size, nil)
	if err != nil {
		return nil, errorf(codes.ResourceExhausted, "allocating %d bytes on cuda:%d: %v", size, ordinal, err)
	}
	a := &deviceArena{alloc: alloc, ordinal: ordinal, size: size, dedicated: n > sharedArenaMax}
	buf, err := alloc.Alloc(n)
	if err != nil {
		alloc.Close()
		return nil, errorf(codes.ResourceExhausted, "carving %d bytes on cuda:%d: %v", n, ordinal, err)
	}
	deviceMem.arenas[ordinal] = append(deviceMem.arenas[ordinal], a)
	return a.carved(buf, n)
}

// carved records buf, just carved from a; deviceMem.mu is held.
func (a *deviceArena) carved(buf gpudirect.DeviceBuffer, n int) (*deviceAlloc, error) {
	ordinal, ptr, ok := gpudirect.CUDAPointer(buf)
	if !ok || ordinal != a.ordinal {
		buf.Free()
		return nil, errorf(codes.Internal, "%s buffer has no device address", buf.Device())
	}
	a.live++
	return &deviceAlloc{buf: buf, arena: a, ordinal: ordinal, ptr: ptr, n: n}, nil
}

// free gives the memory back, and its arena when that is now empty
// (keeping one empty shared arena per device).
func (d *deviceAlloc) free() {
	if d.buf == nil {
		return
	}
	d.buf.Free()
	deviceMem.mu.Lock()
	defer deviceMem.mu.Unlock()
	a := d.arena
	if a.live--; a.live > 0 {
		return
	}
	keep := !a.dedicated
	if keep {
		for _, o := range deviceMem.arenas[a.ordinal] {
			if o != a && !o.dedicated && o.live == 0 {
				keep = false // another empty shared arena is kept already
			}
		}
	}
	if keep {
		return
	}
	list := deviceMem.arenas[a.ordinal]
	for i, o := range list {
		if o == a {
			deviceMem.arenas[a.ordinal] = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	a.alloc.Close()
}

// deviceStats counts the library's device memory on one device: live
// buffers and their bytes, arenas and their bytes.
func deviceStats(ordinal int) (buffers, bytes, arenas, arenaBytes int64) {
	deviceMem.mu.Lock()
	defer deviceMem.mu.Unlock()
	for _, a := range deviceMem.arenas[ordinal] {
		arenas++
		arenaBytes += int64(a.size)
		buffers += int64(a.live)
	}
	tensors.mu.Lock()
	defer tensors.mu.Unlock()
	for _, o := range tensors.byHandle {
		if o.dev != nil && o.dev.mem.ordinal == ordinal {
			bytes += int64(o.dev.mem.n)
		}
	}
	return buffers, bytes, arenas, arenaBytes
}
