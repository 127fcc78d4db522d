package main

/*
#include "tensorrpc.h"
*/
import "C"

import (
	"context"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Device tensors (ABI version 5): CUDA tensors (DLPack kDLCUDA) in and
// out. Sends go through rpc's SendDevice; fetches through FetchDevice,
// into memory allocated once the size is known, so they take CUDA IPC or
// the pinned, pipelined staged read where the session has them; a server
// with the driver publishes CUDA tensors in place
// (trpc_server_publish_device, ABI version 6). Calls and handler replies
// stage through pool buffers.
//
// Streams. The library's device copies are ordered after the legacy
// default stream (cuMemcpy without a stream, or streams created blocking),
// so a tensor whose producer made it ready on the legacy default stream
// (DLPack: __dlpack__(stream=1)) needs nothing more. A fetched tensor is
// complete on the device when the fetch returns: a consumer needs no
// synchronisation for it on any stream.

// Stream arguments of trpc_client_send_device (CUstream values; DLPack's
// stream numbers for CUDA).
const (
	streamDefault   = 0 // the NULL stream: the legacy default stream
	streamLegacy    = 1 // CU_STREAM_LEGACY
	streamPerThread = 2 // CU_STREAM_PER_THREAD
)

// deviceIn is the caller's tensor in CUDA memory.
type deviceIn struct {
	ordinal int
	ptr     uint64 // data + byte_offset
	n       int
	t       rpc.DeviceTensor // Buffer and Offset set by open
	done    func()
}

// openDevice checks the caller's CUDA tensor dl and describes its memory
// as a DeviceBuffer: the library's own device tensor when dl is one (no
// wrap), else the caller's memory wrapped (gpudirect's CUDA.Wrap); nil for
// a tensor of 0 bytes. done drops what it holds; the caller's memory is
// never freed.
func openDevice(dl *C.DLTensor) (*deviceIn, error) {
	if dl == nil {
		return nil, errorf(codes.InvalidArgument, "NULL tensor")
	}
	if dl.device.device_type != dlCUDA {
		return nil, errorf(codes.InvalidArgument, "tensor is on DLPack device type %d, not CUDA (2)", int(dl.device.device_type))
	}
	dtype, shape, n, err := layoutOf(dl)
	if err != nil {
		return nil, err
	}
	in := &deviceIn{ordinal: int(dl.device.device_id), n: int(n), done: func() {}}
	in.t.DType, in.t.Shape = dtype, shape
	c, err := cudaDevice(in.ordinal)
	if err != nil {
		return nil, err
	}
	// A device address is a number, never dereferenced by Go.
	in.ptr = uint64(uintptr(dl.data)) + uint64(dl.byte_offset)
	if h, o, ok := lookupDevice(in.ordinal, in.ptr, in.n); ok {
		in.t.Buffer, in.done = o.dev.mem.buf, func() { unref(h) }
		return in, nil
	}
	if in.n == 0 {
		return in, nil // no memory: Buffer stays nil
	}
	buf, err := wrapCUDA(c, in.ordinal, in.ptr, in.n)
	if err != nil {
		return nil, err
	}
	in.t.Buffer, in.done = buf, func() { buf.Free() }
	return in, nil
}

// stageDevice copies the caller's CUDA tensor dl into a new tensor from
// stage (pool memory), which the caller releases.
func stageDevice(dl *C.DLTensor, stage newTensorFunc) (*rpc.Tensor, error) {
	in, err := openDevice(dl)
	if err != nil {
		return nil, err
	}
	defer in.done()
	t, err := stage(in.t.DType, in.t.Shape)
	if err != nil {
		return nil, err
	}
	if in.n > 0 {
		if err := in.t.Buffer.CopyToHost(t.Bytes()[:in.n], in.t.Offset); err != nil {
			t.Release()
			return nil, errorf(codes.Internal, "staging cuda:%d memory at %#x: %v", in.ordinal, in.ptr, err)
		}
	}
	return t, nil
}

// checkStream accepts the streams whose work the library's copies are
// ordered after (see above).
func checkStream(stream C.uint64_t) error {
	switch stream {
	case streamDefault, streamLegacy:
		return nil
	case streamPerThread:
		return errorf(codes.Unimplemented, "stream 2 (the per-thread default stream) is not supported yet: make the tensor ready on the legacy default stream (DLPack: __dlpack__(stream=1)) and pass 1")
	}
	return errorf(codes.Unimplemented, "stream %#x is not supported yet: make the tensor ready on the legacy default stream (DLPack: __dlpack__(stream=1)) and pass 1", uint64(stream))
}

// trpc_client_send_device is trpc_client_send for a tensor on any device:
// a CUDA tensor (kDLCUDA) is sent through rpc's SendDevice (today staged
// through a pool buffer: one device-to-host copy), a CPU tensor as
// trpc_client_send sends it. stream is the CUDA stream on which the
// tensor's producer made it ready: 0 or 1 (CU_STREAM_LEGACY, DLPack's
// stream=1); other streams fail with UNIMPLEMENTED for now. The library
// reads the tensor only until it returns. Added in ABI version 5.
//
//export trpc_client_send_device
func trpc_client_send_device(h C.trpc_client, key *C.char, dl *C.DLTensor, stream C.uint64_t, timeoutMs C.int64_t, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if key == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL key"))
	}
	if dl == nil || dl.device.device_type != dlCUDA {
		return trpc_client_send(h, key, dl, timeoutMs, errOut)
	}
	if err := checkStream(stream); err != nil {
		return report(errOut, err)
	}
	return report(errOut, sendDevice(c, key, dl, timeoutMs))
}

