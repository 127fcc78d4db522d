package gpudirect

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Wrap makes a DeviceBuffer of n bytes of device memory at ptr on the
// device with the given ordinal that the caller owns (a PyTorch tensor's
// data pointer, from DLPack): the caller keeps it alive and unwritten while
// the buffer is in use, and Free forgets it without freeing the memory.
// Where the driver can say (cuMemGetAddressRange), the range must lie in
// one allocation. With a driver that has streams the buffer is an
// AsyncBuffer and an IPCExporter, as an allocator's are.
func (c *CUDA) Wrap(ordinal int, ptr uint64, n int) (DeviceBuffer, error) {
	if ordinal < 0 || ordinal >= len(c.devices) {
		return nil, fmt.Errorf("gpudirect: no CUDA device %d (the driver lists %d)", ordinal, len(c.devices))
	}
	if n < 0 || (n > 0 && ptr == 0) {
		return nil, fmt.Errorf("gpudirect: cannot wrap %d bytes at %#x", n, ptr)
	}
	if err := c.api.retain(ordinal); err != nil {
		return nil, err
	}
	if x, ok := c.api.(cudaAsync); ok && x.ipcReady() && n > 0 {
		base, size, err := x.addressRange(ordinal, ptr)
		if err == nil && ptr+uint64(n) > base+size {
			err = fmt.Errorf("%d bytes at %#x pass the end of their allocation (%d bytes at %#x)", n, ptr, size, base)
		}
		if err != nil {
			c.api.release(ordinal)
			return nil, fmt.Errorf("gpudirect: cuda:%d: wrapping device memory: %w", ordinal, err)
		}
	}
	b := &cudaRange{api: c.api, dev: c.devices[ordinal], ptr: ptr, n: n, free: func() error { return c.api.release(ordinal) }}
	return c.asyncBuffer(b, ordinal), nil
}

// cudaRange is device memory gpudirect did not allocate: a caller's
// (Wrap) or another process's (OpenIPC). free runs at Free.
type cudaRange struct {
	api   cudaAPI
	dev   CUDADevice
	ptr   uint64
	n     int
	free  func() error
	freed atomic.Bool
}

func (b *cudaRange) Device() string               { return fmt.Sprintf("cuda:%d", b.dev.Ordinal) }
func (b *cudaRange) Len() int                     { return b.n }
func (b *cudaRange) PCIAddress() string           { return b.dev.PCIAddress }
func (b *cudaRange) Mechanism() Mechanism         { return MechanismNone }
func (b *cudaRange) Direct() (verbs.Memory, bool) { return verbs.Memory{}, false }

func (b *cudaRange) devicePointer() (uint64, bool) { return b.ptr, !b.freed.Load() }

func (b *cudaRange) CopyToHost(dst []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), b.n, offset, len(dst)); err != nil || len(dst) == 0 {
		return err
	}
	return b.api.copyFromDevice(b.dev.Ordinal, dst, b.ptr+uint64(offset))
}

func (b *cudaRange) CopyFromHost(src []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), b.n, offset, len(src)); err != nil || len(src) == 0 {
		return err
	}
	return b.api.copyToDevice(b.dev.Ordinal, b.ptr+uint64(offset), src)
}

func (b *cudaRange) Free() error {
	if !b.freed.CompareAndSwap(false, true) {
		return ErrFreed
	}
	if b.free == nil {
		return nil
	}
	return errors.Join(b.free())
}
