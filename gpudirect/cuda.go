package gpudirect

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// CUDA device attributes read by LoadCUDA (cuda.h, CUdevice_attribute).
const (
	cuAttrPCIBusID         = 33
	cuAttrPCIDeviceID      = 34
	cuAttrPCIDomainID      = 50
	cuAttrGPUDirectRDMA    = 116
	cuAttrDMABufSupported  = 124
	cudaErrorNoDevice      = 100
	cudaErrorStubLibrary   = 34
	cudaDefaultLibrary     = "libcuda.so.1"
	cudaArenaGranularity   = 2 << 20 // GPU pages are 2 MiB; DMA-BUF export wants page-aligned ranges
	defaultCUDAArenaSize   = 64 << 20
	maxCUDADeviceNameBytes = 256
)

// cudaAPI is the part of the CUDA driver API that gpudirect calls. The cgo
// build implements it with dlopen'd libcuda; tests also implement it in Go.
// Device numbers are ordinals; the implementation keeps each device's
// retained primary context and makes it current around memory calls.
type cudaAPI interface {
	driverVersion() (int, error)
	deviceCount() (int, error)
	deviceName(dev int) (string, error)
	deviceAttribute(dev, attr int) (int, error)
	totalMemory(dev int) (uint64, error)
	retain(dev int) error
	release(dev int) error
	memAlloc(dev, n int) (uint64, error)
	memFree(dev int, p uint64) error
	copyToDevice(dev int, dst uint64, src []byte) error
	copyFromDevice(dev int, dst []byte, src uint64) error
	syncMemops(dev int, p uint64) error
	exportDMABuf(dev int, p uint64, n int) (fd int, err error)
	closeFD(fd int) error
	// view returns n bytes at device address p as a slice, for
	// registration by address. The CPU must not touch it.
	view(p uint64, n int) []byte
}

// CUDAError is a failed CUDA driver call.
type CUDAError struct {
	Func string // e.g. "cuMemAlloc"
	Code int    // CUresult
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY", "" when the driver did not say
	Text string // the driver's description
}

func (e *CUDAError) Error() string {
	s := fmt.Sprintf("gpudirect: %s: CUDA error %d", e.Func, e.Code)
	if e.Name != "" {
		s = fmt.Sprintf("gpudirect: %s: %s (%d)", e.Func, e.Name, e.Code)
	}
	if e.Text != "" {
		s += ": " + e.Text
	}
	return s
}

// CUDA is a loaded CUDA driver. It is safe for concurrent use.
type CUDA struct {
	api     cudaAPI
	version int
	devices []CUDADevice
	reg     *cudaRegistrar // nil without asynchronous copies (HostRegistrar)
}

// CUDADevice describes one CUDA device.
type CUDADevice struct {
	Ordinal     int
	Name        string
	PCIAddress  string // "0000:3b:00.0", from the driver's PCI domain, bus and device IDs
	TotalMemory uint64
	// GPUDirectRDMA and DMABuf are the driver's answers to
	// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED and
	// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED.
	GPUDirectRDMA, DMABuf bool
	// UUID is the device's (cuDeviceGetUuid): what names the same GPU in
	// another process, whatever CUDA_VISIBLE_DEVICES numbers it there.
	// Zero when the driver cannot say.
	UUID [16]byte
}

// CUDAOption configures LoadCUDA.
type CUDAOption func(*cudaOptions)

type cudaOptions struct {
	library string
	api     cudaAPI // tests
}

// WithCUDALibrary loads the driver from path instead of libcuda.so.1.
func WithCUDALibrary(path string) CUDAOption { return func(o *cudaOptions) { o.library = path } }

// LoadCUDA loads the CUDA driver (dlopen of libcuda.so.1), initializes it
// and lists its devices. Without a driver it returns an error wrapping
// ErrUnavailable that says so ("libcuda.so.1 not found: no NVIDIA driver on
// this host; using host staging"), and callers use host memory. A build
// without cgo always returns such an error.
func LoadCUDA(opts ...CUDAOption) (*CUDA, error) {
	o := cudaOptions{library: cudaDefaultLibrary}
	for _, opt := range opts {
		opt(&o)
	}
	api := o.api
	if api == nil {
		var err error
		if api, err = openCUDA(o.library); err != nil {
			return nil, err
		}
	}
	c := &CUDA{api: api}
	var err error
	if c.version, err = api.driverVersion(); err != nil {
		return nil, err
	}
	n, err := api.deviceCount()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: the CUDA driver %s lists no devices; using host staging", ErrUnavailable, formatCUDAVersion(c.version))
	}
	for i := range n {
		d := CUDADevice{Ordinal: i}
		if d.Name, err = api.deviceName(i); err != nil {
			return nil, err
		}
		if d.TotalMemory, err = api.totalMemory(i); err != nil {
			return nil, err
		}
		attrs := map[int]int{}
		for _, a := range []int{cuAttrPCIDomainID, cuAttrPCIBusID, cuAttrPCIDeviceID, cuAttrGPUDirectRDMA, cuAttrDMABufSupported} {
			v, err := api.deviceAttribute(i, a)
			var ce *CUDAError
			if errors.As(err, &ce) && a >= cuAttrGPUDirectRDMA {
				v = 0 // an older driver that does not know the attribute
			} else if err != nil {
				return nil, err
			}
			attrs[a] = v
		}
		d.PCIAddress = fmt.Sprintf("%04x:%02x:%02x.0", attrs[cuAttrPCIDomainID], attrs[cuAttrPCIBusID], attrs[cuAttrPCIDeviceID])
		d.GPUDirectRDMA, d.DMABuf = attrs[cuAttrGPUDirectRDMA] != 0, attrs[cuAttrDMABufSupported] != 0
		if x, ok := api.(cudaAsync); ok {
			d.UUID, _ = x.deviceUUID(i) // zero when the driver cannot say
		}
		c.devices = append(c.devices, d)
	}
	if x, ok := c.async(); ok {
		c.reg = &cudaRegistrar{api: api, x: x}
	}
	return c, nil
}