func sendDevice(c *clientEntry, key *C.char, dl *C.DLTensor, timeoutMs C.int64_t) error {
	in, err := openDevice(dl)
	if err != nil {
		return err
	}
	defer in.done()
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	if in.n == 0 {
		// No device memory to read: an empty host tensor says the same.
		t, err := c.c.NewTensor(ctx, in.t.DType, in.t.Shape)
		if err != nil {
			return err
		}
		defer t.Release()
		return c.c.Send(ctx, C.GoString(key), t)
	}
	_, err = c.c.SendDevice(ctx, C.GoString(key), in.t)
	return err
}

// trpc_client_fetch_device fetches the tensor published under key onto
// device (kDLCUDA, device_id the ordinal; kDLCPU is trpc_client_fetch). The
// result is a DLManagedTensor on that device in memory the library owns
// (carved from an arena per device, or an allocation of its own for a
// large tensor), freed by its deleter; the bytes are on the device when
// the call returns. flags: TRPC_FETCH_WAIT (a lease does not apply).
// Today the tensor is fetched into the pool and copied onto the device
// (one host-to-device copy). Added in ABI version 5.
//
//export trpc_client_fetch_device
func trpc_client_fetch_device(h C.trpc_client, key *C.char, device C.DLDevice, flags C.int, timeoutMs C.int64_t, out **C.DLManagedTensor, errOut **C.char) C.int {
	if device.device_type == dlCPU {
		return trpc_client_fetch(h, key, flags&fetchWait, timeoutMs, out, errOut)
	}
	c, err := fetchClient(h, key, out != nil, flags)
	if err != nil {
		return report(errOut, err)
	}
	if flags&fetchLease != 0 {
		return report(errOut, errorf(codes.InvalidArgument, "a lease cannot be fetched onto a device"))
	}
	if device.device_type != dlCUDA {
		return report(errOut, errorf(codes.InvalidArgument, "cannot fetch onto DLPack device type %d: CPU (1) and CUDA (2) are supported", int(device.device_type)))
	}
	ordinal := int(device.device_id)
	cuda, err := cudaDevice(ordinal)
	if err != nil {
		return report(errOut, err)
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	m, err := fetchDevice(ctx, c, cuda, ordinal, C.GoString(key), flags)
	if err != nil {
		return report(errOut, err)
	}
	*out = m
	return 0
}

func fetchDevice(ctx context.Context, c *clientEntry, cuda *gpudirect.CUDA, ordinal int, key string, flags C.int) (*C.DLManagedTensor, error) {
	var mem *deviceAlloc
	alloc := func(dtype zerocopy.DType, shape []int64, n int) (gpudirect.DeviceBuffer, error) {
		m, err := allocDevice(cuda, ordinal, n)
		if err != nil {
			return nil, err
		}
		mem = m
		return m.buf, nil
	}
	t, _, err := c.c.FetchDevice(ctx, key, alloc)
	if status.Code(err) == codes.NotFound && flags&fetchWait != 0 {
		// rpc.FetchDevice does not wait for a key: wait for it with a
		// host Fetch (whose tensor is dropped), then fetch it again.
		var w *rpc.Tensor
		if w, err = c.c.Fetch(ctx, key, rpc.WaitForKey()); err == nil {
			w.Release()
			t, _, err = c.c.FetchDevice(ctx, key, alloc)
		}
	}
	if err != nil {
		if mem != nil {
			mem.free() // FetchDevice freed the buffer; this gives back its arena's share
		}
		return nil, err
	}
	d := &deviceTensor{dtype: t.DType, shape: t.Shape, mem: mem}
	h := adoptDevice(d)
	m, err := managedDevice(h, d)
	if err != nil {
		unref(h)
		return nil, err
	}
	return m, nil
}

// managedDevice allocates a DLManagedTensor describing the device tensor d
// that owns one reference of handle h.
func managedDevice(h uint64, d *deviceTensor) (*C.DLManagedTensor, error) {
	m := C.trpc_managed_alloc(C.int32_t(len(d.shape)), C.uint64_t(h))
	if m == nil {
		return nil, errorf(codes.ResourceExhausted, "malloc of a DLManagedTensor failed")
	}
	code, bits, lanes := d.dtype.DLPack()
	m.dl_tensor.dtype = C.DLDataType{code: C.uint8_t(code), bits: C.uint8_t(bits), lanes: C.uint16_t(lanes)}
	copy(unsafe.Slice((*int64)(unsafe.Pointer(m.dl_tensor.shape)), len(d.shape)), d.shape)
	// The device address goes to C as a number: Go never dereferences it.
	C.trpc_managed_set_device(m, dlCUDA, C.int32_t(d.mem.ordinal), C.uint64_t(d.mem.ptr))
	return m, nil
}

// trpc_device_stats stores in *out what device memory the library holds
// on device (kDLCUDA): tensors handed out by trpc_client_fetch_device and
// not yet deleted (buffers, bytes) and the arenas they are carved from.
// It loads no driver: before the first device call everything is 0. Added
// in ABI version 5.
//
//export trpc_device_stats
func trpc_device_stats(device C.DLDevice, out *C.trpc_device_mem_stats, errOut **C.char) C.int {
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	if device.device_type != dlCUDA {
		return report(errOut, errorf(codes.InvalidArgument, "DLPack device type %d holds no device memory of the library; CUDA (2) does", int(device.device_type)))
	}
	buffers, bytes, arenas, arenaBytes := deviceStats(int(device.device_id))
	*out = C.trpc_device_mem_stats{buffers: C.int64_t(buffers), bytes: C.int64_t(bytes), arenas: C.int64_t(arenas), arena_bytes: C.int64_t(arenaBytes)}
	return 0
}

// trpc_cuda_device_count loads the CUDA driver (once; from
// $TENSORRPC_CUDA_LIBRARY, else libcuda.so.1) and stores the number of its
// devices in *out. Without a driver it fails with FAILED_PRECONDITION and
// a message that starts "tensorrpc: no CUDA driver". Added in ABI version 5.
//
//export trpc_cuda_device_count
func trpc_cuda_device_count(out *C.int32_t, errOut **C.char) C.int {
	if out == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL out"))
	}
	c, err := loadCUDA()
	if err != nil {
		return report(errOut, err)
	}
	*out = C.int32_t(len(c.Devices()))
	return 0
}
