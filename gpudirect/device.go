package gpudirect

import (
	"errors"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// DeviceBuffer is memory on a device: GPU memory, PCI peer-to-peer memory,
// or host memory standing in for a device in tests. The rpc layer moves a
// tensor held in a DeviceBuffer either directly (the NIC reads or writes the
// device memory) or staged through a pinned host buffer; Plan says which.
// Implementations are safe for concurrent use, but concurrent copies into
// overlapping ranges race as they would on any memory.
type DeviceBuffer interface {
	// Device names where the memory lives: "cuda:0", "host-fake:0",
	// "p2pmem:0000:01:00.0".
	Device() string
	// Len is the buffer's size in bytes.
	Len() int
	// CopyToHost copies len(dst) bytes starting at offset into dst.
	CopyToHost(dst []byte, offset int) error
	// CopyFromHost copies src into the buffer starting at offset.
	CopyFromHost(src []byte, offset int) error
	// Direct returns memory the NIC can use directly (a p2pmem mapping, or
	// GPU memory exported as a DMA-BUF or addressable through
	// nvidia_peermem), or ok=false when there is none. Its Bytes may not be
	// readable by the CPU (GPU memory is not): hand it to the ibv provider
	// only, and only when Plan decided Direct.
	Direct() (m verbs.Memory, ok bool)
	// Free gives the memory back to its allocator. A second Free returns
	// ErrFreed.
	Free() error
}

// Allocator hands out device buffers. It is safe for concurrent use.
type Allocator interface {
	// Alloc returns a buffer of n bytes.
	Alloc(n int) (DeviceBuffer, error)
	// Name names the allocator's device, e.g. "cuda:0" or "host-fake".
	Name() string
	// Close releases the allocator. It fails with ErrOutstanding, and
	// releases nothing, while buffers are still allocated.
	Close() error
}

// PCIMemory is implemented by device buffers whose memory sits behind a PCI
// device. Plan uses it to find the PCI route between the memory and the NIC.
type PCIMemory interface {
	// PCIAddress is the PCI address of the device holding the memory,
	// e.g. "0000:03:00.0".
	PCIAddress() string
	// Mechanism is how a NIC reaches the memory.
	Mechanism() Mechanism
}

// Mechanism is how a NIC reaches device memory without the CPU.
type Mechanism string

const (
	// MechanismNone: the NIC cannot reach the memory; it is staged.
	MechanismNone Mechanism = ""
	// MechanismP2PMem: PCI peer-to-peer memory mapped from a provider's
	// p2pmem/allocate file, registered like host memory.
	MechanismP2PMem Mechanism = "p2pmem"
	// MechanismPeermem: GPU memory registered by its virtual address, which
	// the nvidia_peermem (or older nv_peer_mem) kernel module resolves.
	MechanismPeermem Mechanism = "nvidia-peermem"
	// MechanismDMABuf: GPU memory exported as a DMA-BUF file descriptor and
	// registered with ibv_reg_dmabuf_mr.
	MechanismDMABuf Mechanism = "dma-buf"
)

// Errors of buffers and allocators.
var (
	// ErrFreed is returned by any use of a buffer after Free.
	ErrFreed = errors.New("gpudirect: buffer already freed")
	// ErrOutstanding is returned by Close while buffers are allocated.
	ErrOutstanding = errors.New("gpudirect: buffers still allocated")
	// ErrClosed is returned by an allocator or arena after Close.
	ErrClosed = errors.New("gpudirect: closed")
	// ErrExhausted is returned by Alloc when the allocator's arena has no
	// free run large enough.
	ErrExhausted = errors.New("gpudirect: device arena exhausted")
	// ErrNotDirect is wrapped by the errors of RegisterP2PMem and
	// FindP2PMem when the NIC may not reach the memory directly; the
	// error's text gives the reason.
	ErrNotDirect = errors.New("gpudirect: no direct path")
	// ErrUnavailable is wrapped by LoadCUDA's error when the host has no
	// usable CUDA driver, and by the errors of the cgo-less stub.
	ErrUnavailable = errors.New("gpudirect: unavailable")
)

// checkRange validates a copy of n bytes at offset into a buffer of size
// length.
func checkRange(device string, length, offset, n int) error {
	if offset < 0 || n < 0 || offset > length || n > length-offset {
		return fmt.Errorf("gpudirect: %s: copy of %d bytes at offset %d outside the buffer's %d bytes", device, n, offset, length)
	}
	return nil
}
