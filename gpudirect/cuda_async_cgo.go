//go:build linux && cgo

package gpudirect

/*
#include <stdlib.h>
#include <string.h>
#include "cuda_shim.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// The cgo side of cudaAsync. The host side of an asynchronous copy is read
// or written after the call returns, so it must not be Go memory (cgo's
// rules): staging copies pool memory, which is mapped outside the Go heap.

func (l *cudaLib) missing(fn string, r C.int) error {
	if r == C.TR_MISSING {
		return fmt.Errorf("gpudirect: the CUDA driver has no %s", fn)
	}
	return l.fail(fn, r)
}

func (l *cudaLib) asyncReady() bool { return C.tr_cu_async_ready(l.c) != 0 }
func (l *cudaLib) ipcReady() bool   { return C.tr_cu_ipc_ready(l.c) != 0 }

func (l *cudaLib) streamCreate(dev int) (unsafe.Pointer, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return nil, err
	}
	var s C.tr_stream
	if err := l.missing("cuStreamCreate", C.tr_cu_stream_create(l.c, ctx, &s)); err != nil {
		return nil, err
	}
	return unsafe.Pointer(s), nil
}

func stream(s unsafe.Pointer) C.tr_stream { return C.tr_stream(s) }
func event(e unsafe.Pointer) C.tr_event   { return C.tr_event(e) }

func (l *cudaLib) streamDestroy(dev int, s unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuStreamDestroy", C.tr_cu_stream_destroy(l.c, ctx, stream(s)))
}

func (l *cudaLib) streamSync(dev int, s unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuStreamSynchronize", C.tr_cu_stream_sync(l.c, ctx, stream(s)))
}

func (l *cudaLib) copyToDeviceAsync(dev int, dst uint64, src []byte, s unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuMemcpyHtoDAsync", C.tr_cu_htod_async(l.c, ctx, C.tr_devptr(dst), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)), stream(s)))
}

func (l *cudaLib) copyFromDeviceAsync(dev int, dst []byte, src uint64, s unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuMemcpyDtoHAsync", C.tr_cu_dtoh_async(l.c, ctx, unsafe.Pointer(unsafe.SliceData(dst)), C.tr_devptr(src), C.size_t(len(dst)), stream(s)))
}

func (l *cudaLib) copyDeviceAsync(dev int, dst, src uint64, n int, s unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuMemcpyDtoDAsync", C.tr_cu_dtod_async(l.c, ctx, C.tr_devptr(dst), C.tr_devptr(src), C.size_t(n), stream(s)))
}

func (l *cudaLib) eventCreate(dev int) (unsafe.Pointer, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return nil, err
	}
	var e C.tr_event
	if err := l.missing("cuEventCreate", C.tr_cu_event_create(l.c, ctx, &e)); err != nil {
		return nil, err
	}
	return unsafe.Pointer(e), nil
}

func (l *cudaLib) eventRecord(dev int, e, s unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuEventRecord", C.tr_cu_event_record(l.c, ctx, event(e), stream(s)))
}

// cudaErrorNotReady is CUDA_ERROR_NOT_READY: cuEventQuery's "not yet".
const cudaErrorNotReady = 600

func (l *cudaLib) eventQuery(dev int, e unsafe.Pointer) (bool, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return false, err
	}
	r := C.tr_cu_event_query(l.c, ctx, event(e))
	if r == cudaErrorNotReady {
		return false, nil
	}
	return r == 0, l.missing("cuEventQuery", r)
}

func (l *cudaLib) eventSync(dev int, e unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuEventSynchronize", C.tr_cu_event_sync(l.c, ctx, event(e)))
}

func (l *cudaLib) eventDestroy(dev int, e unsafe.Pointer) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuEventDestroy", C.tr_cu_event_destroy(l.c, ctx, event(e)))
}

func (l *cudaLib) hostRegister(dev int, b []byte) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuMemHostRegister", C.tr_cu_host_register(l.c, ctx, unsafe.Pointer(unsafe.SliceData(b)), C.size_t(len(b))))
}

func (l *cudaLib) hostUnregister(dev int, b []byte) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuMemHostUnregister", C.tr_cu_host_unregister(l.c, ctx, unsafe.Pointer(unsafe.SliceData(b))))
}

func (l *cudaLib) ipcGet(dev int, p uint64) ([64]byte, error) {
	var h [64]byte
	ctx, err := l.context(dev)
	if err != nil {
		return h, err
	}
	var ch C.tr_ipc_handle
	if err := l.missing("cuIpcGetMemHandle", C.tr_cu_ipc_get(l.c, ctx, &ch, C.tr_devptr(p))); err != nil {
		return h, err
	}
	copy(h[:], unsafe.Slice((*byte)(unsafe.Pointer(&ch)), 64))
	return h, nil
}

func (l *cudaLib) ipcOpen(dev int, h [64]byte) (uint64, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return 0, err
	}
	var ch C.tr_ipc_handle
	C.memcpy(unsafe.Pointer(&ch), unsafe.Pointer(&h[0]), 64)
	var p C.tr_devptr
	if err := l.missing("cuIpcOpenMemHandle", C.tr_cu_ipc_open(l.c, ctx, &p, &ch)); err != nil {
		return 0, err
	}
	return uint64(p), nil
}

func (l *cudaLib) ipcClose(dev int, p uint64) error {
	ctx, err := l.context(dev)
	if err != nil {
		return err
	}
	return l.missing("cuIpcCloseMemHandle", C.tr_cu_ipc_close(l.c, ctx, C.tr_devptr(p)))
}

func (l *cudaLib) addressRange(dev int, p uint64) (uint64, uint64, error) {
	ctx, err := l.context(dev)
	if err != nil {
		return 0, 0, err
	}
	var base C.tr_devptr
	var size C.size_t
	if err := l.missing("cuMemGetAddressRange", C.tr_cu_address_range(l.c, ctx, &base, &size, C.tr_devptr(p))); err != nil {
		return 0, 0, err
	}
	return uint64(base), uint64(size), nil
}

func (l *cudaLib) deviceUUID(dev int) ([16]byte, error) {
	var u [16]byte
	h, err := l.handle(dev)
	if err != nil {
		return u, err
	}
	var cu C.tr_uuid
	if err := l.missing("cuDeviceGetUuid", C.tr_cu_device_uuid(l.c, &cu, h)); err != nil {
		return u, err
	}
	copy(u[:], unsafe.Slice((*byte)(unsafe.Pointer(&cu)), 16))
	return u, nil
}
