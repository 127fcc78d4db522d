package gpudirect

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// This file reads sysfs only. It is pure Go so that fixture trees test it on
// every build.

// pciAddress matches a PCI function address, domain:bus:device.function.
var pciAddress = regexp.MustCompile(`^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

type sysfs struct {
	root string // symlinks resolved
	t    *Topology
}

func (r sysfs) path(p string) string { return filepath.Join(r.root, "sys", p) }

func (r sysfs) note(format string, args ...any) {
	r.t.Notes = append(r.t.Notes, fmt.Sprintf(format, args...))
}

func readTrim(p string) (string, error) {
	b, err := os.ReadFile(p)
	return strings.TrimSpace(string(b)), err
}

func readHex(p string, bits int) (uint64, error) {
	s, err := readTrim(p)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimPrefix(s, "0x"), 16, bits)
}

// readUint reads a decimal or 0x-prefixed number.
func readUint(p string) (uint64, error) {
	s, err := readTrim(p)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(s, 0, 64)
}

// readPCI reads /sys/bus/pci/devices. Each entry is a symlink to the
// device's real place in /sys/devices, whose path spells out the PCIe tree:
// .../pci0000:00/0000:00:01.0/0000:01:00.0 is a function behind the bridge
// 0000:00:01.0 on host bridge pci0000:00.
func (r sysfs) readPCI() {
	dir := r.path("bus/pci/devices")
	entries, err := os.ReadDir(dir)
	if err != nil {
		r.note("no PCI devices: %v", err)
		return
	}
	for _, e := range entries {
		addr := e.Name()
		if !pciAddress.MatchString(addr) {
			continue
		}
		d := &PCIDevice{Address: addr, NUMANode: -1}
		p := filepath.Join(dir, addr)
		if v, err := readHex(filepath.Join(p, "vendor"), 16); err == nil {
			d.Vendor = uint16(v)
		}
		if v, err := readHex(filepath.Join(p, "device"), 16); err == nil {
			d.Device = uint16(v)
		}
		if v, err := readHex(filepath.Join(p, "class"), 24); err == nil {
			d.Class = uint32(v)
		}
		if s, err := readTrim(filepath.Join(p, "numa_node")); err == nil {
			if n, err := strconv.Atoi(s); err == nil && n >= 0 {
				d.NUMANode = n
			}
		}
		if link, err := os.Readlink(filepath.Join(p, "driver")); err == nil {
			d.Driver = filepath.Base(link)
		}
		r.placePCI(d, p)
		if d.IsBridge() {
			// Only bridges: reading an endpoint's config space would wake
			// a runtime-suspended GPU, and endpoints rarely redirect.
			d.ACSRedirect, d.ACSKnown = readACS(filepath.Join(p, "config"))
		}
		r.t.PCI[addr] = d
		if d.IsGPU() {
			r.t.GPUs = append(r.t.GPUs, d)
		}
	}
	sort.Slice(r.t.GPUs, func(i, j int) bool { return r.t.GPUs[i].Address < r.t.GPUs[j].Address })
}

// placePCI finds the device's host bridge and upstream bridges from its real
// sysfs path.
func (r sysfs) placePCI(d *PCIDevice, p string) {
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		r.note("%s: %v", d.Address, err)
		return
	}
	rel, err := filepath.Rel(r.root, real)
	if err != nil || !strings.HasPrefix(rel, filepath.Join("sys", "devices")+string(filepath.Separator)) {
		r.note("%s: its sysfs entry is not a link into sys/devices, so its place in the PCIe tree is unknown", d.Address)
		return
	}
	parts := strings.Split(rel, string(filepath.Separator))
	// The last pciDDDD:BB component is the root bus the chain hangs from
	// (a VMD domain nests one inside another root complex's tree).
	host := -1
	for i, c := range parts {
		if strings.HasPrefix(c, "pci") && !pciAddress.MatchString(c) {
			host = i
		}
	}
	if host < 0 || parts[len(parts)-1] != d.Address {
		r.note("%s: no host bridge in its sysfs path %s", d.Address, rel)
		return
	}
	d.HostBridge = parts[host]
	for i := len(parts) - 2; i > host; i-- {
		if pciAddress.MatchString(parts[i]) {
			d.Upstream = append(d.Upstream, parts[i])
		}
	}
}

// ACS extended capability: ID, and the control register bits the kernel's
// pci_bridge_has_acs_redir looks at (P2P request redirect, P2P completion
// redirect, egress control).
const (
	pciExtCapACS   = 0x000d
	pciACSCtrl     = 6
	pciACSRedirect = 0x0004 | 0x0008 | 0x0020
)

// readACS reads the ACS control register from a config space file. Reading
// the extended config space (past 256 bytes) needs root; without it, known
// is false.
func readACS(path string) (redirect, known bool) {
	cfg, err := os.ReadFile(path)
	if err != nil || len(cfg) < 0x104 {
		return false, false
	}
	off := 0x100
	for range 64 { // a capability list cannot be longer; a loop in it ends here
		if off < 0x100 || off+8 > len(cfg) {
			return false, true
		}
		hdr := binary.LittleEndian.Uint32(cfg[off:])
		if hdr == 0 || hdr == 0xffffffff {
			return false, true
		}
		if hdr&0xffff == pciExtCapACS {
			return binary.LittleEndian.Uint16(cfg[off+pciACSCtrl:])&pciACSRedirect != 0, true
		}
		next := int(hdr>>20) &^ 3
		if next == 0 {
			return false, true
		}
		off = next
	}
	return false, true
}

// readRDMA reads /sys/class/infiniband/<dev>/device, a link to the NIC's PCI
// function (absent for software devices).
func (r sysfs) readRDMA() {
	dir := r.path("class/infiniband")
	entries, err := os.ReadDir(dir)
	if err != nil {
		r.note("no RDMA devices: %v", err)
		return
	}
	for _, e := range entries {
		d := RDMADevice{Name: e.Name(), NUMANode: -1}
		if real, err := filepath.EvalSymlinks(filepath.Join(dir, d.Name, "device")); err == nil {
			if addr := filepath.Base(real); pciAddress.MatchString(addr) {
				d.PCIAddress = addr
				if p, ok := r.t.PCI[addr]; ok {
					d.NUMANode = p.NUMANode
				}
			}
		}
		r.t.RDMA = append(r.t.RDMA, d)
	}
	sort.Slice(r.t.RDMA, func(i, j int) bool { return r.t.RDMA[i].Name < r.t.RDMA[j].Name })
}

// readP2PMem reads /sys/bus/pci/devices/<addr>/p2pmem/{size,available,published}.
func (r sysfs) readP2PMem() {
	dirs, _ := filepath.Glob(r.path("bus/pci/devices/*/p2pmem"))
	for _, dir := range dirs {
		p := P2PProvider{PCIAddress: filepath.Base(filepath.Dir(dir))}
		var problems []string
		var err error
		if p.Size, err = readUint(filepath.Join(dir, "size")); err != nil {
			problems = append(problems, "size: "+err.Error())
		}
		if p.Available, err = readUint(filepath.Join(dir, "available")); err != nil {
			problems = append(problems, "available: "+err.Error())
		}
		if v, err := readUint(filepath.Join(dir, "published")); err != nil {
			problems = append(problems, "published: "+err.Error())
		} else {
			p.Published = v != 0
		}
		p.Detail = strings.Join(problems, "; ")
		r.t.P2PMem = append(r.t.P2PMem, p)
	}
	sort.Slice(r.t.P2PMem, func(i, j int) bool { return r.t.P2PMem[i].PCIAddress < r.t.P2PMem[j].PCIAddress })
}

// readPeermem looks for the kernel modules that let RDMA drivers resolve GPU
// virtual addresses: nvidia_peermem (shipped with the NVIDIA driver since
// 465), the older Mellanox nv_peer_mem, or a peer memory client registered
// with MLNX_OFED's memory_peers interface.
func (r sysfs) readPeermem() Peermem {
	for _, m := range []string{"nvidia_peermem", "nv_peer_mem"} {
		dir := r.path("module/" + m)
		if !exists(dir) {
			continue
		}
		pm := Peermem{Loaded: true, Source: m}
		pm.Version, _ = readTrim(filepath.Join(dir, "version"))
		pm.Detail = m + " is loaded: RDMA NICs can register GPU memory by address (GPUDirect RDMA)"
		if pm.Version != "" {
			pm.Detail = m + " " + pm.Version + " is loaded: RDMA NICs can register GPU memory by address (GPUDirect RDMA)"
		}
		return pm
	}
	if v, err := readTrim(r.path("kernel/mm/memory_peers/nv_mem/version")); err == nil {
		return Peermem{Loaded: true, Source: "memory_peers/nv_mem", Version: v,
			Detail: "the nv_mem peer memory client " + v + " is registered (/sys/kernel/mm/memory_peers/nv_mem): RDMA NICs can register GPU memory by address (GPUDirect RDMA)"}
	}
	return Peermem{Detail: "nvidia_peermem is not loaded (no /sys/module/nvidia_peermem, /sys/module/nv_peer_mem or /sys/kernel/mm/memory_peers/nv_mem)"}
}
