package gpudirect

import (
	"fmt"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// This file is a stand-in for CUDA.Wrap until the driver emulator's branch
// (cudaemu) brings its own: the shim's C ABI needs it to send CUDA tensors
// it did not allocate. When that lands, this file goes.

// Wrap describes n bytes of device memory at ptr on the device ordinal,
// which the caller owns (a torch tensor's data_ptr, say), as a
// DeviceBuffer: copies go through the device's primary context, retained
// until Free, which forgets the memory and does not free it. The buffer
// has no Direct memory (it is staged).
//
// Experimental: the caller keeps the memory alive until Free.
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
	return &wrappedCUDA{api: c.api, dev: c.devices[ordinal], ptr: ptr, n: n}, nil
}

type wrappedCUDA struct {
	api   cudaAPI
	dev   CUDADevice
	ptr   uint64
	n     int
	freed atomic.Bool
}

func (b *wrappedCUDA) Device() string               { return fmt.Sprintf("cuda:%d", b.dev.Ordinal) }
func (b *wrappedCUDA) Len() int                     { return b.n }
func (b *wrappedCUDA) PCIAddress() string           { return b.dev.PCIAddress }
func (b *wrappedCUDA) Mechanism() Mechanism         { return MechanismNone }
func (b *wrappedCUDA) Direct() (verbs.Memory, bool) { return verbs.Memory{}, false }

func (b *wrappedCUDA) CopyToHost(dst []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), b.n, offset, len(dst)); err != nil || len(dst) == 0 {
		return err
	}
	return b.api.copyFromDevice(b.dev.Ordinal, dst, b.ptr+uint64(offset))
}

func (b *wrappedCUDA) CopyFromHost(src []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), b.n, offset, len(src)); err != nil || len(src) == 0 {
		return err
	}
	return b.api.copyToDevice(b.dev.Ordinal, b.ptr+uint64(offset), src)
}

func (b *wrappedCUDA) Free() error {
	if !b.freed.CompareAndSwap(false, true) {
		return ErrFreed
	}
	return b.api.release(b.dev.Ordinal)
}
