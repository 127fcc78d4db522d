package gpudirect

import (
	"fmt"
	"slices"
)

// Class is the kind of PCIe route between two devices, after NCCL's path
// types.
type Class int

const (
	// ClassUnknown: a device's place in the PCIe tree is unknown.
	ClassUnknown Class = iota
	// ClassPIX: the devices meet at most one PCIe switch below the root
	// port (kernel distance 4 or less: the same switch, the same root port,
	// or functions of one device).
	ClassPIX
	// ClassPXB: the devices meet below the root complex, but through more
	// than one switch (nested switches).
	ClassPXB
	// ClassPHB: the route goes through the host bridge: different root
	// ports of one root complex, different root complexes of one NUMA
	// node, or a bridge on the way redirects peer traffic upward (ACS).
	ClassPHB
	// ClassSYS: the route crosses the interconnect between NUMA nodes
	// (or between root complexes whose NUMA nodes are unknown).
	ClassSYS
)

// String returns "PIX", "PXB", "PHB", "SYS" or "unknown".
func (c Class) String() string {
	switch c {
	case ClassPIX:
		return "PIX"
	case ClassPXB:
		return "PXB"
	case ClassPHB:
		return "PHB"
	case ClassSYS:
		return "SYS"
	}
	return "unknown"
}

// Route is the PCIe route between two PCI functions.
type Route struct {
	From, To string // PCI addresses
	Class    Class
	// Distance counts the hops up from each end to where the routes meet,
	// as the kernel's p2pdma code does: 0 for the same function, 2 for two
	// functions of one device, 4 for two devices on one switch. When the
	// routes meet only at the host bridge, it counts each end's hops to its
	// root bus. It is -1 when the class is unknown.
	Distance int
	// Bridge is the lowest common upstream bridge; "" when the route goes
	// through the host bridge.
	Bridge string
	// ACSRedirect names the first function on the route whose ACS settings
	// redirect peer traffic to the root complex; "" when none was seen
	// (or config space was unreadable).
	ACSRedirect string
	// Detail describes the route in a sentence fragment.
	Detail string
}

// Route returns the PCIe route between the functions at PCI addresses a and
// b. It fails when either is not in the topology.
func (t *Topology) Route(a, b string) (Route, error) {
	da, ok := t.PCI[a]
	if !ok {
		return Route{}, fmt.Errorf("gpudirect: no PCI device %s under %s", a, t.Root)
	}
	db, ok := t.PCI[b]
	if !ok {
		return Route{}, fmt.Errorf("gpudirect: no PCI device %s under %s", b, t.Root)
	}
	r := Route{From: a, To: b, Distance: -1}
	if da.HostBridge == "" || db.HostBridge == "" {
		r.Detail = "the place of " + a + " or " + b + " in the PCIe tree is unknown"
		return r, nil
	}
	chainA := append([]string{a}, da.Upstream...)
	chainB := append([]string{b}, db.Upstream...)
	if da.HostBridge == db.HostBridge {
		for i, x := range chainA {
			if j := slices.Index(chainB, x); j >= 0 {
				r.Distance, r.Bridge = i+j, x
				break
			}
		}
	}
	if r.Bridge != "" {
		// As pci_p2pdma's calc_map_type_and_dist: every function on the
		// route, the meeting bridge included, may redirect.
		onRoute := append(slices.Clone(chainA[:slices.Index(chainA, r.Bridge)+1]), chainB[:slices.Index(chainB, r.Bridge)]...)
		for _, x := range onRoute {
			if t.PCI[x] != nil && t.PCI[x].ACSRedirect {
				r.ACSRedirect = x
				break
			}
		}
		switch {
		case r.ACSRedirect != "":
			r.Class = ClassPHB
			r.Detail = fmt.Sprintf("meet at bridge %s (distance %d), but ACS on %s redirects peer traffic through the root complex %s (PHB)",
				r.Bridge, r.Distance, r.ACSRedirect, da.HostBridge)
		case r.Distance <= 4:
			r.Class = ClassPIX
			r.Detail = fmt.Sprintf("meet at bridge %s, at most one PCIe switch (PIX, distance %d)", r.Bridge, r.Distance)
		default:
			r.Class = ClassPXB
			r.Detail = fmt.Sprintf("meet at bridge %s through several PCIe switches, below the root complex (PXB, distance %d)", r.Bridge, r.Distance)
		}
		return r, nil
	}
	r.Distance = len(chainA) + len(chainB)
	switch {
	case da.HostBridge == db.HostBridge:
		r.Class = ClassPHB
		r.Detail = fmt.Sprintf("meet only at the host bridge %s (PHB, distance %d)", da.HostBridge, r.Distance)
	case da.NUMANode >= 0 && da.NUMANode == db.NUMANode:
		r.Class = ClassPHB
		r.Detail = fmt.Sprintf("hang from root complexes %s and %s of NUMA node %d (PHB, distance %d)", da.HostBridge, db.HostBridge, da.NUMANode, r.Distance)
	case da.NUMANode >= 0 && db.NUMANode >= 0:
		r.Class = ClassSYS
		r.Detail = fmt.Sprintf("are on NUMA nodes %d (%s) and %d (%s): the route crosses the CPU interconnect (SYS, distance %d)",
			da.NUMANode, da.HostBridge, db.NUMANode, db.HostBridge, r.Distance)
	default:
		r.Class = ClassSYS
		r.Detail = fmt.Sprintf("hang from root complexes %s and %s whose NUMA nodes are unknown, counted as crossing the CPU interconnect (SYS, distance %d)",
			da.HostBridge, db.HostBridge, r.Distance)
	}
	return r, nil
}

// allowed reports whether the policy lets peer-to-peer traffic take a route
// of class c.
func (t *Topology) allowed(c Class) bool {
	switch c {
	case ClassPIX, ClassPXB:
		return true
	case ClassPHB:
		return t.hostBridgeP2P
	}
	return false
}
