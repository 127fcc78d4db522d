package gpudirect

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"
)

// cudaAsync is the part of the CUDA driver API for asynchronous copies on
// streams, events, pinning host memory and IPC handles. The cgo binding
// implements it; asyncReady and ipcReady say whether the loaded driver has
// every entry point of each group. Streams and events are the driver's
// handles, as integers.
type cudaAsync interface {
	asyncReady() bool
	ipcReady() bool
	streamCreate(dev int) (unsafe.Pointer, error)
	streamDestroy(dev int, s unsafe.Pointer) error
	streamSync(dev int, s unsafe.Pointer) error
	copyToDeviceAsync(dev int, dst uint64, src []byte, s unsafe.Pointer) error
	copyFromDeviceAsync(dev int, dst []byte, src uint64, s unsafe.Pointer) error
	copyDeviceAsync(dev int, dst, src uint64, n int, s unsafe.Pointer) error
	eventCreate(dev int) (unsafe.Pointer, error)
	eventRecord(dev int, e, s unsafe.Pointer) error
	eventQuery(dev int, e unsafe.Pointer) (bool, error)
	eventSync(dev int, e unsafe.Pointer) error
	eventDestroy(dev int, e unsafe.Pointer) error
	hostRegister(dev int, b []byte) error
	hostUnregister(dev int, b []byte) error
	ipcGet(dev int, p uint64) ([64]byte, error)
	ipcOpen(dev int, h [64]byte) (uint64, error)
	ipcClose(dev int, p uint64) error
	addressRange(dev int, p uint64) (base, size uint64, err error)
	deviceUUID(dev int) ([16]byte, error)
}

// async returns the driver's asynchronous API when it has all of it.
func (c *CUDA) async() (cudaAsync, bool) {
	x, ok := c.api.(cudaAsync)
	if !ok || !x.asyncReady() {
		return nil, false
	}
	return x, true
}

// cudaMem is a CUDA buffer's device memory: the synchronous buffer, its
// PCI placement, and its device address (ok false once freed).
type cudaMem interface {
	DeviceBuffer
	PCIMemory
	devicePointer() (ptr uint64, ok bool)
}

// asyncBuffer makes b an AsyncBuffer (and IPCExporter) on device dev when
// the driver has streams, else returns b as it is: staging then copies it
// synchronously.
func (c *CUDA) asyncBuffer(b cudaMem, dev int) DeviceBuffer {
	x, ok := c.async()
	if !ok {
		return b
	}
	return &cudaAsyncBuffer{cudaMem: b, cuda: c, api: x, dev: dev}
}

// cudaAsyncBuffer is a CUDA buffer whose copies can run on streams.
type cudaAsyncBuffer struct {
	cudaMem
	cuda *CUDA
	api  cudaAsync
	dev  int
}

func (b *cudaAsyncBuffer) NewStream() (Stream, error) {
	s, err := b.api.streamCreate(b.dev)
	if err != nil {
		return nil, err
	}
	return &cudaStream{api: b.api, dev: b.dev, s: s}, nil
}

func (b *cudaAsyncBuffer) HostRegistrar() HostRegistrar { return b.cuda.reg }

// IPCHandle names the buffer for OpenIPC in another process: the driver's
// handle names the allocation the buffer lies in (cuIpcGetMemHandle of any
// address in it names its base), so Offset is the buffer's from that base.
func (b *cudaAsyncBuffer) IPCHandle() (IPCHandle, error) {
	if !b.api.ipcReady() {
		return IPCHandle{}, fmt.Errorf("gpudirect: %s: the CUDA driver has no IPC entry points", b.Device())
	}
	p, ok := b.devicePointer()
	if !ok {
		return IPCHandle{}, ErrFreed
	}
	base, _, err := b.api.addressRange(b.dev, p)
	if err != nil {
		return IPCHandle{}, err
	}
	h, err := b.api.ipcGet(b.dev, p)
	if err != nil {
		return IPCHandle{}, err
	}
	return IPCHandle{Handle: h, Offset: int64(p - base), Len: int64(b.Len()), UUID: b.cuda.devices[b.dev].UUID}, nil
}

// OpenIPC maps device memory another process of this host exported
// (IPCExporter.IPCHandle), on the device with h.UUID: the buffer starts at
// h.Offset in the allocation h.Handle names and is h.Len bytes long. Free
// closes the mapping (cuIpcCloseMemHandle). A handle opened in the process
// that exported it fails, as the driver does.
func (c *CUDA) OpenIPC(h IPCHandle) (DeviceBuffer, error) {
	x, ok := c.api.(cudaAsync)
	if !ok || !x.ipcReady() {
		return nil, fmt.Errorf("gpudirect: the CUDA driver has no IPC entry points")
	}
	dev := -1
	for _, d := range c.devices {
		if d.UUID == h.UUID {
			dev = d.Ordinal
		}
	}
	if dev < 0 || h.UUID == ([16]byte{}) {
		return nil, fmt.Errorf("gpudirect: no CUDA device here has the IPC handle's GPU (UUID %x)", h.UUID)
	}
	if h.Offset < 0 || h.Len < 0 {
		return nil, fmt.Errorf("gpudirect: IPC handle with offset %d and length %d", h.Offset, h.Len)
	}
	if err := c.api.retain(dev); err != nil {
		return nil, err
	}
	base, err := x.ipcOpen(dev, h.Handle)
	if err != nil {
		c.api.release(dev)
		return nil, err
	}
	if _, size, err := x.addressRange(dev, base); err == nil && uint64(h.Offset+h.Len) > size {
		x.ipcClose(dev, base)
		c.api.release(dev)
		return nil, fmt.Errorf("gpudirect: IPC handle names %d bytes at offset %d of an allocation of %d", h.Len, h.Offset, size)
	}
	b := &cudaRange{api: c.api, dev: c.devices[dev], ptr: base + uint64(h.Offset), n: int(h.Len), free: func() error {
		return errors.Join(x.ipcClose(dev, base), c.api.release(dev))
	}}
	return c.asyncBuffer(b, dev), nil
}

