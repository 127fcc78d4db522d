// Package gpudirect handles tensors in device memory: it finds out whether
// an RDMA NIC can read and write that memory directly (GPUDirect RDMA, PCI
// peer-to-peer memory), decides per transfer whether to go direct or to
// stage through pinned host memory, and provides the device-memory
// allocators the rpc layer moves tensors from and into.
//
// # Basics
//
// Discover reads sysfs (the root is injectable with WithRoot, which is how
// the tests run on fixture trees) into a Topology: PCI devices with their
// NUMA nodes, driver and place in the PCIe tree (from the real path behind
// /sys/bus/pci/devices/<address>), GPUs (PCI class 0x0300 or 0x0302;
// NVIDIA's, vendor 0x10de, can use CUDA), RDMA devices and their PCI
// functions (/sys/class/infiniband/<dev>/device), p2pmem providers
// (/sys/bus/pci/devices/<address>/p2pmem: size, available, published), and
// whether nvidia_peermem (or nv_peer_mem, or the memory_peers nv_mem
// client) is loaded. Whether the ibv provider can register DMA-BUFs is an
// input (WithDMABuf), since only the provider can find out. Capabilities
// summarizes all this, one line per ingredient, each saying why not when it
// is missing.
//
// Topology.Route measures the PCIe route between two functions as the
// kernel's p2pdma code does (hops up from each end to the lowest common
// upstream bridge: 4 for two devices on one switch) and classes it as NCCL
// does: PIX (at most one switch), PXB (several switches, below the root
// complex), PHB (through the host bridge: different root ports, different
// root complexes of one NUMA node, or ACS redirecting peer traffic upward)
// and SYS (across NUMA nodes). The policy allows PIX and PXB, PHB only with
// WithHostBridgeP2P(true), and never SYS.
//
// Plan(buf, provider, topo) is what the rpc layer calls per transfer. It
// returns a Decision: Direct, with the mechanism (p2pmem, nvidia-peermem or
// dma-buf), the NIC and the route; or Staged; and always a Reason a person
// can read, e.g. "0000:03:00.0 and mlx5_0 (0000:04:00.0) meet at bridge
// 0000:01:00.0, at most one PCIe switch (PIX, distance 4): direct via
// nvidia-peermem". Topology.Decide does the same for a device by PCI
// address, and Pairs for every pairing of device memory and NIC.
//
// Device memory is a DeviceBuffer from an Allocator:
//
//   - NewHostAllocator: host memory posing as a device ("host-fake:0"),
//     never Direct, with counted copies; it stands in for a GPU in tests.
//   - NewP2PAllocator: buffers carved from one mapping of a provider's
//     p2pmem/allocate file (Topology.MapP2PMem). RegisterP2PMem registers
//     such an arena with a protection domain after checking that the NIC may
//     reach it directly, and refuses with the reason otherwise.
//     Topology.FindP2PMem picks the provider closest to a set of clients,
//     as pci_p2pmem_find_many does.
//   - LoadCUDA and CUDA.NewAllocator: buffers carved from one cuMemAlloc
//     arena on a GPU, reached through dlopen of libcuda.so.1 (cgo, no CUDA
//     headers). Without a driver, LoadCUDA fails with "libcuda.so.1 not
//     found: no NVIDIA driver on this host; using host staging"; built
//     without cgo it says so. Where the driver has streams, events,
//     cuMemHostRegister and IPC handles (every driver since CUDA 11), its
//     buffers are AsyncBuffers (NewStream: copies ordered on a stream,
//     completed by events; HostRegistrar: pinning host memory) and
//     IPCExporters (IPCHandle, which names the allocation's base with the
//     buffer's offset); CUDA.OpenIPC maps another process's, CUDA.Wrap
//     describes device memory a caller owns (a PyTorch tensor's).
//
// The CUDA tests run against an emulator of the driver
// (testdata/fakecuda, loaded by package cudatest), which models what the
// real driver does that a missing synchronisation or a forgotten IPC
// offset would trip over: asynchronous copies on worker threads (delayed
// by FAKECUDA_COPY_DELAY_US), synchronous copies of pageable memory, IPC
// handles that name an allocation's base and open only in another
// process, the registration errors, and a failure switch (FAKECUDA_FAIL).
// With TENSORRPC_TEST_CUDA=real the same tests run on a GPU
// (scripts/device-check.sh, docs/DEVICE.md).
//
// Each allocator maps or allocates its arena once; register it once (its
// Arena method) and address buffers inside it, rather than registering per
// tensor. Staged transfers use StageOut (device to a pinned mempool buffer)
// and StageIn (host bytes to the device): one copy more per side than a
// direct transfer, which makes none.
//
// # Caveats
//
// None of this has run on real GPUs, GPUDirect-capable NICs or p2pmem
// hardware: our machines have none. Discovery and decisions are tested on
// fixture sysfs trees (testdata/sysfs); the CUDA binding is tested against
// a fake libcuda over host memory (testdata/fakecuda), which checks the
// calling protocol but says nothing about a real driver; mapping p2pmem is
// tested on a regular file. No performance figure exists for any direct
// path.
//
// The Direct memory of a CUDA buffer is GPU memory: its Bytes hold device
// addresses for registration by address, and the CPU must never touch
// them. Hand it only to the ibv provider, and only when Plan said Direct.
// For a DMA-BUF, verbs.Memory's HasFD, FD and FDOffset name the DMA-BUF
// and DMABuf is set: the ibv provider then registers it with
// ibv_reg_dmabuf_mr (the tcp and shm providers refuse it). That call has
// compiled against rdma-core 44 but has not run on hardware. nvidia_peermem
// works with plain ibv_reg_mr.
//
// A p2pmem arena's memory is readable by the CPU, but every access crosses
// PCIe, so CopyToHost and CopyFromHost are slow. Its verbs.Memory has no
// file descriptor (mapping the allocate file again would allocate other
// memory), so the shm provider refuses it.
//
// ACS is read from each function's config space, which takes root beyond
// the first 64 bytes; without it, redirection goes unseen and a route may be
// classed PIX or PXB although its traffic goes through the root complex.
// The kernel's host bridge whitelist for P2P through the root complex is
// not consulted: allowing PHB is the policy's call. When both NUMA nodes of
// a route across root complexes are unknown, it counts as SYS.
//
// FindP2PMem breaks distance ties by available memory, then PCI address;
// the kernel picks at random among them.
//
// CUDA arenas use the device's primary context, the one the CUDA runtime
// (and so PyTorch) uses; each call makes it current and restores the
// calling thread's previous context. StageOut and StageIn copy
// synchronously (a DeviceBuffer's CopyToHost/CopyFromHost); memory that is
// not registered with the driver it treats as pageable and stages once
// more internally. For an AsyncBuffer, a Pinner registers a pool's arenas
// with the device's HostRegistrar through the pool's hooks, and
// StageOutAsync, StageInAsync, StageOutPipelined and StageInPipelined copy
// asynchronously on a stream of the transfer's own, the pipelined ones a
// chunk at a time through a ring of pool slots (DefaultStageChunk,
// DefaultStageSlots). libcuda is never unloaded.
package gpudirect
