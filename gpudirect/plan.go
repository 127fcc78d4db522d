package gpudirect

import (
	"fmt"
	"strings"
)

// Path is how a transfer reaches device memory.
type Path int

const (
	// Staged: the tensor goes through a pinned host buffer (StageOut,
	// StageIn), one copy more than Direct. It is the zero value.
	Staged Path = iota
	// Direct: the NIC reads or writes the device memory itself.
	Direct
	// IPC: a process on the same host copies the device memory device to
	// device through a CUDA IPC handle (rpc.WithCUDA); no host memory and
	// no NIC.
	IPC
)

// String returns "staged", "direct" or "ipc".
func (p Path) String() string {
	switch p {
	case Direct:
		return "direct"
	case IPC:
		return "ipc"
	}
	return "staged"
}

// Decision says how to move one device buffer through one NIC, and why.
type Decision struct {
	Path Path
	// Reason is a sentence for logs and diagnostics.
	Reason string
	// Device is the PCI address of the memory's device ("" when it has
	// none); NIC the RDMA device ("" when none could be chosen).
	Device, NIC string
	// Mechanism is how the NIC reaches the memory on a Direct path.
	Mechanism Mechanism
	// Route is the PCIe route from the memory to the NIC; its Class is
	// ClassUnknown when there is none.
	Route Route
}

func staged(format string, args ...any) Decision {
	return Decision{Path: Staged, Reason: fmt.Sprintf(format, args...) + "; using host staging"}
}

// Plan decides how a transfer of buf through the data plane provider moves
// its bytes. provider is the verbs provider's name, optionally with a
// device: "ibv" (the RDMA NIC closest to the memory), "ibv:mlx5_0", or a
// software provider ("shm", "tcp", "grpc"), which always stages since the
// CPU moves its bytes. A nil topology stages. The rpc layer calls Plan per
// transfer; it reads only the topology, so it is cheap.
func Plan(buf DeviceBuffer, provider string, topo *Topology) Decision {
	if topo == nil {
		return staged("no PCI topology was discovered")
	}
	if _, ok := buf.Direct(); !ok {
		return staged("%s has no memory the NIC can address directly", buf.Device())
	}
	name, nic, _ := strings.Cut(provider, ":")
	switch name {
	case "ibv":
	case "shm", "tcp", "grpc":
		return staged("the %s data plane moves bytes with the CPU, which does not read %s as a NIC would", provider, buf.Device())
	default:
		return staged("unknown data plane %q (want ibv, ibv:<device>, shm, tcp or grpc)", provider)
	}
	pm, ok := buf.(PCIMemory)
	if !ok {
		return staged("%s does not say which PCI device holds its memory", buf.Device())
	}
	return topo.decide(pm.PCIAddress(), nic, pm.Mechanism())
}

// Decide is Plan for a device by PCI address: the memory of the GPU or
// p2pmem provider at device, moved through the RDMA device nic (or, when nic
// is "", through the RDMA NIC closest to it). The mechanism is p2pmem for a
// p2pmem provider; for an NVIDIA GPU, nvidia_peermem when it is loaded,
// else DMA-BUF when the ibv provider supports it.
func (t *Topology) Decide(device, nic string) Decision {
	return t.decide(device, nic, MechanismNone)
}

func (t *Topology) decide(device, nic string, mech Mechanism) Decision {
	d := t.decideMechanism(device, mech)
	d.Device = device
	if d.Mechanism == MechanismNone {
		return d
	}
	n, reason := t.pickNIC(device, nic)
	if n.PCIAddress == "" {
		r := staged("%s", reason)
		r.Device, r.NIC = device, n.Name
		return r
	}
	d.NIC = n.Name
	route, err := t.Route(device, n.PCIAddress)
	if err != nil {
		r := staged("%v", err)
		r.Device, r.NIC = device, n.Name
		return r
	}
	d.Route = route
	what := fmt.Sprintf("%s and %s (%s) %s", device, n.Name, n.PCIAddress, route.Detail)
	switch {
	case route.Class == ClassUnknown:
		d.Path, d.Reason = Staged, what+"; using host staging"
	case t.allowed(route.Class) && route.Class == ClassPHB:
		d.Path, d.Reason = Direct, fmt.Sprintf("%s: direct via %s, through the host bridge as WithHostBridgeP2P allows", what, d.Mechanism)
	case t.allowed(route.Class):
		d.Path, d.Reason = Direct, fmt.Sprintf("%s: direct via %s", what, d.Mechanism)
	case route.Class == ClassPHB:
		d.Path, d.Reason = Staged, what+": peer-to-peer through the host bridge is off (WithHostBridgeP2P enables it); using host staging"
	default:
		d.Path, d.Reason = Staged, what+": peer-to-peer across NUMA nodes is never used; using host staging"
	}
	return d
}

