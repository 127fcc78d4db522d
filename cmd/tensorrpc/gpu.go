package main

// GPUDirect and PCI peer-to-peer memory. For now doctor only reports what
// the host has; the gpudirect package, when it comes, will own detection
// and this file will ask it instead.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

func checkGPUDirect(h host) []Check {
	driver := checkGPUDriver(h)
	return []Check{driver, checkPeermem(h), checkDMABuf(h, driver.Status == StatusOK), checkP2Pmem(h)}
}

func checkGPUDriver(h host) Check {
	c := Check{Name: "gpu-driver"}
	if !h.exists("/sys/module/nvidia") {
		c.Status, c.Detail = StatusUnavailable, "no NVIDIA kernel driver loaded (/sys/module/nvidia does not exist)"
		c.Advice = "GPUDirect needs an NVIDIA GPU and its driver; without one, tensors live in host memory and nothing needs doing"
		return c
	}
	c.Status, c.Detail = StatusOK, "NVIDIA kernel driver loaded"
	if v, err := h.readTrim("/sys/module/nvidia/version"); err == nil && v != "" {
		c.Detail += ", version " + v
	}
	return c
}

func checkPeermem(h host) Check {
	c := Check{Name: "nvidia-peermem"}
	switch {
	case h.exists("/sys/module/nvidia_peermem"):
		c.Status, c.Detail = StatusOK, "nvidia_peermem is loaded: RDMA NICs can register GPU memory (GPUDirect RDMA)"
	case h.exists("/sys/module/nv_peer_mem"):
		c.Status, c.Detail = StatusOK, "nv_peer_mem (the older Mellanox module) is loaded: RDMA NICs can register GPU memory (GPUDirect RDMA)"
	default:
		c.Status, c.Detail = StatusUnavailable, "neither nvidia_peermem nor nv_peer_mem is loaded (/sys/module/nvidia_peermem does not exist)"
		c.Advice = "on a host with an NVIDIA GPU and an RDMA NIC: modprobe nvidia_peermem (shipped with the NVIDIA driver), " +
			"or use dma-buf registration instead; otherwise GPU tensors are staged through host memory"
	}
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

func checkP2Pmem(h host) Check {
	c := Check{Name: "p2pmem"}
	dirs, _ := filepath.Glob(h.path("/sys/bus/pci/devices/*/p2pmem"))
	if len(dirs) == 0 {
		c.Status, c.Detail = StatusUnavailable, "no PCI device publishes peer-to-peer memory (no /sys/bus/pci/devices/*/p2pmem)"
		c.Advice = "needs CONFIG_PCI_P2PDMA and a device that publishes memory for peer-to-peer DMA (e.g. an NVMe controller memory buffer); host memory works without it"
		return c
	}
	var devs []string
	for _, d := range dirs {
		dev := filepath.Base(filepath.Dir(d))
		desc := dev
		if size, err := readUint(filepath.Join(d, "size")); err == nil {
			desc += " " + formatBytes(size)
			if avail, err := readUint(filepath.Join(d, "available")); err == nil {
				desc += fmt.Sprintf(" (%s available)", formatBytes(avail))
			}
		}
		devs = append(devs, desc)
	}
	c.Status, c.Detail = StatusOK, "p2pmem: "+strings.Join(devs, ", ")
	return c
}

func readUint(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimSpace(string(b)), 0, 64)
}
