package rpc

import (
	"crypto/rand"
	"fmt"
	"strings"
	"sync"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
)

// TransportCUDAIPC names CUDA IPC in Rejections: device tensors moved
// between two processes on one host as CUDA IPC memory handles. It is no
// data plane: a session negotiates it beside its plane, and it carries
// only FetchToDevice and SendDevice.
const TransportCUDAIPC = "cuda-ipc"

// ipcDriver is what CUDA IPC needs of a device driver: the devices it
// lists, and opening another process's IPC handle. gpudirect's CUDA
// implements it (cudaDriver); the package's tests use a fake.
type ipcDriver interface {
	// DeviceUUIDs lists the UUIDs of the driver's devices.
	DeviceUUIDs() ([][16]byte, error)
	// OpenIPC maps device memory of another process of this host. The
	// buffer starts at h.Offset in the allocation h.Handle names and is
	// h.Len bytes long; its Free closes the mapping.
	OpenIPC(h gpudirect.IPCHandle) (gpudirect.DeviceBuffer, error)
}

// WithCUDA gives a Server or Client a loaded CUDA driver
// (gpudirect.LoadCUDA), which enables CUDA IPC: when both peers have one
// and run in two processes of one host (the shm plane's host identity)
// with a GPU in common, FetchToDevice and SendDevice move device tensors as CUDA IPC
// handles, device to device, and host memory is never touched.
// Otherwise they stage through host memory and Client.Rejections says
// why ("cuda-ipc"). Without this option nothing loads libcuda.
//
// On a Server, receiving device tensors (SendDevice) over CUDA IPC also
// needs WithDeviceAllocator; publishing them needs PublishDeviceInPlace.
//
// Experimental: tested against gpudirect's driver emulator; the real
// driver has not run it.
func WithCUDA(c *gpudirect.CUDA) Option {
	return sharedOption(func(o *options) {
		o.cuda = nil
		if c != nil {
			o.cuda = cudaDriver{c}
		}
	})
}

// WithDeviceAllocator gives a Server device memory of its own for the
// device tensors clients send over CUDA IPC (SendDevice): the server
// copies each into a buffer from a, device to device, and holds it in its
// rendezvous until it is replaced or unpublished, then frees it. a must
// outlive the Server; it is not closed with it.
func WithDeviceAllocator(a gpudirect.Allocator) ServerOption {
	return serverOption(func(o *options) { o.deviceAlloc = a })
}

// hostIdentity names this host for CUDA IPC, as for shm.
func (o *options) hostIdentity() (string, error) {
	if o.ipcHost != "" {
		return o.ipcHost, nil
	}
	return shm.HostIdentity()
}

// thisProcess is this process's identity for CUDA IPC (CudaOffer.process):
// 16 random bytes, drawn once.
var thisProcess = sync.OnceValue(func() string {
	var b [16]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	return string(b[:])
})

// processIdentity names this process for CUDA IPC: a server and a client
// of one process must not use it, since the driver opens no IPC handle in
// the process that exported it.
func (o *options) processIdentity() string {
	if o.ipcProcess != "" {
		return o.ipcProcess
	}
	return thisProcess()
}

// cudaOffer is the client's CudaOffer, or nil without a CUDA driver. A
// driver that cannot describe itself is a rejection.
func (o *options) cudaOffer() (*pb.CudaOffer, *Rejection) {
	if o.cuda == nil {
		return nil, nil
	}
	host, err := o.hostIdentity()
	if err != nil {
		return nil, rejectionPtr(TransportCUDAIPC, "client", "no host identity: "+err.Error())
	}
	uuids, err := o.cuda.DeviceUUIDs()
	if err != nil {
		return nil, rejectionPtr(TransportCUDAIPC, "client", "listing CUDA devices: "+err.Error())
	}
	offer := &pb.CudaOffer{Host: host, Process: []byte(o.processIdentity())}
	for _, u := range uuids {
		offer.DeviceUuids = append(offer.DeviceUuids, u[:])
	}
	return offer, nil
}

