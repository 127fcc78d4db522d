package gpudirect

import "context"

// The interfaces below are what staging, CUDA IPC and the C ABI need of a
// device beyond DeviceBuffer's synchronous copies. CUDA buffers implement
// them (through the driver's streams, events, cuMemHostRegister and IPC
// memory handles); the host-fake stand-in implements the asynchronous ones
// with a worker of its own, so that a missing wait shows in a test as wrong
// bytes there too.

// AsyncBuffer is a device buffer whose copies can run asynchronously,
// ordered on a stream of its device. Staging uses it to overlap the copies
// with the data plane.
type AsyncBuffer interface {
	DeviceBuffer
	// NewStream returns a new stream on the buffer's device. Copies
	// enqueued on one stream run in order; streams are independent.
	NewStream() (Stream, error)
	// HostRegistrar returns what pins host memory for this buffer's
	// device, so that copies to and from it run at DMA speed and
	// asynchronously (CUDA treats unregistered memory as pageable and
	// copies it synchronously, through a bounce buffer).
	HostRegistrar() HostRegistrar
}

// Stream is an ordered queue of asynchronous copies on one device. Its
// methods only enqueue: the bytes move later, and the host memory named in
// a copy must stay valid (and, for CopyToHost, unread) until an Event
// recorded after the copy has completed. A Stream is not safe for
// concurrent use.
type Stream interface {
	// CopyToHost enqueues a copy of len(dst) bytes from src at offset into
	// dst.
	CopyToHost(dst []byte, src DeviceBuffer, offset int) error
	// CopyFromHost enqueues a copy of src into dst at offset.
	CopyFromHost(dst DeviceBuffer, offset int, src []byte) error
	// CopyDevice enqueues a copy of n bytes from src at srcOffset to dst
	// at dstOffset, both on the stream's device (or mapped into its
	// context, as an opened IPC handle is).
	CopyDevice(dst DeviceBuffer, dstOffset int, src DeviceBuffer, srcOffset, n int) error
	// Record returns an event that completes when everything enqueued on
	// the stream before it has.
	Record() (Event, error)
	// Sync waits until everything enqueued has completed, and returns the
	// first error of an enqueued copy, if any.
	Sync() error
	// Close waits for the stream's copies and destroys it.
	Close() error
}

// Event marks a point in a Stream.
type Event interface {
	// Wait returns when the copies before the event have completed (nil),
	// one of them failed (its error), or ctx ended (ctx's error; the copies
	// still run: wait again, or Sync the stream, before reusing their
	// memory).
	Wait(ctx context.Context) error
	// Done reports whether the event has completed, without waiting.
	Done() (bool, error)
	// Close destroys the event.
	Close() error
}

// HostRegistrar pins host memory with a device's driver
// (cuMemHostRegister). Registering a range that overlaps a registered one,
// or unregistering a range that is not registered, fails with the driver's
// error (for CUDA, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED and
// CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED).
type HostRegistrar interface {
	// Name names the driver and device, e.g. "cuda".
	Name() string
	RegisterHost(b []byte) error
	UnregisterHost(b []byte) error
}

// IPCExporter is a device buffer another process on the same host can map
// (CUDA IPC memory handles).
type IPCExporter interface {
	DeviceBuffer
	// IPCHandle describes the buffer for OpenIPC in another process.
	IPCHandle() (IPCHandle, error)
}

// IPCHandle names device memory across processes on one host. Handle
// names the whole allocation the buffer was carved from (the driver's IPC
// handles name an allocation's base), so Offset says where the buffer
// starts in it.
type IPCHandle struct {
	Handle [64]byte // cuIpcGetMemHandle's CUipcMemHandle
	Offset int64    // the buffer's offset in the allocation Handle names
	Len    int64    // the buffer's length
	UUID   [16]byte // the device's UUID (cuDeviceGetUuid), so the opener picks the same GPU
}
