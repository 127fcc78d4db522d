package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs/ibv"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
)

const memlockAdvice = "raise RLIMIT_MEMLOCK: `ulimit -l unlimited` in the shell, LimitMEMLOCK=infinity in a systemd unit, " +
	"`* - memlock unlimited` in /etc/security/limits.conf, or `docker run --ulimit memlock=-1`; " +
	"or give the process CAP_IPC_LOCK"

func checkRDMABuild() Check {
	if builtWithRDMA {
		return Check{Name: "rdma-build", Status: StatusOK, Detail: "built with -tags rdma: the ibv data plane uses libibverbs"}
	}
	return Check{
		Name: "rdma-build", Status: StatusUnavailable,
		Detail: "built without -tags rdma: the ibv data plane is a stub that has no devices",
		Advice: "on a host with an RDMA NIC, install libibverbs-dev (rdma-core) and build with CGO_ENABLED=1 go build -tags rdma",
	}
}

// checkRDMADevices asks the ibv provider for its devices; without them, it
// adds what sysfs shows, since the stub provider cannot look.
func checkRDMADevices(h host) Check {
	c := Check{Name: "rdma-devices"}
	devs, err := ibv.New().Devices()
	if err == nil && len(devs) > 0 {
		var names []string
		for _, d := range devs {
			names = append(names, fmt.Sprintf("%s (%s)", d.Name, d.Description))
		}
		c.Status, c.Detail = StatusOK, strings.Join(names, "; ")
		return c
	}
	c.Status = StatusUnavailable
	if err != nil {
		c.Detail = err.Error()
	} else {
		c.Detail = "ibv listed no devices"
	}
	kernel, haveDevices, haveUverbs := h.rdmaSysfs()
	if !builtWithRDMA {
		c.Detail += "; kernel: " + kernel
	}
	switch {
	case !haveDevices:
		c.Advice = "load the RDMA driver of the NIC (mlx5_ib, irdma, bnxt_re, efa, ...); to try RDMA without a NIC, " +
			"create a soft-RoCE device: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <interface>"
	case !haveUverbs:
		c.Advice = "modprobe ib_uverbs, which gives user space access to the devices"
	case !builtWithRDMA:
		c.Advice = "rebuild with -tags rdma (see rdma-build)"
	default:
		c.Advice = "install the rdma-core user-space provider for the NIC's driver (Debian: ibverbs-providers)"
	}
	return c
}

// rdmaSysfs describes /sys/class/infiniband.
func (h host) rdmaSysfs() (detail string, haveDevices, haveUverbs bool) {
	entries, err := os.ReadDir(h.path("/sys/class/infiniband"))
	switch {
	case os.IsNotExist(err):
		return "/sys/class/infiniband does not exist (no RDMA support in the kernel, or no RDMA driver loaded)", false, false
	case err != nil:
		return err.Error(), false, false
	case len(entries) == 0:
		return "/sys/class/infiniband is empty (no RDMA driver bound to a device)", false, false
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	haveUverbs = h.exists("/sys/class/infiniband_verbs")
	detail = "/sys/class/infiniband lists " + strings.Join(names, ", ")
	if !haveUverbs {
		detail += " but /sys/class/infiniband_verbs does not exist"
	}
	return detail, true, haveUverbs
}

// capIPCLock reports whether this process has CAP_IPC_LOCK, which lifts
// RLIMIT_MEMLOCK for mlock and RDMA registration.
func (h host) capIPCLock() bool {
	b, err := os.ReadFile(h.path("/proc/self/status"))
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			const capIPCLockBit = 14
			return err == nil && caps&(1<<capIPCLockBit) != 0
		}
	}
	return false
}

func checkMemlock(h host) Check {
	soft, hard, err := memlockLimit()
	if err != nil {
		return Check{Name: "memlock", Status: StatusUnavailable, Detail: err.Error(), Advice: "pinning is not available on this system; tensorrpc works unpinned"}
	}
	return memlockCheck(soft, hard, h.capIPCLock())
}

// memlockCheck judges RLIMIT_MEMLOCK against a pool's default limit, the
// memory tensorrpc pins (and RDMA registers) per pool.
func memlockCheck(soft, hard uint64, capIPCLock bool) Check {
	c := Check{Name: "memlock"}
	show := func(v uint64) string {
		if v == unlimited {
			return "unlimited"
		}
		return formatBytes(v)
	}
	c.Detail = fmt.Sprintf("RLIMIT_MEMLOCK %s (soft), %s (hard)", show(soft), show(hard))
	switch {
	case soft == unlimited || soft >= mempool.DefaultLimit:
		c.Status = StatusOK
		c.Detail += fmt.Sprintf(": a pool of mempool's default limit (%s) can be pinned", formatBytes(mempool.DefaultLimit))
	case capIPCLock:
		c.Status = StatusOK
		c.Detail += "; this process has CAP_IPC_LOCK, so the limit does not apply to it (it does to processes without the capability)"
	default:
		c.Status = StatusWarning
		c.Detail += fmt.Sprintf(": only %s can be pinned in all; larger pools run unpinned and RDMA registration beyond it fails", show(soft))
		c.Advice = memlockAdvice
	}
	return c
}

