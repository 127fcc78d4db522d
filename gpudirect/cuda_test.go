package gpudirect

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// goCUDA is a CUDA driver in Go over host memory, for the allocator's logic
// in every build (the cgo binding has its own test against a fake libcuda).
type goCUDA struct {
	devices   int
	oldDriver bool // does not know the GPUDirect and DMA-BUF attributes
	failAlloc bool
	failSync  bool
	retains   int
	mem       map[uint64][]byte
	next      uint64
	closedFDs []int
}

var errFake = &CUDAError{Func: "fake", Code: 1, Name: "CUDA_ERROR_INVALID_VALUE"}

func (g *goCUDA) driverVersion() (int, error)     { return 11080, nil }
func (g *goCUDA) deviceCount() (int, error)       { return g.devices, nil }
func (g *goCUDA) deviceName(int) (string, error)  { return "Go GPU", nil }
func (g *goCUDA) totalMemory(int) (uint64, error) { return 1 << 30, nil }
func (g *goCUDA) retain(int) error                { g.retains++; return nil }
func (g *goCUDA) release(int) error               { g.retains--; return nil }
func (g *goCUDA) syncMemops(int, uint64) error {
	if g.failSync {
		return errFake
	}
	return nil
}
func (g *goCUDA) exportDMABuf(int, uint64, int) (int, error) { return 42, nil }
func (g *goCUDA) closeFD(fd int) error                       { g.closedFDs = append(g.closedFDs, fd); return nil }
func (g *goCUDA) view(p uint64, n int) []byte                { return nil }

func (g *goCUDA) deviceAttribute(dev, attr int) (int, error) {
	switch attr {
	case cuAttrPCIBusID:
		return 0x3b, nil
	case cuAttrPCIDomainID, cuAttrPCIDeviceID:
		return 0, nil
	}
	if g.oldDriver {
		return 0, errFake
	}
	return 1, nil
}

func (g *goCUDA) memAlloc(dev, n int) (uint64, error) {
	if g.failAlloc {
		return 0, &CUDAError{Func: "cuMemAlloc", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Text: "out of memory"}
	}
	g.next += 1 << 30
	g.mem[g.next] = make([]byte, n)
	return g.next, nil
}

func (g *goCUDA) memFree(dev int, p uint64) error {
	if _, ok := g.mem[p]; !ok {
		return fmt.Errorf("free of %#x", p)
	}
	delete(g.mem, p)
	return nil
}

func (g *goCUDA) locate(p uint64, n int) []byte {
	for base, m := range g.mem {
		if p >= base && p+uint64(n) <= base+uint64(len(m)) {
			return m[p-base : p-base+uint64(n)]
		}
	}
	panic(fmt.Sprintf("no device memory at %#x+%d", p, n))
}

func (g *goCUDA) copyToDevice(dev int, dst uint64, src []byte) error {
	copy(g.locate(dst, len(src)), src)
	return nil
}

func (g *goCUDA) copyFromDevice(dev int, dst []byte, src uint64) error {
	copy(dst, g.locate(src, len(dst)))
	return nil
}

func withAPI(api cudaAPI) CUDAOption { return func(o *cudaOptions) { o.api = api } }

func TestCUDAAllocatorLogic(t *testing.T) {
	g := &goCUDA{devices: 1, mem: map[uint64][]byte{}}
	c, err := LoadCUDA(withAPI(g))
	if err != nil {
		t.Fatal(err)
	}
	if d := c.Devices()[0]; d.PCIAddress != "0000:3b:00.0" || !d.DMABuf || !d.GPUDirectRDMA || c.DriverVersion() != "11.8" {
		t.Errorf("device %+v, driver %s", d, c.DriverVersion())
	}
	if _, err := c.NewAllocator(0, -1, nil); err == nil {
		t.Error("negative arena size accepted")
	}
	a, err := c.NewAllocator(0, 3<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	if a.size != 4<<20 || g.retains != 1 {
		t.Errorf("arena %d bytes (want 4 MiB), %d retains", a.size, g.retains)
	}
	b, _ := a.Alloc(10)
	if err := b.CopyFromHost([]byte("0123456789"), 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if err := b.CopyToHost(got, 6); err != nil || string(got) != "6789" {
		t.Errorf("read back %q, %v", got, err)
	}
	if err := b.CopyToHost(nil, 10); err != nil {
		t.Errorf("empty copy at the end: %v", err)
	}
	if pm := b.(PCIMemory); pm.Mechanism() != MechanismDMABuf || pm.PCIAddress() != "0000:3b:00.0" {
		t.Errorf("mechanism %s at %s", pm.Mechanism(), pm.PCIAddress())
	}
	b.Free()
	if _, ok := b.Direct(); ok {
		t.Error("Direct after Free")
	}
	if err := b.CopyFromHost([]byte("x"), 0); !errors.Is(err, ErrFreed) {
		t.Errorf("copy after Free: %v", err)
	}
	if _, err := a.Alloc(5 << 20); !errors.Is(err, ErrExhausted) {
		t.Errorf("Alloc beyond the arena: %v", err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if g.retains != 0 || len(g.mem) != 0 || len(g.closedFDs) != 1 || g.closedFDs[0] != 42 {
		t.Errorf("after Close: %d retains, %d allocations, closed fds %v", g.retains, len(g.mem), g.closedFDs)
	}

	// Failures release what was taken.
	g.failAlloc = true
	if _, err := c.NewAllocator(0, 0, nil); err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory") {
		t.Errorf("cuMemAlloc failing: %v", err)
	}
	g.failAlloc, g.failSync = false, true
	if _, err := c.NewAllocator(0, 0, nil); err == nil {
		t.Error("SYNC_MEMOPS failing: allocator made")
	}
	if g.retains != 0 || len(g.mem) != 0 {
		t.Errorf("after failures: %d retains, %d allocations", g.retains, len(g.mem))
	}

	// An old driver that knows neither GPUDirect attribute, and no
	// nvidia_peermem: buffers are staged.
	old := &goCUDA{devices: 1, oldDriver: true, mem: map[uint64][]byte{}}
	c, err = LoadCUDA(withAPI(old))
	if err != nil {
		t.Fatal(err)
	}
	if d := c.Devices()[0]; d.DMABuf || d.GPUDirectRDMA {
		t.Errorf("old driver: %+v", d)
	}
	// nvidia_peermem is loaded in the switch fixture, but the device does
	// not support GPUDirect RDMA.
	a, err = c.NewAllocator(0, 0, discoverFixture(t, "switch"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := a.Arena(); ok || !strings.Contains(a.Detail(), "the device does not support GPUDirect RDMA") {
		t.Errorf("old driver arena with nvidia_peermem: %v, %s", ok, a.Detail())
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	a, err = c.NewAllocator(0, 0, discoverFixture(t, "acs"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := a.Arena(); ok || !strings.Contains(a.Detail(), "nvidia_peermem is not loaded, the device does not export DMA-BUFs") {
		t.Errorf("old driver arena: %v, %s", ok, a.Detail())
	}
	b, _ = a.Alloc(1)
	if d := Plan(b, "ibv", discoverFixture(t, "acs")); d.Path != Staged || !strings.Contains(d.Reason, "cuda:0 has no memory the NIC can address directly") {
		t.Errorf("Plan: %+v", d)
	}
	b.Free()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}

	if _, err := LoadCUDA(withAPI(&goCUDA{})); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "lists no devices") {
		t.Errorf("no devices: %v", err)
	}
}
