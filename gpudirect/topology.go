package gpudirect

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Topology is what Discover found under a sysfs root: PCI devices and their
// place in the PCIe tree, GPUs, RDMA devices, p2pmem providers, the
// GPUDirect kernel support, and the policy that decides which routes may
// carry peer-to-peer traffic. It is read-only after Discover and safe for
// concurrent use.
type Topology struct {
	// Root is the directory that stands for "/" ("/" on a real host).
	Root string
	// PCI holds every PCI device, by address ("0000:03:00.0").
	PCI map[string]*PCIDevice
	// GPUs are the 3D and VGA controllers (PCI class 0x0302 and 0x0300),
	// in address order; NVIDIA ones (vendor 0x10de) can use CUDA.
	GPUs []*PCIDevice
	// RDMA lists /sys/class/infiniband, in name order.
	RDMA []RDMADevice
	// P2PMem lists the PCI devices that offer peer-to-peer memory
	// (/sys/bus/pci/devices/<addr>/p2pmem), published or not, in address
	// order.
	P2PMem []P2PProvider
	// Peermem says whether RDMA NICs can register GPU memory by address.
	Peermem Peermem
	// DMABuf says whether the ibv provider can register DMA-BUFs.
	DMABuf DMABuf
	// Notes say what could not be read, for diagnostics.
	Notes []string

	hostBridgeP2P bool
}

// PCIDevice is one PCI function.
type PCIDevice struct {
	Address  string // "0000:03:00.0"
	Vendor   uint16
	Device   uint16
	Class    uint32 // 24 bits: base class, subclass, programming interface
	NUMANode int    // -1 when the platform does not say
	Driver   string // the bound driver's name, "" when none
	// HostBridge names the root complex the device hangs from
	// ("pci0000:00"), from its real sysfs path; "" when unknown.
	HostBridge string
	// Upstream lists the device's upstream bridges from the nearest to the
	// root port, as the kernel's pci_upstream_bridge walks them.
	Upstream []string
	// ACSRedirect is true when the bridge's ACS control register
	// redirects peer-to-peer requests or completions (or enables egress
	// control) upward, which sends peer traffic through the root complex.
	// ACSKnown is false for functions other than bridges, which are not
	// read, and when config space could not be read that far (it takes
	// root privileges).
	ACSRedirect, ACSKnown bool
}

// VendorNVIDIA is NVIDIA's PCI vendor ID.
const VendorNVIDIA = 0x10de

// IsGPU reports whether the device is a VGA (0x0300) or 3D (0x0302)
// controller.
func (d *PCIDevice) IsGPU() bool {
	sub := d.Class >> 8
	return sub == 0x0300 || sub == 0x0302
}

// IsBridge reports whether the device is a PCI-to-PCI bridge (class
// 0x0604): a root port or a switch port.
func (d *PCIDevice) IsBridge() bool { return d.Class>>8 == 0x0604 }

// String describes the device, e.g. "0000:03:00.0 (10de:2330 class 0x030200)".
func (d *PCIDevice) String() string {
	return fmt.Sprintf("%s (%04x:%04x class %#06x)", d.Address, d.Vendor, d.Device, d.Class)
}

// RDMADevice is an entry of /sys/class/infiniband.
type RDMADevice struct {
	Name string // "mlx5_0"
	// PCIAddress is the NIC's PCI function; "" for software devices (rxe,
	// siw), which move bytes with the CPU.
	PCIAddress string
	NUMANode   int
}

// P2PProvider is a PCI device that offers memory for peer-to-peer DMA.
type P2PProvider struct {
	PCIAddress string
	// Size and Available are the bytes of the pool and those not yet
	// allocated.
	Size, Available uint64
	// Published is true when the owning driver offers the memory to others
	// (p2pmem/published reads 1). Unpublished memory is kept for the
	// driver's own use and never allocated here.
	Published bool
	// Detail says what could not be read, if anything.
	Detail string
}

// Peermem says whether GPU memory can be registered with an RDMA NIC by its
// virtual address.
type Peermem struct {
	Loaded bool
	// Source names what was found: "nvidia_peermem", "nv_peer_mem", or
	// "memory_peers/nv_mem".
	Source  string
	Version string
	// Detail is a sentence for diagnostics.
	Detail string
}

// DMABuf says whether the ibv provider can register DMA-BUF file
// descriptors (ibv_reg_dmabuf_mr, rdma-core 34 and Linux 5.12 on).
type DMABuf struct {
	Supported bool
	Detail    string
}

// Option configures Discover.
type Option func(*options)

type options struct {
	root          string
	dmabuf        func() (bool, string)
	hostBridgeP2P bool
}

// WithRoot makes Discover read dir/sys instead of /sys. Tests point it at
// fixture trees.
func WithRoot(dir string) Option { return func(o *options) { o.root = dir } }

// WithDMABuf tells Discover whether the ibv provider can register DMA-BUFs,
// which only the provider can find out (it needs ibv_reg_dmabuf_mr and a
// device). The function returns the answer and a sentence saying why. By
// default DMA-BUF registration counts as unsupported.
func WithDMABuf(probe func() (supported bool, detail string)) Option {
	return func(o *options) { o.dmabuf = probe }
}

// WithHostBridgeP2P allows peer-to-peer routes through the host bridge
// (class PHB: same root complex or NUMA node, no common PCIe switch). They
// are off by default: many root complexes forward peer-to-peer traffic
// slowly, or not at all, which the kernel's p2pdma code guards with a
// whitelist of host bridges. Routes across NUMA nodes (SYS) are never
// allowed.
func WithHostBridgeP2P(allow bool) Option { return func(o *options) { o.hostBridgeP2P = allow } }