func checkPinning() Check {
	const size = 4 << 20
	c := Check{Name: "pinning"}
	a, err := mempool.NewArena(mempool.BackingAnonymous, size)
	if err != nil {
		c.Status, c.Detail = StatusUnavailable, fmt.Sprintf("mapping a %s arena: %v", formatBytes(size), err)
		return c
	}
	defer a.Close()
	if a.Pinned() {
		c.Status, c.Detail = StatusOK, fmt.Sprintf("a %s arena was pinned (mlock)", formatBytes(uint64(a.Len())))
		return c
	}
	c.Status = StatusWarning
	c.Detail = fmt.Sprintf("a %s arena could not be pinned: %v", formatBytes(uint64(a.Len())), a.PinError())
	c.Advice = memlockAdvice
	return c
}

func checkHugepages(h host) Check {
	c := Check{Name: "hugepages"}
	mi, err := h.meminfo()
	if err != nil {
		c.Status, c.Detail = StatusUnavailable, err.Error()
		c.Advice = "huge pages are a Linux feature; mempool uses ordinary pages"
		return c
	}
	total, free, size := mi["HugePages_Total"], mi["HugePages_Free"], mi["Hugepagesize"]
	c.Detail = fmt.Sprintf("HugePages_Total %d, HugePages_Free %d, Hugepagesize %s", total, free, formatBytes(size))
	reserve := "reserve huge pages for BackingHugepages arenas, e.g. sysctl vm.nr_hugepages=512 (512 × 2 MiB = 1 GiB), " +
		"or hugepagesz=1G hugepages=N on the kernel command line; meanwhile such arenas use transparent huge pages"
	switch {
	case total == 0:
		c.Status, c.Advice = StatusUnavailable, reserve
		c.Detail += ": none reserved"
	case free == 0:
		c.Status, c.Advice = StatusWarning, "all reserved huge pages are in use: "+reserve
	default:
		c.Status = StatusOK
		c.Detail += fmt.Sprintf(": %s free", formatBytes(free*size))
	}
	return c
}

func checkTransparentHugepages(h host) Check {
	c := Check{Name: "transparent-hugepages"}
	v, err := h.readTrim("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		c.Status, c.Detail = StatusUnavailable, err.Error()
		c.Advice = "the kernel lacks transparent huge pages (CONFIG_TRANSPARENT_HUGEPAGE); arenas use 4 KiB pages"
		return c
	}
	mode := v
	if i, j := strings.Index(v, "["), strings.Index(v, "]"); i >= 0 && j > i {
		mode = v[i+1 : j]
	}
	c.Detail = fmt.Sprintf("enabled: %s (%s)", mode, v)
	switch mode {
	case "always", "madvise":
		c.Status = StatusOK
		c.Detail += ": BackingHugepages arenas get them with madvise(MADV_HUGEPAGE)"
	default:
		c.Status = StatusUnavailable
		c.Advice = "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (or transparent_hugepage=madvise on the kernel command line)"
	}
	return c
}

func checkMemfd() Check {
	c := Check{Name: "memfd"}
	memfdErr, sealErr := tryMemfd()
	switch {
	case memfdErr != nil:
		c.Status, c.Detail = StatusUnavailable, memfdErr.Error()
		c.Advice = "the shm data plane needs memfd_create (Linux ≥ 3.17) and a seccomp profile that allows it; tcp is used instead"
	case sealErr != nil:
		c.Status, c.Detail = StatusUnavailable, "memfd_create works but sealing does not: "+sealErr.Error()
		c.Advice = "the shm data plane refuses unsealed memory (a peer could truncate it); tcp is used instead"
	default:
		c.Status, c.Detail = StatusOK, "memfd_create works and F_SEAL_SHRINK|F_SEAL_GROW hold (a sealed memfd refuses to shrink)"
	}
	return c
}

func checkSHM() Check {
	c := Check{Name: "shm"}
	id, err := shm.HostIdentity()
	if err != nil {
		c.Status, c.Detail = StatusUnavailable, "host identity: "+err.Error()
		c.Advice = "the shm data plane needs /proc/sys/kernel/random/boot_id and /proc/self/ns/net to tell hosts apart"
		return c
	}
	devs, err := shm.New().Devices()
	if err != nil || len(devs) == 0 {
		c.Status, c.Detail = StatusUnavailable, fmt.Sprintf("host identity %s, but the shm provider has no device: %v", id, err)
		c.Advice = "see the memfd check"
		return c
	}
	c.Status = StatusOK
	c.Detail = fmt.Sprintf("host identity %s (boot id, machine id, network namespace): processes that share it use shm with each other", id)
	return c
}