// formatCUDAVersion turns cuDriverGetVersion's 12040 into "12.4".
func formatCUDAVersion(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }

// DriverVersion is the CUDA version the driver supports, e.g. "12.4".
func (c *CUDA) DriverVersion() string { return formatCUDAVersion(c.version) }

// Devices lists the CUDA devices.
func (c *CUDA) Devices() []CUDADevice { return append([]CUDADevice(nil), c.devices...) }

// String describes the driver and its devices.
func (c *CUDA) String() string {
	var names []string
	for _, d := range c.devices {
		names = append(names, fmt.Sprintf("cuda:%d %s at %s", d.Ordinal, d.Name, d.PCIAddress))
	}
	return "CUDA " + c.DriverVersion() + ": " + strings.Join(names, "; ")
}

// CUDAAllocator carves device buffers out of one device-memory arena on one
// GPU: a single cuMemAlloc, with CU_POINTER_ATTRIBUTE_SYNC_MEMOPS set (as
// GPUDirect RDMA requires, so that copies finish before the NIC reads), and
// exported as a DMA-BUF when the device supports it. Register the arena
// once (Arena); every buffer's Direct memory lies inside it. It is safe for
// concurrent use.
type CUDAAllocator struct {
	cuda    *CUDA
	api     cudaAPI
	dev     CUDADevice
	base    uint64
	size    int
	dmabuf  int // the arena's DMA-BUF file descriptor, or -1
	peermem bool
	detail  string

	mu     sync.Mutex
	carve  *carver
	live   int
	closed bool
}

// NewAllocator allocates an arena of arenaSize bytes (rounded up to 2 MiB;
// 64 MiB when zero) on the device with the given ordinal, in its primary
// context (the one the CUDA runtime, and so PyTorch, uses). Buffers are
// Direct through nvidia_peermem when topo says it is loaded and the device
// supports GPUDirect RDMA, else through the arena's DMA-BUF when the device
// exports one; with a nil topo only DMA-BUF can make them Direct.
func (c *CUDA) NewAllocator(ordinal, arenaSize int, topo *Topology) (*CUDAAllocator, error) {
	if ordinal < 0 || ordinal >= len(c.devices) {
		return nil, fmt.Errorf("gpudirect: no CUDA device %d (the driver lists %d)", ordinal, len(c.devices))
	}
	if arenaSize < 0 {
		return nil, fmt.Errorf("gpudirect: arena size %d is negative", arenaSize)
	}
	if arenaSize == 0 {
		arenaSize = defaultCUDAArenaSize
	}
	arenaSize = (arenaSize + cudaArenaGranularity - 1) &^ (cudaArenaGranularity - 1)
	a := &CUDAAllocator{cuda: c, api: c.api, dev: c.devices[ordinal], size: arenaSize, dmabuf: -1, carve: newCarver(arenaSize)}
	if err := c.api.retain(ordinal); err != nil {
		return nil, err
	}
	base, err := c.api.memAlloc(ordinal, arenaSize)
	if err != nil {
		c.api.release(ordinal)
		return nil, err
	}
	a.base = base
	if err := c.api.syncMemops(ordinal, base); err != nil {
		c.api.memFree(ordinal, base)
		c.api.release(ordinal)
		return nil, err
	}
	var why []string
	a.peermem = topo != nil && topo.Peermem.Loaded && a.dev.GPUDirectRDMA
	switch {
	case topo == nil || !topo.Peermem.Loaded:
		why = append(why, "nvidia_peermem is not loaded")
	case !a.dev.GPUDirectRDMA:
		why = append(why, "the device does not support GPUDirect RDMA")
	}
	if a.dev.DMABuf {
		if fd, err := c.api.exportDMABuf(ordinal, base, arenaSize); err == nil {
			a.dmabuf = fd
		} else {
			why = append(why, "DMA-BUF export failed: "+err.Error())
		}
	} else {
		why = append(why, "the device does not export DMA-BUFs")
	}
	switch {
	case a.peermem:
		a.detail = "registered by address through nvidia_peermem"
	case a.dmabuf >= 0:
		a.detail = "exported as DMA-BUF fd " + fmt.Sprint(a.dmabuf)
	default:
		a.detail = "no direct access: " + strings.Join(why, ", ")
	}
	return a, nil
}