// cudaAnswer is the server's answer to a client's CudaOffer (nil: the
// client offered none) and, when CUDA IPC is on, the session's state.
func (s *Server) cudaAnswer(offer *pb.CudaOffer) (*pb.CudaAnswer, *ipcServerSession) {
	if offer == nil {
		return nil, nil
	}
	refuse := func(reason string) (*pb.CudaAnswer, *ipcServerSession) {
		return &pb.CudaAnswer{Reason: reason}, nil
	}
	if s.opts.cuda == nil {
		return refuse("the server has no CUDA driver (rpc.WithCUDA on the server enables it)")
	}
	host, err := s.opts.hostIdentity()
	if err != nil {
		return refuse("the server has no host identity: " + err.Error())
	}
	if offer.Host != host {
		return refuse("not the same host: CUDA IPC needs both processes on one host, sharing a kernel and network namespace")
	}
	if string(offer.Process) == s.opts.processIdentity() {
		return refuse("the client is in the server's own process: CUDA IPC opens handles only in another process (cuIpcOpenMemHandle refuses its own)")
	}
	mine, err := s.opts.cuda.DeviceUUIDs()
	if err != nil {
		return refuse("the server cannot list its CUDA devices: " + err.Error())
	}
	common := map[[16]byte]bool{}
	ans := &pb.CudaAnswer{}
	for _, u := range offer.DeviceUuids {
		var id [16]byte
		if len(u) != len(id) {
			continue
		}
		copy(id[:], u)
		for _, m := range mine {
			if m == id && !common[id] {
				common[id] = true
				ans.DeviceUuids = append(ans.DeviceUuids, id[:])
			}
		}
	}
	if len(common) == 0 {
		return refuse(fmt.Sprintf("no common GPU: the client lists %d CUDA devices and the server %d, none with the same UUID (CUDA_VISIBLE_DEVICES may hide them)", len(offer.DeviceUuids), len(mine)))
	}
	ans.Ipc = true
	if s.opts.deviceAlloc != nil {
		ans.Send = true
	} else {
		ans.SendReason = "the server has no device memory for tensors sent to it (rpc.WithDeviceAllocator on the server enables it)"
	}
	return ans, newIPCServerSession(common, ans.Send)
}

// cudaAccept reads the server's answer to this client's offer: the
// session's CUDA IPC state, or nil, and the rejections to report.
func (c *Client) cudaAccept(offered bool, ans *pb.CudaAnswer) (*ipcClientSession, []Rejection) {
	if !offered {
		return nil, nil
	}
	if ans == nil {
		return nil, []Rejection{newRejection(TransportCUDAIPC, "server", "the server does not speak CUDA IPC (an older tensorrpc)")}
	}
	if !ans.Ipc {
		return nil, []Rejection{newRejection(TransportCUDAIPC, "server", ans.Reason)}
	}
	var rejs []Rejection
	if !ans.Send {
		rejs = append(rejs, newRejection(TransportCUDAIPC, "server", "SendDevice stages through host memory: "+ans.SendReason))
	}
	common := map[[16]byte]bool{}
	for _, u := range ans.DeviceUuids {
		var id [16]byte
		if len(u) == len(id) {
			copy(id[:], u)
			common[id] = true
		}
	}
	return newIPCClientSession(c, common, ans.Send), rejs
}

// cudaDriver is gpudirect's CUDA as an ipcDriver.
type cudaDriver struct{ c *gpudirect.CUDA }

// DeviceUUIDs reads each CUDADevice's UUID (cuDeviceGetUuid); a driver
// that cannot say (a zero UUID) refuses CUDA IPC with that reason.
func (d cudaDriver) DeviceUUIDs() ([][16]byte, error) {
	var uuids [][16]byte
	for _, dev := range d.c.Devices() {
		if dev.UUID == ([16]byte{}) {
			return nil, fmt.Errorf("the CUDA driver gives no UUID for device %d (cuDeviceGetUuid)", dev.Ordinal)
		}
		uuids = append(uuids, dev.UUID)
	}
	return uuids, nil
}

func (d cudaDriver) OpenIPC(h gpudirect.IPCHandle) (gpudirect.DeviceBuffer, error) {
	return d.c.OpenIPC(h)
}

// uuidText is a device UUID as nvidia-smi prints it (GPU-xxxxxxxx-...).
func uuidText(u [16]byte) string {
	h := fmt.Sprintf("%x", u[:])
	return strings.Join([]string{"GPU-" + h[:8], h[8:12], h[12:16], h[16:20], h[20:]}, "-")
}
