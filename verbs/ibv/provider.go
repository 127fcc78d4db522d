//go:build linux && cgo && rdma

package ibv

/*
#cgo LDFLAGS: -libverbs
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// New returns the ibv provider: RDMA NICs through libibverbs.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return &provider{opts: o}
}

type provider struct{ opts options }

func (p *provider) Name() string { return "ibv" }

// withDeviceList calls fn with the devices libibverbs lists, or returns an
// error that says why there are none.
func (p *provider) withDeviceList(fn func([]*C.struct_ibv_device) error) error {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return explainNoDevices(p.opts.sysfs, err)
	}
	defer C.ibv_free_device_list(list)
	if n <= 0 {
		return explainNoDevices(p.opts.sysfs, nil)
	}
	// The list is a C array of n device pointers owned by libibverbs until
	// ibv_free_device_list.
	return fn(unsafe.Slice(list, int(n)))
}

func (p *provider) Devices() ([]verbs.Device, error) {
	var out []verbs.Device
	err := p.withDeviceList(func(devs []*C.struct_ibv_device) error {
		for _, dev := range devs {
			name := C.GoString(C.ibv_get_device_name(dev))
			out = append(out, verbs.Device{Provider: "ibv", Name: name, Description: p.describe(dev, name)})
		}
		return nil
	})
	return out, err
}

// describe opens the device briefly to report its port.
func (p *provider) describe(dev *C.struct_ibv_device, name string) string {
	ctx, err := C.ibv_open_device(dev)
	if ctx == nil {
		return fmt.Sprintf("cannot open: %v", err)
	}
	defer C.ibv_close_device(ctx)
	var port C.trpc_port
	if rc := C.trpc_query_port(ctx, C.uint8_t(p.opts.port), &port); rc != 0 {
		return fmt.Sprintf("port %d: %v", p.opts.port, syscall.Errno(rc))
	}
	desc := fmt.Sprintf("port %d %s, %s, active MTU %d", p.opts.port,
		C.GoString(C.ibv_port_state_str(C.enum_ibv_port_state(port.state))), linkLayerName(port.link_layer), mtuBytes(uint8(port.active_mtu)))
	if port.link_layer == C.IBV_LINK_LAYER_ETHERNET {
		desc += ", " + p.gidChoice(name).reason
	} else {
		desc += fmt.Sprintf(", LID %d", port.lid)
	}
	return desc
}

func (p *provider) gidChoice(dev string) gidChoice {
	if p.opts.gidIndex >= 0 {
		return gidChoice{p.opts.gidIndex, fmt.Sprintf("GID index %d (configured)", p.opts.gidIndex)}
	}
	return selectGID(p.opts.sysfs, dev, p.opts.port)
}

func linkLayerName(ll C.uint32_t) string {
	if ll == C.IBV_LINK_LAYER_ETHERNET {
		return "Ethernet (RoCE)"
	}
	return "InfiniBand"
}

func (p *provider) Open(name string) (verbs.ProtectionDomain, error) {
	if name == "" {
		name = p.opts.device
	}
	var ctx *C.struct_ibv_context
	err := p.withDeviceList(func(devs []*C.struct_ibv_device) error {
		var names []string
		for _, dev := range devs {
			n := C.GoString(C.ibv_get_device_name(dev))
			if name != "" && n != name {
				names = append(names, n)
				continue
			}
			c, err := C.ibv_open_device(dev)
			if c == nil {
				return fmt.Errorf("ibv: open %s: %v", n, err)
			}
			ctx, name = c, n
			return nil
		}
		return noDevice("no RDMA device named %q (devices: %v)", name, names)
	})
	if err != nil {
		return nil, err
	}
	d, err := p.newDomain(ctx, name)
	if err != nil {
		C.ibv_close_device(ctx)
		return nil, err
	}
	return d, nil
}

// newDomain queries the device and port, picks the source GID and allocates
// the protection domain. It does not close ctx on failure.
func (p *provider) newDomain(ctx *C.struct_ibv_context, name string) (*domain, error) {
	d := &domain{
		opts: p.opts,
		name: name,
		ctx:  ctx,
		mrs:  map[*memoryRegion]struct{}{},
		cqs:  map[*completionQueue]struct{}{},
		qps:  map[*queuePair]struct{}{},
	}
	var dev C.trpc_device
	if rc := C.trpc_query_device(ctx, &dev); rc != 0 {
		return nil, fmt.Errorf("ibv: %s: query device: %v", name, errnoError(rc))
	}
	if int(p.opts.port) < 1 || int(p.opts.port) > int(dev.phys_port_cnt) {
		return nil, noDevice("%s has %d ports, no port %d", name, dev.phys_port_cnt, p.opts.port)
	}
	d.maxCQE = int(dev.max_cqe)
	d.maxMRSize = uint64(dev.max_mr_size)
	limits := deviceLimits{
		capFlags:        uint64(dev.cap_flags),
		maxMW:           int(dev.max_mw),
		maxQPWR:         int(dev.max_qp_wr),
		maxSGE:          int(dev.max_sge),
		maxSGERd:        int(dev.max_sge_rd),
		maxQPRdAtom:     int(dev.max_qp_rd_atom),
		maxQPInitRdAtom: int(dev.max_qp_init_rd_atom),
	}
	d.responders, d.initiators = limits.readDepths()

	var port C.trpc_port
	if rc := C.trpc_query_port(ctx, C.uint8_t(p.opts.port), &port); rc != 0 {
		return nil, fmt.Errorf("ibv: %s: query port %d: %v", name, p.opts.port, syscall.Errno(rc))
	}
	if port.state != C.IBV_PORT_ACTIVE {
		return nil, noDevice("%s port %d is %s, not ACTIVE (link down or no subnet manager)",
			name, p.opts.port, C.GoString(C.ibv_port_state_str(C.enum_ibv_port_state(port.state))))
	}
	d.mtu = uint8(port.active_mtu)
	if p.opts.mtu > 0 {
		d.mtu = min(d.mtu, mtuCode(p.opts.mtu))
	}

	choice := gidChoice{index: max(p.opts.gidIndex, 0)}
	d.linkLayer = linkInfini
	if port.link_layer == C.IBV_LINK_LAYER_ETHERNET {
		d.linkLayer = linkEthernet
		choice = p.gidChoice(name)
	}
	if choice.index >= int(port.gid_tbl_len) {
		return nil, fmt.Errorf("ibv: %s port %d: %s beyond the GID table of %d entries",
			name, p.opts.port, choice.reason, port.gid_tbl_len)
	}
	d.gidIndex = choice.index
	var gid [16]C.uint8_t
	if rc := C.trpc_query_gid(ctx, C.uint8_t(p.opts.port), C.int(choice.index), &gid[0]); rc != 0 {
		return nil, fmt.Errorf("ibv: %s port %d: query GID %d: %v", name, p.opts.port, choice.index, syscall.Errno(rc))
	}
	for i := range gid {
		d.gid[i] = byte(gid[i])
	}
	d.lid = uint16(port.lid)
	switch {
	case d.linkLayer == linkEthernet && d.gid == [16]byte{}:
		return nil, noDevice("%s port %d: %s is empty (no IP address on the netdev?)", name, p.opts.port, choice.reason)
	case d.linkLayer == linkInfini && d.lid == 0:
		return nil, noDevice("%s port %d has no LID (no subnet manager?)", name, p.opts.port)
	}

	limits.maxMsgSize = uint32(port.max_msg_sz)

	pd, err := C.ibv_alloc_pd(ctx)
	if pd == nil {
		return nil, fmt.Errorf("ibv: %s: allocate protection domain: %v", name, err)
	}
	// Learn what a queue pair really gets: devices report max_sge for the
	// largest work queue entry, and may refuse (or round up) inline data.
	var caps C.trpc_qp_caps
	sge := limits.probeSGE()
	rc := C.trpc_probe_qp(ctx, pd, C.uint32_t(sge), C.uint32_t(p.opts.maxInline), &caps)
	if rc != 0 && p.opts.maxInline > 0 {
		caps = C.trpc_qp_caps{}
		rc = C.trpc_probe_qp(ctx, pd, C.uint32_t(sge), 0, &caps)
	}
	if rc != 0 && sge > minSegments {
		sge = minSegments
		caps = C.trpc_qp_caps{}
		rc = C.trpc_probe_qp(ctx, pd, C.uint32_t(sge), 0, &caps)
	}
	if rc != 0 {
		C.ibv_dealloc_pd(pd)
		return nil, fmt.Errorf("ibv: %s: create a probe RC queue pair with %d scatter/gather elements: %v", name, sge, errnoError(rc))
	}
	limits.probeSendSGE = min(int(caps.max_send_sge), sge)
	limits.probeRecvSGE = min(int(caps.max_recv_sge), sge)
	limits.probeInline = int(caps.max_inline_data)
	d.limits = limits
	d.attrs = attributesFrom(limits, p.opts.maxInline)
	if d.attrs.MaxSegments < minSegments {
		C.ibv_dealloc_pd(pd)
		return nil, fmt.Errorf("ibv: %s: queue pairs get %d scatter/gather elements, fewer than the %d the verbs contract promises", name, d.attrs.MaxSegments, minSegments)
	}
	d.pd = pd
	return d, nil
}

// The capability bits attrs.go names must be the installed header's.
var (
	_ [C.IBV_DEVICE_MEM_WINDOW_TYPE_2A - capMemWindowType2A]struct{}
	_ [capMemWindowType2A - C.IBV_DEVICE_MEM_WINDOW_TYPE_2A]struct{}
	_ [C.IBV_DEVICE_MEM_WINDOW_TYPE_2B - capMemWindowType2B]struct{}
	_ [capMemWindowType2B - C.IBV_DEVICE_MEM_WINDOW_TYPE_2B]struct{}
	_ [C.IBV_DEVICE_MEM_WINDOW - capMemWindow]struct{}
	_ [capMemWindow - C.IBV_DEVICE_MEM_WINDOW]struct{}
)

// Attributes returns what Open learned of the device (see attributesFrom).
func (d *domain) Attributes() verbs.Attributes { return d.attrs }

// windows reports whether grants are memory windows.
func (d *domain) windows() bool { return d.attrs.Grants == verbs.GrantWindow }

// domain is a protection domain on one opened device. The device context
// belongs to the domain: each Open opens the device anew.
type domain struct {
	opts       options
	name       string
	linkLayer  uint8
	lid        uint16
	gidIndex   int
	gid        [16]byte
	mtu        uint8 // IBV_MTU_* code this side accepts
	maxCQE     int
	maxMRSize  uint64
	responders uint8 // RDMA Reads this side serves at once (max_dest_rd_atomic)
	initiators uint8 // RDMA Reads this side issues at once (max_rd_atomic)
	limits     deviceLimits
	attrs      verbs.Attributes

	// byQPN finds a queue pair from the qp_num of a completion.
	byQPN sync.Map // uint32 → *queuePair

	mu     sync.Mutex // guards the fields below
	closed bool
	ctx    *C.struct_ibv_context
	pd     *C.struct_ibv_pd
	mrs    map[*memoryRegion]struct{}
	cqs    map[*completionQueue]struct{}
	qps    map[*queuePair]struct{}
	// windowPool holds invalidated type 2 memory windows for later grants.
	windowPool []window
}

func (d *domain) Provider() string { return "ibv" }

// Close destroys what is left, in the order libibverbs requires: queue
// pairs, completion queues (with their channels), memory regions, the
// protection domain, the device context.
func (d *domain) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	qps, cqs, mrs := keys(d.qps), keys(d.cqs), keys(d.mrs)
	d.mu.Unlock()

	var errs []error
	for _, qp := range qps {
		errs = append(errs, qp.Close(), qp.destroy())
	}
	for _, cq := range cqs {
		errs = append(errs, cq.Close(), cq.release())
	}
	for _, mr := range mrs {
		// Deregister revokes the region's grants first.
		if err := mr.Deregister(); err != nil {
			errs = append(errs, err)
		}
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	for _, w := range d.windowPool {
		if rc := C.trpc_dealloc_mw(w.mw); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv: %s: deallocate memory window: %v", d.name, errnoError(rc)))
		}
	}
	d.windowPool = nil
	if rc := C.ibv_dealloc_pd(d.pd); rc != 0 {
		errs = append(errs, fmt.Errorf("ibv: %s: deallocate protection domain: %v", d.name, syscall.Errno(rc)))
	}
	if rc := C.ibv_close_device(d.ctx); rc != 0 {
		errs = append(errs, fmt.Errorf("ibv: %s: close device: %v", d.name, syscall.Errno(rc)))
	}
	d.pd, d.ctx = nil, nil
	return errors.Join(errs...)
}

func keys[K comparable](m map[K]struct{}) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func untrack[K comparable](d *domain, m map[K]struct{}, k K) {
	d.mu.Lock()
	delete(m, k)
	d.mu.Unlock()
}

// errnoError turns the errno value a libibverbs call returned into an error.
func errnoError(rc C.int) error {
	if rc < 0 {
		rc = -rc
	}
	return syscall.Errno(rc)
}