// Name returns "cuda:<ordinal>".
func (a *CUDAAllocator) Name() string { return fmt.Sprintf("cuda:%d", a.dev.Ordinal) }

// Device describes the GPU.
func (a *CUDAAllocator) Device() CUDADevice { return a.dev }

// Detail says how a NIC can reach the arena, or why it cannot.
func (a *CUDAAllocator) Detail() string { return a.detail }

// Arena returns the whole arena as verbs memory and how the NIC reaches it,
// or ok=false when it cannot (then every buffer is staged). With
// nvidia_peermem the mechanism is MechanismPeermem and the memory is the
// arena's device addresses; otherwise, with a DMA-BUF, MechanismDMABuf and
// HasFD names the DMA-BUF (FDOffset 0). The bytes are GPU memory: the CPU
// must never touch them.
func (a *CUDAAllocator) Arena() (m verbs.Memory, mech Mechanism, ok bool) {
	return a.direct(0, a.size)
}

func (a *CUDAAllocator) direct(off, n int) (verbs.Memory, Mechanism, bool) {
	switch {
	case a.peermem:
		return verbs.Memory{Bytes: a.api.view(a.base+uint64(off), n)}, MechanismPeermem, true
	case a.dmabuf >= 0:
		return verbs.Memory{Bytes: a.api.view(a.base+uint64(off), n), HasFD: true, FD: a.dmabuf, FDOffset: int64(off), DMABuf: true}, MechanismDMABuf, true
	}
	return verbs.Memory{}, MechanismNone, false
}

// Alloc carves n bytes (rounded up to 256) from the arena, or fails with
// ErrExhausted.
func (a *CUDAAllocator) Alloc(n int) (DeviceBuffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("gpudirect: %s: negative size %d", a.Name(), n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, ErrClosed
	}
	off, size, ok := a.carve.alloc(n)
	if !ok {
		return nil, fmt.Errorf("%w: %s: no free run of %d bytes in %d", ErrExhausted, a.Name(), n, a.size)
	}
	a.live++
	b := &cudaBuffer{alloc: a, off: off, size: size, n: n}
	return a.cuda.asyncBuffer(b, a.dev.Ordinal), nil
}

// Close frees the arena, closes its DMA-BUF and releases the primary
// context; it fails with ErrOutstanding while buffers are allocated.
func (a *CUDAAllocator) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	if a.live > 0 {
		return fmt.Errorf("%w: %d buffers of %s", ErrOutstanding, a.live, a.Name())
	}
	a.closed = true
	var errs []error
	if a.dmabuf >= 0 {
		errs = append(errs, a.api.closeFD(a.dmabuf))
	}
	errs = append(errs, a.api.memFree(a.dev.Ordinal, a.base), a.api.release(a.dev.Ordinal))
	return errors.Join(errs...)
}

type cudaBuffer struct {
	alloc        *CUDAAllocator
	off, size, n int
	freed        atomic.Bool
}

func (b *cudaBuffer) Device() string { return b.alloc.Name() }

func (b *cudaBuffer) devicePointer() (uint64, bool) {
	return b.alloc.base + uint64(b.off), !b.freed.Load()
}
func (b *cudaBuffer) Len() int           { return b.n }
func (b *cudaBuffer) PCIAddress() string { return b.alloc.dev.PCIAddress }

func (b *cudaBuffer) Mechanism() Mechanism {
	_, mech, _ := b.alloc.direct(b.off, b.n)
	return mech
}

func (b *cudaBuffer) CopyToHost(dst []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), b.n, offset, len(dst)); err != nil || len(dst) == 0 {
		return err
	}
	return b.alloc.api.copyFromDevice(b.alloc.dev.Ordinal, dst, b.alloc.base+uint64(b.off+offset))
}

func (b *cudaBuffer) CopyFromHost(src []byte, offset int) error {
	if b.freed.Load() {
		return ErrFreed
	}
	if err := checkRange(b.Device(), b.n, offset, len(src)); err != nil || len(src) == 0 {
		return err
	}
	return b.alloc.api.copyToDevice(b.alloc.dev.Ordinal, b.alloc.base+uint64(b.off+offset), src)
}

func (b *cudaBuffer) Direct() (verbs.Memory, bool) {
	if b.freed.Load() {
		return verbs.Memory{}, false
	}
	m, _, ok := b.alloc.direct(b.off, b.n)
	return m, ok
}

func (b *cudaBuffer) Free() error {
	if !b.freed.CompareAndSwap(false, true) {
		return ErrFreed
	}
	a := b.alloc
	a.mu.Lock()
	a.carve.release(b.off, b.size)
	a.live--
	a.mu.Unlock()
	return nil
}
