package main

// GPUDirect and PCI peer-to-peer memory, as package gpudirect finds them.

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/tensorrpc/tensorrpc/gpudirect"
)

// checkGPUDirect reports the GPU driver, nvidia_peermem, dma-buf and p2pmem
// (in that order), then the decision for every pairing of device memory and
// RDMA NIC, and, on the real host only, whether the CUDA driver loads: a
// fixture tree cannot stand in for a shared library.
func checkGPUDirect(h host) []Check {
	topo, err := gpudirect.Discover(gpudirect.WithRoot(h.root))
	if err != nil {
		c := Check{Status: StatusUnavailable, Detail: err.Error(), Advice: "tensors in device memory go through host staging"}
		var out []Check
		for _, name := range []string{"gpu-driver", "nvidia-peermem", "dma-buf", "p2pmem", "gpudirect-paths"} {
			c.Name = name
			out = append(out, c)
		}
		return out
	}
	driver := checkGPUDriver(h, topo)
	checks := []Check{driver, checkPeermem(topo), checkDMABuf(h, driver.Status == StatusOK), checkP2Pmem(topo), checkGPUPaths(topo)}
	if h.root == defaultHost().root {
		checks = append(checks, checkCUDA())
	}
	return checks
}

func checkGPUDriver(h host, topo *gpudirect.Topology) Check {
	c := Check{Name: "gpu-driver"}
	var nvidia, others []string
	for _, g := range topo.GPUs {
		if g.Vendor == gpudirect.VendorNVIDIA {
			nvidia = append(nvidia, g.Address)
		} else {
			others = append(others, fmt.Sprintf("%s (vendor %04x)", g.Address, g.Vendor))
		}
	}
	var gpus string
	switch {
	case len(nvidia) > 0:
		gpus = "NVIDIA GPUs at " + strings.Join(nvidia, ", ")
	case len(others) > 0:
		gpus = "no NVIDIA GPU on the PCI bus (other display controllers: " + strings.Join(others, ", ") + ")"
	default:
		gpus = "no GPU on the PCI bus"
	}
	if !h.exists("/sys/module/nvidia") {
		c.Status, c.Detail = StatusUnavailable, "no NVIDIA kernel driver loaded (/sys/module/nvidia does not exist); "+gpus
		c.Advice = "GPUDirect needs an NVIDIA GPU and its driver; without one, tensors live in host memory and nothing needs doing"
		if len(nvidia) > 0 {
			c.Advice = "install and load the NVIDIA driver (modprobe nvidia); until then GPU tensors cannot be used"
		}
		return c
	}
	c.Status, c.Detail = StatusOK, "NVIDIA kernel driver loaded"
	if v, err := h.readTrim("/sys/module/nvidia/version"); err == nil && v != "" {
		c.Detail += ", version " + v
	}
	c.Detail += "; " + gpus
	return c
}

func checkPeermem(topo *gpudirect.Topology) Check {
	c := Check{Name: "nvidia-peermem", Detail: topo.Peermem.Detail}
	if topo.Peermem.Loaded {
		c.Status = StatusOK
		return c
	}
	c.Status = StatusUnavailable
	c.Advice = "on a host with an NVIDIA GPU and an RDMA NIC: modprobe nvidia_peermem (shipped with the NVIDIA driver), " +
		"or use dma-buf registration instead; otherwise GPU tensors are staged through host memory"
	return c
}

// checkDMABuf reports what dma-buf registration of GPU memory would need:
// RDMA dma-buf support in the kernel (Linux 5.12 and later) and a GPU
// driver that exports its memory as dma-bufs.
func checkDMABuf(h host, gpuDriver bool) Check {
	c := Check{Name: "dma-buf"}
	release, err := h.readTrim("/proc/sys/kernel/osrelease")
	if err != nil {
		release = "unknown"
	}
	kernelOK := kernelAtLeast(release, 5, 12)
	var found []string
	found = append(found, "kernel "+release)
	for _, p := range []string{"/sys/kernel/dmabuf", "/dev/dma_heap"} {
		if h.exists(p) {
			found = append(found, p+" present")
		} else {
			found = append(found, p+" absent")
		}
	}
	c.Detail = strings.Join(found, ", ")
	switch {
	case !kernelOK:
		c.Status = StatusUnavailable
		c.Detail += ": RDMA registration of dma-bufs needs Linux 5.12 or later"
		c.Advice = "upgrade the kernel to use dma-buf GPUDirect RDMA, or use nvidia_peermem"
	case !gpuDriver:
		c.Status = StatusUnavailable
		c.Detail += ": the kernel can register dma-bufs for RDMA, but no GPU driver is loaded to export them"
		c.Advice = "needs an NVIDIA GPU whose driver exports dma-bufs (the open kernel modules) and rdma-core with ibv_reg_dmabuf_mr"
	default:
		c.Status = StatusOK
		c.Detail += ": the kernel can register dma-bufs for RDMA and a GPU driver is loaded (whether it exports dma-bufs is not checked)"
	}
	return c
}

