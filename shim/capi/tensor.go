package main

/*
#include <stdlib.h>
#include "tensorrpc.h"
*/
import "C"

import (
	"unsafe"

	"google.golang.org/grpc/codes"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// ABIVersion is the version of the C ABI (TRPC_ABI_VERSION in
// tensorrpc.h); the Python package refuses a library with another one.
// Version 2 appended data_address to trpc_options (a caller built against
// version 1 passes a shorter struct) and made a fetch of a key that is not
// published fail at once unless TRPC_FETCH_WAIT is given. Version 3 added
// DLPack 1.0 (trpc_dlpack_share_versioned, trpc_dlpack_flags) and error
// details (trpc_reply_set_error_details, trpc_error_details). Version 4
// added rows and fetches into the caller's memory (trpc_client_fetch_into,
// trpc_client_fetch_rows, trpc_client_send_rows, trpc_server_publish_flags).
// Version 5 added CUDA tensors (device.go, cuda.go), version 6
// trpc_server_publish_device, version 7 trpc_client_fetch_tensor and
// trpc_last_error (a fetch without out-parameters).
const ABIVersion = C.TRPC_ABI_VERSION

// DLPack device types (DLDeviceType).
const (
	dlCPU  = 1 // kDLCPU
	dlCUDA = 2 // kDLCUDA
)

// addrOf is the address of b's first byte.
func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// layoutOf checks the layout of the caller's tensor dl (rank, shape,
// dtype, C-contiguous strides) on any device and returns its dtype, shape
// and size in bytes.
func layoutOf(dl *C.DLTensor) (zerocopy.DType, []int64, int64, error) {
	ndim := int(dl.ndim)
	if ndim < 0 || ndim > zerocopy.MaxRank {
		return 0, nil, 0, errorf(codes.InvalidArgument, "tensor has %d dimensions; 0 to %d are allowed", ndim, zerocopy.MaxRank)
	}
	if ndim > 0 && dl.shape == nil {
		return 0, nil, 0, errorf(codes.InvalidArgument, "tensor has %d dimensions and a NULL shape", ndim)
	}
	shape := make([]int64, ndim)
	if ndim > 0 {
		copy(shape, unsafe.Slice((*int64)(unsafe.Pointer(dl.shape)), ndim))
	}
	dtype, err := zerocopy.DTypeFromDLPack(uint8(dl.dtype.code), uint8(dl.dtype.bits), uint16(dl.dtype.lanes))
	if err != nil {
		return 0, nil, 0, errorf(codes.InvalidArgument, "unsupported dtype: %v", err)
	}
	n, err := zerocopy.ByteSize(dtype, shape)
	if err != nil {
		return 0, nil, 0, errorf(codes.InvalidArgument, "%v", err)
	}
	if dl.strides != nil && n > 0 {
		strides := unsafe.Slice((*int64)(unsafe.Pointer(dl.strides)), ndim)
		want := int64(1)
		for i := ndim - 1; i >= 0; i-- {
			if shape[i] != 1 && strides[i] != want {
				return 0, nil, 0, errorf(codes.InvalidArgument, "tensor %s%v with strides %v is not C-contiguous", dtype, shape, strides)
			}
			want *= shape[i]
		}
	}
	if n > 0 && dl.data == nil {
		return 0, nil, 0, errorf(codes.InvalidArgument, "tensor %s%v has NULL data", dtype, shape)
	}
	return dtype, shape, n, nil
}

// fromDL describes the caller's tensor dl as a zerocopy.Tensor over the
// caller's memory. The result must not be used after the call that passed
// dl returns: the caller may free the memory then.
func fromDL(dl *C.DLTensor) (zerocopy.Tensor, error) {
	if dl == nil {
		return zerocopy.Tensor{}, errorf(codes.InvalidArgument, "NULL tensor")
	}
	if dl.device.device_type != dlCPU {
		return zerocopy.Tensor{}, errorf(codes.InvalidArgument, "tensor is on DLPack device type %d; only CPU memory (1) can be used here", int(dl.device.device_type))
	}
	dtype, shape, n, err := layoutOf(dl)
	if err != nil {
		return zerocopy.Tensor{}, err
	}
	var data []byte
	if n > 0 {
		data = unsafe.Slice((*byte)(unsafe.Add(dl.data, uintptr(dl.byte_offset))), n)
	}
	zt, err := zerocopy.New(dtype, shape, data)
	if err != nil {
		return zerocopy.Tensor{}, errorf(codes.InvalidArgument, "%v", err)
	}
	return zt, nil
}

// newTensorFunc allocates a tensor in a pool (a client's or a server's),
// for staging a device tensor.
type newTensorFunc func(dtype zerocopy.DType, shape []int64) (*rpc.Tensor, error)

// input makes an rpc.Tensor for the caller's tensor dl. When dl is exactly
// a tensor the shim handed out, it returns that tensor, so that sending or
// publishing it needs no copy from caller memory; otherwise a wrapped
// tensor over the caller's memory. A CUDA tensor (kDLCUDA) is staged: its
// bytes are copied into a tensor from stage, or refused when stage is nil.
// done drops what input holds.
func input(dl *C.DLTensor, stage newTensorFunc) (t *rpc.Tensor, done func(), err error) {
	if dl != nil && dl.device.device_type == dlCUDA && stage != nil {
		t, err := stageDevice(dl, stage)
		if err != nil {
			return nil, nil, err
		}
		return t, t.Release, nil
	}
	zt, err := fromDL(dl)
	if err != nil {
		return nil, nil, err
	}
	if h, o, ok := lookup(zt); ok {
		return o.t, func() { unref(h) }, nil
	}
	return rpc.WrapTensor(zt), func() {}, nil
}

// inputs is input for an array of n DLTensors.
func inputs(dls *C.DLTensor, n C.int64_t, stage newTensorFunc) ([]*rpc.Tensor, func(), error) {
	if n < 0 || (n > 0 && dls == nil) {
		return nil, nil, errorf(codes.InvalidArgument, "bad tensor array (%d tensors)", int64(n))
	}
	var ts []*rpc.Tensor
	var dones []func()
	done := func() {
		for _, d := range dones {
			d()
		}
	}
	all := unsafe.Slice(dls, int(n))
	for i := range all {
		t, d, err := input(&all[i], stage)
		if err != nil {
			done()
			return nil, nil, errorf(codes.InvalidArgument, "tensor %d: %v", i, statusMessage(err))
		}
		ts, dones = append(ts, t), append(dones, d)
	}
	return ts, done, nil
}

// export hands t out as a new DLManagedTensor that owns t: its deleter
// releases t. On failure t is released.
func export(t *rpc.Tensor, srv *serverEntry) (*C.DLManagedTensor, error) {
	h := adopt(t, srv)
	m, err := managed(h, t.Tensor)
	if err != nil {
		unref(h)
	}
	return m, err
}

// managed allocates a DLManagedTensor describing t that owns one reference
// of handle h.
func managed(h uint64, t zerocopy.Tensor) (*C.DLManagedTensor, error) {
	shape := t.Shape()
	m := C.trpc_managed_alloc(C.int32_t(len(shape)), C.uint64_t(h))
	if m == nil {
		return nil, errorf(codes.ResourceExhausted, "malloc of a DLManagedTensor failed")
	}
	code, bits, lanes := t.DType().DLPack()
	m.dl_tensor.dtype = C.DLDataType{code: C.uint8_t(code), bits: C.uint8_t(bits), lanes: C.uint16_t(lanes)}
	copy(unsafe.Slice((*int64)(unsafe.Pointer(m.dl_tensor.shape)), len(shape)), shape)
	if b := t.Bytes(); len(b) > 0 {
		// Pool memory is mmap'd, not Go heap, so C may keep this pointer.
		m.dl_tensor.data = unsafe.Pointer(unsafe.SliceData(b))
	}
	return m, nil
}

// exportAll exports ts into a malloc'd array of n DLManagedTensor pointers.
// It takes over every tensor of ts, also on failure.
func exportAll(ts []*rpc.Tensor, srv *serverEntry) (**C.DLManagedTensor, error) {
	if len(ts) == 0 {
		return nil, nil
	}
	arr := (**C.DLManagedTensor)(C.calloc(C.size_t(len(ts)), C.size_t(unsafe.Sizeof(uintptr(0)))))
	if arr == nil {
		for _, t := range ts {
			t.Release()
		}
		return nil, errorf(codes.ResourceExhausted, "malloc of a tensor array failed")
	}
	out := unsafe.Slice(arr, len(ts))
	for i, t := range ts {
		m, err := export(t, srv)
		if err != nil {
			for _, m := range out[:i] {
				C.trpc_managed_deleter(m)
			}
			for _, t := range ts[i+1:] {
				t.Release()
			}
			C.free(unsafe.Pointer(arr))
			return nil, err
		}
		out[i] = m
	}
	return arr, nil
}

//export trpcgo_tensor_unref
func trpcgo_tensor_unref(h C.uint64_t) { unref(uint64(h)) }

// refManaged takes a reference to the tensor behind m, a DLManagedTensor
// this library made; false for NULL or an already deleted m. unref(h)
// drops it.
func refManaged(m *C.DLManagedTensor) (uint64, *ownedTensor, bool) {
	if m == nil {
		return 0, nil, false
	}
	h := uint64(uintptr(m.manager_ctx))
	o, ok := ref(h)
	return h, o, ok
}

// trpc_dlpack_share returns a new DLManagedTensor over the same memory as
// m, holding its own reference: the memory stays valid until both have
// been deleted. It returns NULL when m is NULL or already deleted.
//
//export trpc_dlpack_share
func trpc_dlpack_share(m *C.DLManagedTensor) *C.DLManagedTensor {
	h, o, ok := refManaged(m)
	if !ok {
		return nil
	}
	out, err := o.managed(h)
	if err != nil {
		unref(h)
		return nil
	}
	return out
}

// managed is a new DLManagedTensor describing o that owns one reference
// of handle h.
func (o *ownedTensor) managed(h uint64) (*C.DLManagedTensor, error) {
	if o.dev != nil {
		return managedDevice(h, o.dev)
	}
	return managed(h, o.t.Tensor)
}

// trpc_dlpack_flags is the DLPack 1.0 flags of m's memory:
// DLPACK_FLAG_BITMASK_READ_ONLY for a shared-memory lease, else 0 (also for
// NULL or a deleted m).
//
//export trpc_dlpack_flags
func trpc_dlpack_flags(m *C.DLManagedTensor) C.uint64_t {
	h, o, ok := refManaged(m)
	if !ok {
		return 0
	}
	defer unref(h)
	return dlpackFlags(o.t)
}

func dlpackFlags(t *rpc.Tensor) C.uint64_t {
	if t != nil && t.Leased() {
		return C.DLPACK_FLAG_BITMASK_READ_ONLY
	}
	return 0
}

// trpc_dlpack_share_versioned returns a DLPack 1.0 DLManagedTensorVersioned
// over m's memory with its own reference (copy == 0), read-only for a
// lease, or a malloc'd copy of m's data (copy != 0). It returns NULL when m
// is NULL or already deleted, or malloc fails.
//
//export trpc_dlpack_share_versioned
func trpc_dlpack_share_versioned(m *C.DLManagedTensor, copyData C.int) *C.DLManagedTensorVersioned {
	h, o, ok := refManaged(m)
	if !ok {
		return nil
	}
	if copyData != 0 {
		defer unref(h)
		if o.dev != nil {
			return nil // a copy would be device memory: not made here
		}
		return C.trpc_versioned_copy(&m.dl_tensor, C.size_t(len(o.t.Bytes())))
	}
	inner, err := o.managed(h)
	if err != nil {
		unref(h)
		return nil
	}
	return C.trpc_versioned_wrap(inner, dlpackFlags(o.t))
}

// trpc_live_tensors is the number of tensors the shim has handed out whose
// DLManagedTensors have not all been deleted.
//
//export trpc_live_tensors
func trpc_live_tensors() C.int64_t { return C.int64_t(liveTensors()) }

// trpc_free frees memory the library returned (messages, strings, arrays).
//
//export trpc_free
func trpc_free(p unsafe.Pointer) { C.free(p) }

// trpc_abi_version is the version of this C ABI.
//
//export trpc_abi_version
func trpc_abi_version() C.int { return ABIVersion }
