//go:build linux && cgo

package gpudirect

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "cuda_shim.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// builtWithCUDALoader is true when LoadCUDA can dlopen a driver.
const builtWithCUDALoader = true

// cudaLib is the CUDA driver reached through dlopen. Only integers and C
// pointers cross into C, except the host side of copies, which the driver
// reads or writes during the call and does not keep.
type cudaLib struct {
	c *C.tr_cuda

	mu       sync.Mutex
	handles  map[int]C.int    // ordinal → CUdevice
	contexts map[int]C.tr_ctx // ordinal → retained primary context
	refs     map[int]int
}

// cudaLibs holds the libraries loaded so far, by path: dlopen hands back
// the same library anyway, and its primary contexts are per process.
var cudaLibs struct {
	sync.Mutex
	byPath map[string]*cudaLib
}

func openCUDA(path string) (cudaAPI, error) {
	cudaLibs.Lock()
	defer cudaLibs.Unlock()
	if l, ok := cudaLibs.byPath[path]; ok {
		return l, nil
	}
	l, err := loadCUDALib(path)
	if err != nil {
		return nil, err
	}
	if cudaLibs.byPath == nil {
		cudaLibs.byPath = map[string]*cudaLib{}
	}
	cudaLibs.byPath[path] = l
	return l, nil
}

func loadCUDALib(path string) (*cudaLib, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	var notFound C.int
	c := C.tr_cuda_open(cpath, &cerr, &notFound)
	if c == nil {
		msg := C.GoString(cerr)
		C.free(unsafe.Pointer(cerr))
		switch {
		case notFound != 0 && path == cudaDefaultLibrary:
			return nil, fmt.Errorf("%w: libcuda.so.1 not found: no NVIDIA driver on this host; using host staging (dlopen: %s)", ErrUnavailable, msg)
		case notFound != 0:
			return nil, fmt.Errorf("%w: %s not found; using host staging (dlopen: %s)", ErrUnavailable, path, msg)
		}
		return nil, fmt.Errorf("%w: %s cannot be used: %s; using host staging", ErrUnavailable, path, msg)
	}
	l := &cudaLib{c: c, handles: map[int]C.int{}, contexts: map[int]C.tr_ctx{}, refs: map[int]int{}}
	if r := C.tr_cu_init(c); r != 0 {
		err := l.fail("cuInit", r)
		switch int(r) {
		case cudaErrorNoDevice:
			return nil, fmt.Errorf("%w: %s is loaded but finds no CUDA device; using host staging (%v)", ErrUnavailable, path, err)
		case cudaErrorStubLibrary:
			return nil, fmt.Errorf("%w: %s is the CUDA toolkit's stub, not a driver; using host staging (%v)", ErrUnavailable, path, err)
		}
		return nil, fmt.Errorf("%w: %s is loaded but cuInit failed; using host staging (%v)", ErrUnavailable, path, err)
	}
	return l, nil
}

func (l *cudaLib) fail(fn string, r C.int) error {
	if r == 0 {
		return nil
	}
	e := &CUDAError{Func: fn, Code: int(r)}
	if s := C.tr_cu_error_name(l.c, r); s != nil {
		e.Name = C.GoString(s)
	}
	if s := C.tr_cu_error_string(l.c, r); s != nil {
		e.Text = C.GoString(s)
	}
	return e
}

func (l *cudaLib) driverVersion() (int, error) {
	var v C.int
	return int(v), l.fail("cuDriverGetVersion", C.tr_cu_driver_version(l.c, &v))
}

func (l *cudaLib) deviceCount() (int, error) {
	var n C.int
	return int(n), l.fail("cuDeviceGetCount", C.tr_cu_device_count(l.c, &n))
}

func (l *cudaLib) handle(dev int) (C.int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if h, ok := l.handles[dev]; ok {
		return h, nil
	}
	var h C.int
	if err := l.fail("cuDeviceGet", C.tr_cu_device_get(l.c, &h, C.int(dev))); err != nil {
		return 0, err
	}
	l.handles[dev] = h
	return h, nil
}