// kernelAtLeast compares a release string such as "6.1.0-18-amd64".
func kernelAtLeast(release string, major, minor int) bool {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return false
	}
	digits := func(s string) string { // "15-rc1" → "15"
		if i := strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
			return s[:i]
		}
		return s
	}
	gotMajor, err1 := strconv.Atoi(parts[0])
	gotMinor, err2 := strconv.Atoi(digits(parts[1]))
	if err1 != nil || err2 != nil {
		return false
	}
	return gotMajor > major || gotMajor == major && gotMinor >= minor
}

func checkP2Pmem(topo *gpudirect.Topology) Check {
	c := Check{Name: "p2pmem"}
	if len(topo.P2PMem) == 0 {
		c.Status, c.Detail = StatusUnavailable, "no PCI device publishes peer-to-peer memory (no /sys/bus/pci/devices/*/p2pmem)"
		c.Advice = "needs CONFIG_PCI_P2PDMA and a device that publishes memory for peer-to-peer DMA (e.g. an NVMe controller memory buffer); host memory works without it"
		return c
	}
	var devs []string
	usable := false
	for _, p := range topo.P2PMem {
		desc := fmt.Sprintf("%s %s (%s available)", p.PCIAddress, formatBytes(p.Size), formatBytes(p.Available))
		switch {
		case p.Published:
			desc += ", published"
			usable = true
		case p.Detail != "":
			desc += ", unreadable: " + p.Detail
			usable = true // a real kernel always has the files; say what is missing and let the user judge
		default:
			desc += ", not published"
		}
		devs = append(devs, desc)
	}
	c.Detail = strings.Join(devs, "; ")
	if usable {
		c.Status = StatusOK
		return c
	}
	c.Status = StatusUnavailable
	c.Advice = "the drivers of these devices keep their p2pmem for themselves (p2pmem/published is 0); host memory works without it"
	return c
}

// checkGPUPaths reports how a tensor in each GPU or p2pmem provider would
// reach each RDMA NIC.
func checkGPUPaths(topo *gpudirect.Topology) Check {
	c := Check{Name: "gpudirect-paths"}
	pairs := topo.Pairs()
	if len(pairs) == 0 {
		var missing []string
		for _, capability := range topo.Capabilities() {
			if (capability.Name == "gpu" || capability.Name == "rdma-nic") && !capability.Available {
				missing = append(missing, capability.Detail)
			}
		}
		if len(missing) == 0 { // GPUs and NICs, but no p2pmem and no pair: cannot happen
			missing = append(missing, "no pairing of device memory and RDMA NIC")
		}
		c.Status = StatusUnavailable
		c.Detail = strings.Join(missing, "; ") + ": device tensors use host staging"
		c.Advice = "a direct path needs device memory (an NVIDIA GPU or published p2pmem) and an RDMA NIC on the same PCIe switch; without them nothing needs doing"
		return c
	}
	var lines []string
	direct := 0
	for _, d := range pairs {
		if d.Path == gpudirect.Direct {
			direct++
		}
		lines = append(lines, fmt.Sprintf("%s→%s %s (%s)", d.Device, d.NIC, d.Path, d.Reason))
	}
	c.Detail = fmt.Sprintf("%d of %d pairs direct: %s", direct, len(pairs), strings.Join(lines, "; "))
	if direct > 0 {
		c.Status = StatusOK
		return c
	}
	c.Status = StatusUnavailable
	c.Advice = "every device tensor is staged through host memory; the reasons above say what is missing " +
		"(nvidia_peermem or dma-buf support, or a NIC on the device's PCIe switch)"
	return c
}

// checkCUDA loads the CUDA driver as gpudirect would.
func checkCUDA() Check {
	c := Check{Name: "cuda"}
	cuda, err := gpudirect.LoadCUDA()
	if err == nil {
		c.Status, c.Detail = StatusOK, cuda.String()
		return c
	}
	c.Status, c.Detail = StatusUnavailable, err.Error()
	switch {
	case errors.Is(err, gpudirect.ErrUnavailable) && strings.Contains(err.Error(), "without cgo"):
		c.Advice = "rebuild with CGO_ENABLED=1 on Linux to use CUDA device memory"
	default:
		c.Advice = "CUDA device memory needs an NVIDIA GPU and its driver (libcuda.so.1); without them tensors live in host memory and nothing needs doing"
	}
	return c
}