// decideMechanism picks how a NIC would reach the device's memory, or
// returns a staged decision saying why none can.
func (t *Topology) decideMechanism(device string, mech Mechanism) Decision {
	if mech == MechanismNone {
		if _, ok := t.P2PProvider(device); ok {
			mech = MechanismP2PMem
		} else if g, ok := t.PCI[device]; ok && g.IsGPU() {
			if g.Vendor != VendorNVIDIA {
				return staged("%s is a GPU of vendor %04x: GPUDirect here needs an NVIDIA GPU and CUDA", g, g.Vendor)
			}
			switch {
			case t.Peermem.Loaded:
				mech = MechanismPeermem
			case t.DMABuf.Supported:
				mech = MechanismDMABuf
			default:
				return staged("GPU %s: neither GPUDirect mechanism is usable: %s, and %s", device, t.Peermem.Detail, t.DMABuf.Detail)
			}
		} else if ok {
			return staged("%s is neither a GPU nor a p2pmem provider", g)
		} else {
			return staged("no PCI device %s under %s", device, t.Root)
		}
	}
	switch mech {
	case MechanismP2PMem:
		p, ok := t.P2PProvider(device)
		if !ok {
			return staged("%s offers no p2pmem", device)
		}
		if !p.Published {
			why := "its driver keeps it for its own use"
			if p.Detail != "" {
				why = p.Detail
			}
			return staged("p2pmem of %s is not published (%s)", device, why)
		}
	case MechanismPeermem:
		if !t.Peermem.Loaded {
			return staged("GPU %s: %s", device, t.Peermem.Detail)
		}
	case MechanismDMABuf:
		if !t.DMABuf.Supported {
			return staged("GPU %s: %s", device, t.DMABuf.Detail)
		}
	}
	return Decision{Mechanism: mech}
}

// pickNIC returns the named RDMA device, or the PCI one closest to device.
// A result without PCIAddress comes with the reason it cannot be used.
func (t *Topology) pickNIC(device, name string) (RDMADevice, string) {
	if name != "" {
		n, ok := t.RDMADevice(name)
		switch {
		case !ok:
			return RDMADevice{}, fmt.Sprintf("no RDMA device %s under %s", name, t.Root)
		case n.PCIAddress == "":
			return n, fmt.Sprintf("%s is a software RDMA device (no PCI parent): the CPU moves its bytes and cannot read device memory as a NIC would", name)
		}
		return n, ""
	}
	var best RDMADevice
	bestRank := [2]int{}
	for _, n := range t.RDMA {
		if n.PCIAddress == "" {
			continue
		}
		r, err := t.Route(device, n.PCIAddress)
		if err != nil {
			continue
		}
		// Prefer allowed classes, then the smallest distance; names break
		// ties (t.RDMA is sorted).
		rank := [2]int{int(r.Class), r.Distance}
		if r.Class == ClassUnknown {
			rank[0] = int(ClassSYS) + 1
		}
		if best.Name == "" || rank[0] < bestRank[0] || rank[0] == bestRank[0] && rank[1] < bestRank[1] {
			best, bestRank = n, rank
		}
	}
	if best.Name == "" {
		return RDMADevice{}, "no RDMA NIC with a PCI parent (sys/class/infiniband lists none)"
	}
	return best, ""
}

// Pairs decides every pairing of device memory (GPUs and p2pmem providers)
// with a PCI RDMA NIC, for diagnostics. It is empty when there is no device
// memory or no such NIC.
func (t *Topology) Pairs() []Decision {
	var devices []string
	for _, g := range t.GPUs {
		devices = append(devices, g.Address)
	}
	for _, p := range t.P2PMem {
		devices = append(devices, p.PCIAddress)
	}
	var out []Decision
	for _, dev := range devices {
		for _, n := range t.RDMA {
			if n.PCIAddress != "" {
				d := t.Decide(dev, n.Name)
				d.NIC = n.Name
				out = append(out, d)
			}
		}
	}
	return out
}