func (l *cudaLib) deviceName(dev int) (string, error) {
	h, err := l.handle(dev)
	if err != nil {
		return "", err
	}
	buf := (*C.char)(C.calloc(maxCUDADeviceNameBytes, 1))
	defer C.free(unsafe.Pointer(buf))
	if err := l.fail("cuDeviceGetName", C.tr_cu_device_name(l.c, buf, maxCUDADeviceNameBytes-1, h)); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

func (l *cudaLib) deviceAttribute(dev, attr int) (int, error) {
	h, err := l.handle(dev)
	if err != nil {
		return 0, err
	}
	var v C.int
	return int(v), l.fail("cuDeviceGetAttribute", C.tr_cu_device_attribute(l.c, &v, C.int(attr), h))
}

func (l *cudaLib) totalMemory(dev int) (uint64, error) {
	h, err := l.handle(dev)
	if err != nil {
		return 0, err
	}
	var n C.size_t
	return uint64(n), l.fail("cuDeviceTotalMem", C.tr_cu_device_total_mem(l.c, &n, h))
}

func (l *cudaLib) retain(dev int) error {
	h, err := l.handle(dev)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var ctx C.tr_ctx
	if err := l.fail("cuDevicePrimaryCtxRetain", C.tr_cu_primary_retain(l.c, &ctx, h)); err != nil {
		return err
	}
	l.contexts[dev] = ctx
	l.refs[dev]++
	return nil
}

func (l *cudaLib) release(dev int) error {
	h, err := l.handle(dev)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.refs[dev] == 0 {
		return fmt.Errorf("gpudirect: cuda:%d: primary context released more often than retained", dev)
	}
	if l.refs[dev]--; l.refs[dev] == 0 {
		delete(l.contexts, dev)
	}
	return l.fail("cuDevicePrimaryCtxRelease", C.tr_cu_primary_release(l.c, h))
}

func (l *cudaLib) context(dev int) (C.tr_ctx, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ctx, ok := l.contexts[dev]
	if !ok {
		return nil, fmt.Errorf("gpudirect: cuda:%d: no retained context", dev)
	}
	return ctx, nil
}

func (l *cudaLib) memAlloc(dev, n int) (uint64, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return 0, err
	}
	var p C.tr_devptr
	return uint64(p), l.fail("cuMemAlloc", C.tr_cu_mem_alloc(l.c, ctx, &p, C.size_t(n)))
}

func (l *cudaLib) memFree(dev int, p uint64) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.fail("cuMemFree", C.tr_cu_mem_free(l.c, ctx, C.tr_devptr(p)))
}

// copyToDevice and copyFromDevice pass a Go slice's address to C: the
// slice holds no Go pointers, and the driver is done with it when the
// synchronous copy returns, as cgo's pointer rules require.
func (l *cudaLib) copyToDevice(dev int, dst uint64, src []byte) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.fail("cuMemcpyHtoD", C.tr_cu_htod(l.c, ctx, C.tr_devptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func (l *cudaLib) copyFromDevice(dev int, dst []byte, src uint64) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.fail("cuMemcpyDtoH", C.tr_cu_dtoh(l.c, ctx, unsafe.Pointer(&dst[0]), C.tr_devptr(src), C.size_t(len(dst))))
}

func (l *cudaLib) syncMemops(dev int, p uint64) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.fail("cuPointerSetAttribute(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS)", C.tr_cu_sync_memops(l.c, ctx, C.tr_devptr(p)))
}

func (l *cudaLib) exportDMABuf(dev int, p uint64, n int) (int, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return -1, err
	}
	var fd C.int = -1
	r := C.tr_cu_dmabuf(l.c, ctx, &fd, C.tr_devptr(p), C.size_t(n))
	if r == C.TR_MISSING {
		return -1, fmt.Errorf("the driver has no cuMemGetHandleForAddressRange (CUDA 11.7 or later)")
	}
	if err := l.fail("cuMemGetHandleForAddressRange", r); err != nil {
		return -1, err
	}
	return int(fd), nil
}

func (l *cudaLib) closeFD(fd int) error { return unix.Close(fd) }

// view makes a slice over device addresses so that the ibv provider can
// register them: it passes only the address to ibv_reg_mr. The CPU must
// never dereference it (GPU memory is not mapped for the CPU), and the Go
// collector ignores it, since it points outside the Go heap.
func (l *cudaLib) view(p uint64, n int) []byte {
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(C.tr_devptr_addr(C.tr_devptr(p))), n)
}