// HostRegistrar pins host memory for the driver's devices
// (cuMemHostRegister, portable: for every context), or nil when the driver
// lacks the entry points. ordinal only has to be a device's: one
// registration serves them all.
func (c *CUDA) HostRegistrar(ordinal int) HostRegistrar {
	if ordinal < 0 || ordinal >= len(c.devices) || c.reg == nil {
		return nil
	}
	return c.reg
}

// cudaRegistrar pins host memory with cuMemHostRegister, in device 0's
// primary context, which it retains at its first use for as long as the
// process runs (registrations belong to a context; a released primary
// context would drop them).
type cudaRegistrar struct {
	api    cudaAPI
	x      cudaAsync
	once   sync.Once
	retain error
}

func (r *cudaRegistrar) Name() string { return "cuda" }

func (r *cudaRegistrar) context() error {
	r.once.Do(func() { r.retain = r.api.retain(0) })
	return r.retain
}

func (r *cudaRegistrar) RegisterHost(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("gpudirect: cuMemHostRegister of 0 bytes")
	}
	if err := r.context(); err != nil {
		return err
	}
	return r.x.hostRegister(0, b)
}

func (r *cudaRegistrar) UnregisterHost(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("gpudirect: cuMemHostUnregister of 0 bytes")
	}
	if err := r.context(); err != nil {
		return err
	}
	return r.x.hostUnregister(0, b)
}

// cudaStream is a CUDA stream of one device.
type cudaStream struct {
	api cudaAsync
	dev int
	s   unsafe.Pointer
}

// pointerOf is the device address of offset in buf, which must be CUDA
// memory of this stream's device (or mapped into its context).
func (st *cudaStream) pointerOf(buf DeviceBuffer, offset, n int) (uint64, error) {
	m, ok := buf.(interface{ devicePointer() (uint64, bool) })
	if !ok {
		return 0, fmt.Errorf("gpudirect: %s is not CUDA memory", buf.Device())
	}
	p, ok := m.devicePointer()
	if !ok {
		return 0, ErrFreed
	}
	if err := checkRange(buf.Device(), buf.Len(), offset, n); err != nil {
		return 0, err
	}
	return p + uint64(offset), nil
}

func (st *cudaStream) CopyToHost(dst []byte, src DeviceBuffer, offset int) error {
	p, err := st.pointerOf(src, offset, len(dst))
	if err != nil || len(dst) == 0 {
		return err
	}
	return st.api.copyFromDeviceAsync(st.dev, dst, p, st.s)
}

func (st *cudaStream) CopyFromHost(dst DeviceBuffer, offset int, src []byte) error {
	p, err := st.pointerOf(dst, offset, len(src))
	if err != nil || len(src) == 0 {
		return err
	}
	return st.api.copyToDeviceAsync(st.dev, p, src, st.s)
}

func (st *cudaStream) CopyDevice(dst DeviceBuffer, dstOffset int, src DeviceBuffer, srcOffset, n int) error {
	d, err := st.pointerOf(dst, dstOffset, n)
	if err != nil {
		return err
	}
	s, err := st.pointerOf(src, srcOffset, n)
	if err != nil || n == 0 {
		return err
	}
	return st.api.copyDeviceAsync(st.dev, d, s, n, st.s)
}

func (st *cudaStream) Record() (Event, error) {
	e, err := st.api.eventCreate(st.dev)
	if err != nil {
		return nil, err
	}
	if err := st.api.eventRecord(st.dev, e, st.s); err != nil {
		st.api.eventDestroy(st.dev, e)
		return nil, err
	}
	return &cudaEvent{api: st.api, dev: st.dev, e: e}, nil
}

func (st *cudaStream) Sync() error { return st.api.streamSync(st.dev, st.s) }

func (st *cudaStream) Close() error {
	return errors.Join(st.api.streamSync(st.dev, st.s), st.api.streamDestroy(st.dev, st.s))
}

// cudaEvent is a recorded CUDA event.
type cudaEvent struct {
	api  cudaAsync
	dev  int
	e    unsafe.Pointer
	once sync.Once
}

// Wait polls the event (cuEventQuery, about a microsecond): for the first
// spinWait (2 ms) after yielding between looks, so that a copy that ends
// within it is seen at once (a sleep shorter than a millisecond takes a
// millisecond: see wait.go; waiting so after 100 µs, this made a 200 µs
// copy a 1.2 ms one), then a millisecond at a time, so that a long copy
// costs no core. No thread sleeps in cuEventSynchronize, and a waiter
// whose ctx ends is not stuck in the driver.
func (ev *cudaEvent) Wait(ctx context.Context) error {
	start := time.Now()
	for i := 0; ; i++ {
		done, err := ev.api.eventQuery(ev.dev, ev.e)
		if done || err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Since(start) < spinWait {
			yield(i)
			continue
		}
		time.Sleep(sleepStep)
	}
}

func (ev *cudaEvent) Done() (bool, error) { return ev.api.eventQuery(ev.dev, ev.e) }

func (ev *cudaEvent) Close() error {
	var err error
	ev.once.Do(func() { err = ev.api.eventDestroy(ev.dev, ev.e) })
	return err
}