// Discover reads the PCI devices, GPUs, RDMA devices, p2pmem providers and
// GPUDirect kernel support under the root's sys directory. Parts that are
// missing (no PCI bus in a container, no RDMA in the kernel) leave their
// fields empty and say so in Notes; only a root that does not exist is an
// error.
func Discover(opts ...Option) (*Topology, error) {
	o := options{root: "/"}
	for _, opt := range opts {
		opt(&o)
	}
	root, err := filepath.EvalSymlinks(o.root)
	if err != nil {
		return nil, fmt.Errorf("gpudirect: sysfs root: %w", err)
	}
	t := &Topology{Root: o.root, PCI: map[string]*PCIDevice{}, hostBridgeP2P: o.hostBridgeP2P}
	r := sysfs{root: root, t: t}
	r.readPCI()
	r.readRDMA()
	r.readP2PMem()
	t.Peermem = r.readPeermem()
	if o.dmabuf != nil {
		t.DMABuf.Supported, t.DMABuf.Detail = o.dmabuf()
	} else {
		t.DMABuf.Detail = "the ibv provider did not report DMA-BUF support (ibv_reg_dmabuf_mr needs -tags rdma, rdma-core 34 and Linux 5.12 or later)"
	}
	return t, nil
}

// HostBridgeP2P reports the policy given by WithHostBridgeP2P.
func (t *Topology) HostBridgeP2P() bool { return t.hostBridgeP2P }

// RDMADevice returns the RDMA device called name.
func (t *Topology) RDMADevice(name string) (RDMADevice, bool) {
	i := slices.IndexFunc(t.RDMA, func(d RDMADevice) bool { return d.Name == name })
	if i < 0 {
		return RDMADevice{}, false
	}
	return t.RDMA[i], true
}

// P2PProvider returns the p2pmem provider at the PCI address.
func (t *Topology) P2PProvider(addr string) (P2PProvider, bool) {
	i := slices.IndexFunc(t.P2PMem, func(p P2PProvider) bool { return p.PCIAddress == addr })
	if i < 0 {
		return P2PProvider{}, false
	}
	return t.P2PMem[i], true
}

// Capability is one line of what the host offers for device memory.
type Capability struct {
	Name      string // "gpu", "rdma-nic", "nvidia-peermem", "dma-buf", "p2pmem"
	Available bool
	Detail    string
}

// String reads "name: available: detail" or "name: unavailable, using host
// staging: detail".
func (c Capability) String() string {
	if c.Available {
		return c.Name + ": available: " + c.Detail
	}
	return c.Name + ": unavailable, using host staging: " + c.Detail
}

// Capabilities summarizes the topology, one line per ingredient of a direct
// path. Without any of them, device tensors go through host staging, and
// each line says why.
func (t *Topology) Capabilities() []Capability {
	var caps []Capability
	gpu := Capability{Name: "gpu"}
	if len(t.GPUs) == 0 {
		gpu.Detail = "no GPU (no PCI device of class 0x0300 or 0x0302)"
		if len(t.PCI) == 0 {
			gpu.Detail += "; no PCI devices were readable under " + filepath.Join(t.Root, "sys/bus/pci/devices")
		}
	} else {
		var names []string
		for _, g := range t.GPUs {
			s := g.String()
			if g.Vendor == VendorNVIDIA {
				s += " NVIDIA"
			}
			if g.Driver != "" {
				s += " driver " + g.Driver
			}
			names = append(names, s)
		}
		gpu.Available, gpu.Detail = true, strings.Join(names, "; ")
	}
	caps = append(caps, gpu)

	nic := Capability{Name: "rdma-nic"}
	var nics []string
	for _, d := range t.RDMA {
		if d.PCIAddress != "" {
			nics = append(nics, d.Name+" at "+d.PCIAddress)
		}
	}
	switch {
	case len(nics) > 0:
		nic.Available, nic.Detail = true, strings.Join(nics, ", ")
	case len(t.RDMA) > 0:
		nic.Detail = "only software RDMA devices (no PCI parent), which cannot reach device memory"
	default:
		nic.Detail = "no RDMA device: " + filepath.Join(t.Root, "sys/class/infiniband") + " is missing or empty"
	}
	caps = append(caps, nic)

	caps = append(caps, Capability{Name: "nvidia-peermem", Available: t.Peermem.Loaded, Detail: t.Peermem.Detail})
	caps = append(caps, Capability{Name: "dma-buf", Available: t.DMABuf.Supported, Detail: t.DMABuf.Detail})

	p2p := Capability{Name: "p2pmem"}
	var published, unpublished []string
	for _, p := range t.P2PMem {
		if p.Published {
			published = append(published, fmt.Sprintf("%s (%d of %d bytes available)", p.PCIAddress, p.Available, p.Size))
		} else {
			unpublished = append(unpublished, p.PCIAddress)
		}
	}
	switch {
	case len(published) > 0:
		p2p.Available, p2p.Detail = true, "published: "+strings.Join(published, ", ")
		if len(unpublished) > 0 {
			p2p.Detail += "; not published: " + strings.Join(unpublished, ", ")
		}
	case len(unpublished) > 0:
		p2p.Detail = "p2pmem exists but is not published: " + strings.Join(unpublished, ", ")
	default:
		p2p.Detail = "no PCI device offers peer-to-peer memory (no /sys/bus/pci/devices/*/p2pmem; needs CONFIG_PCI_P2PDMA and a provider such as an NVMe CMB)"
	}
	caps = append(caps, p2p)
	return caps
}

// exists reports whether p exists.
func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
