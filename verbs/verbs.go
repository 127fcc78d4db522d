// Package verbs expresses every tensorrpc data plane as one-sided RDMA
// semantics: protection domains, registered memory regions with remote keys,
// reliable connected queue pairs, work requests (Send, Recv, Write, WriteImm,
// Read) and completion queues.
//
// The tensor protocols in package rpc are written once against these
// interfaces and run unchanged on every provider:
//
//   - ibv: libibverbs through cgo (build tag rdma), real RDMA NICs;
//   - shm: the same host, memfd regions shared over a unix socket;
//   - tcp: any host, a software reliable-connected queue pair over TCP.
//
// Each provider lives in its own sub-package and implements Provider.
package verbs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
)

// Provider is one data-plane implementation. It is safe for concurrent use.
type Provider interface {
	// Name is the provider's short name: "ibv", "shm" or "tcp".
	Name() string
	// Devices lists the devices the provider can open on this host. When
	// there are none it returns an error that says why (no driver, no
	// device, not supported on this platform).
	Devices() ([]Device, error)
	// Open opens a device by name (or the first device when name is "")
	// and returns a protection domain on it.
	Open(name string) (ProtectionDomain, error)
}

// Device describes one device of a provider.
type Device struct {
	Provider string // the provider's name
	Name     string // e.g. "mlx5_0", "tcp", "shm"
	// Description is free text for diagnostics: link layer, port state,
	// listen address, host identity.
	Description string
}

// Access is the set of rights a memory region grants.
type Access uint32

const (
	// AccessLocalWrite lets local Recv and Read completions write the region.
	AccessLocalWrite Access = 1 << iota
	// AccessRemoteWrite lets the peer Write and WriteImm into the region.
	AccessRemoteWrite
	// AccessRemoteRead lets the peer Read from the region.
	AccessRemoteRead
)

// String lists the rights, e.g. "local-write|remote-read".
func (a Access) String() string {
	if a == 0 {
		return "none"
	}
	var s string
	add := func(bit Access, name string) {
		if a&bit != 0 {
			if s != "" {
				s += "|"
			}
			s += name
		}
	}
	add(AccessLocalWrite, "local-write")
	add(AccessRemoteWrite, "remote-write")
	add(AccessRemoteRead, "remote-read")
	if rest := a &^ (AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead); rest != 0 {
		if s != "" {
			s += "|"
		}
		s += fmt.Sprintf("0x%x", uint32(rest))
	}
	return s
}

// Memory is memory to register. Bytes is the memory itself. When the memory
// is backed by a file (a memfd arena), HasFD is true and FD and FDOffset say
// where Bytes starts in that file; the shm provider needs this to share the
// region with its peer and refuses memory without it. Registration does not
// take ownership of FD; it must stay open until the region is deregistered.
//
// DMABuf marks FD as a DMA-BUF of device memory (GPU memory exported for
// RDMA): Bytes then holds device addresses the CPU must never touch, only
// ibv registers it (with ibv_reg_dmabuf_mr), and the software providers
// refuse it.
type Memory struct {
	Bytes    []byte
	HasFD    bool
	FD       int
	FDOffset int64
	DMABuf   bool
}

// ProtectionDomain owns memory regions, completion queues and queue pairs on
// one opened device. Queue pairs may only use regions of their own domain.
// It is safe for concurrent use.
type ProtectionDomain interface {
	// Provider returns the name of the provider that opened the domain.
	Provider() string
	// RegisterMemory registers m with the given rights. The memory must stay
	// valid and must not move until the region is deregistered.
	RegisterMemory(m Memory, access Access) (MemoryRegion, error)
	// NewCompletionQueue makes a completion queue that holds up to capacity
	// completions.
	NewCompletionQueue(capacity int) (CompletionQueue, error)
	// NewQueuePair makes an unconnected reliable-connected queue pair.
	NewQueuePair(cfg QueuePairConfig) (QueuePair, error)
	// Close releases the domain. Regions, queue pairs and completion queues
	// should be closed first; Close closes any that are left.
	Close() error
}

// MemoryRegion is registered memory. Peers name it by RemoteKey and an
// address in [Addr, Addr+Len).
type MemoryRegion interface {
	// Addr is the address peers use for the first byte of the region.
	Addr() uint64
	// Len is the region's length in bytes.
	Len() int
	// Bytes is the registered memory.
	Bytes() []byte
	// LocalKey names the region in local work requests.
	LocalKey() uint32
	// RemoteKey names the region in a peer's Write, WriteImm and Read.
	RemoteKey() uint32
	// Access is the set of rights the region grants.
	Access() Access
	// Deregister removes the registration. Later remote accesses with its
	// key fail with StatusRemoteAccess.
	Deregister() error
}

// QueuePairConfig configures a new queue pair.
type QueuePairConfig struct {
	// SendCQ receives completions of PostSend work requests; RecvCQ those of
	// PostRecv (received Sends and WriteImms). They may be the same queue.
	SendCQ, RecvCQ CompletionQueue
	// MaxSend and MaxRecv bound the outstanding work requests of each
	// queue; posting beyond them fails with ErrQueueFull. Zero means 1024.
	MaxSend, MaxRecv int
	// MaxInline is the largest Send or Write payload the provider may copy
	// into the work request itself; zero means the provider's default.
	MaxInline int
	// LocalAddress is this host's address on the control connection the
	// queue pair belongs to; package rpc passes the local address of the
	// gRPC connection. A socket-based provider (tcp) listens on this
	// address for the queue pair's data connection and advertises it in
	// LocalInfo, unless the provider was configured with an explicit listen
	// or advertise address or with a network interface, which take
	// precedence. The zero value means the provider's default, which is
	// 127.0.0.1 for tcp. Providers that do not use sockets for data (shm,
	// ibv) ignore it.
	LocalAddress netip.Addr
	// Role says which side of the connection opens the data connection.
	// The zero value, RoleAny, leaves it to the provider. The tcp provider
	// honours it; shm, whose data connection is a unix socket on the same
	// host, and ibv, which has no data connection of its own, ignore it.
	Role ConnectRole
}

// ConnectRole says whether a queue pair opens its data connection to the
// peer, accepts it from the peer, or leaves the choice to the provider. It
// lets the caller decide who dials, for example so that a server never
// dials an address named by a client.
type ConnectRole uint8

const (
	// RoleAny leaves the choice to the provider (tcp: of two RoleAny queue
	// pairs, the one with the smaller secret dials). A RoleAny queue pair
	// dials a RoleAccept peer and accepts from a RoleDial peer.
	RoleAny ConnectRole = iota
	// RoleDial makes the queue pair open the data connection to the peer;
	// it never listens for one, and its LocalInfo carries no address.
	RoleDial
	// RoleAccept makes the queue pair only accept the data connection; it
	// never dials an address taken from the peer's connection info.
	RoleAccept
)

// String returns "any", "dial" or "accept".
func (r ConnectRole) String() string {
	switch r {
	case RoleAny:
		return "any"
	case RoleDial:
		return "dial"
	case RoleAccept:
		return "accept"
	}
	return fmt.Sprintf("ConnectRole(%d)", uint8(r))
}

// QueuePair is a reliable connected queue pair. Work requests on one queue
// pair execute in order: the data of Writes posted before a WriteImm or
// Send is in place at the target when that WriteImm or Send completes there.
// It is safe for concurrent use.
type QueuePair interface {
	// LocalInfo is this queue pair's connection information, to be carried
	// to the peer over the control plane and passed to its Connect. It holds
	// a one-time secret: a provider accepts a data connection only from the
	// peer that presents it, which binds the data plane to the control-plane
	// session that carried the info.
	LocalInfo() []byte
	// Connect connects to the peer whose LocalInfo is remote; the peer
	// calls Connect with this side's LocalInfo at about the same time.
	// It moves the queue pair through INIT and RTR to RTS. A provider that
	// honours QueuePairConfig.Role fails with an error wrapping
	// ErrInvalidInfo when both sides are RoleDial or both RoleAccept.
	Connect(ctx context.Context, remote []byte) error
	// PostSend posts Send, Write, WriteImm and Read work requests, in order.
	// An error means none of the requests from the failing one on were
	// posted (no completion will come for them).
	PostSend(wrs ...SendRequest) error
	// PostRecv posts receive buffers for incoming Sends and WriteImms.
	PostRecv(wrs ...RecvRequest) error
	// State is the queue pair's state.
	State() QPState
	// Close moves the queue pair to the error state, completes all
	// outstanding work requests with StatusFlushed and releases it.
	Close() error
}

// RemoteMapper is implemented by queue pairs whose peer's registered
// memory is mapped into this process (shm). It lets a consumer use a
// peer's tensor in place, with no copy.
type RemoteMapper interface {
	// MapRemote returns length bytes of the peer's memory at remote, after
	// checking the key, the bounds and the remote-read right as a Read
	// would. The bytes are the peer's memory: they change when the peer
	// writes them, must not be written, and stay valid until the queue
	// pair is closed.
	MapRemote(remote Remote, length int) ([]byte, error)
}

// QPState is the state of a queue pair, as in the InfiniBand specification.
type QPState int

const (
	QPReset QPState = iota
	QPInit
	QPReadyToReceive
	QPReadyToSend
	QPError
)

func (s QPState) String() string {
	switch s {
	case QPReset:
		return "RESET"
	case QPInit:
		return "INIT"
	case QPReadyToReceive:
		return "RTR"
	case QPReadyToSend:
		return "RTS"
	case QPError:
		return "ERR"
	}
	return fmt.Sprintf("QPState(%d)", int(s))
}

// Opcode is the operation of a work request or completion.
type Opcode uint8

const (
	OpSend     Opcode = iota + 1 // two-sided: consumes a Recv at the target
	OpWrite                      // one-sided write into a remote region
	OpWriteImm                   // write, then consumes a Recv at the target with an immediate value
	OpRead                       // one-sided read from a remote region
	OpRecv                       // completion of a Recv that received a Send
	OpRecvImm                    // completion of a Recv consumed by a WriteImm
)

func (o Opcode) String() string {
	switch o {
	case OpSend:
		return "SEND"
	case OpWrite:
		return "WRITE"
	case OpWriteImm:
		return "WRITE_IMM"
	case OpRead:
		return "READ"
	case OpRecv:
		return "RECV"
	case OpRecvImm:
		return "RECV_RDMA_WITH_IMM"
	}
	return fmt.Sprintf("Opcode(%d)", uint8(o))
}

// Local names local registered memory: Length bytes at Offset in Region.
type Local struct {
	Region MemoryRegion
	Offset int
	Length int
}

// Remote names peer memory: an address inside a peer's region and its key.
type Remote struct {
	Addr uint64
	Key  uint32
}

// SendRequest is a work request for PostSend.
type SendRequest struct {
	ID uint64 // returned in the completion
	Op Opcode // OpSend, OpWrite, OpWriteImm or OpRead
	// Local is the source of Send, Write and WriteImm and the destination
	// of Read. A zero Length is allowed.
	Local Local
	// Remote is the target of Write and WriteImm and the source of Read.
	Remote Remote
	// Imm is the immediate value of WriteImm (and of Send when HasImm).
	Imm    uint32
	HasImm bool
}

// RecvRequest is a work request for PostRecv.
type RecvRequest struct {
	ID    uint64
	Local Local // where a received Send lands; a WriteImm uses no bytes of it
}

// Status is the outcome of a work request.
type Status uint8

const (
	StatusSuccess Status = iota
	// StatusLocalLength: a received Send did not fit its Recv buffer, or a
	// local buffer lies outside its region.
	StatusLocalLength
	// StatusLocalProtection: a local buffer's region lacks the right
	// (e.g. local write for a Read destination) or belongs to another domain.
	StatusLocalProtection
	// StatusRemoteAccess: the peer refused the remote key, bounds or rights.
	StatusRemoteAccess
	// StatusRemoteInvalidRequest: the peer could not accept the request, e.g.
	// a Send larger than its Recv buffer.
	StatusRemoteInvalidRequest
	// StatusRemoteOperation: the peer failed the operation for another reason.
	StatusRemoteOperation
	// StatusReceiverNotReady: no Recv was posted at the peer in time.
	StatusReceiverNotReady
	// StatusTransport: the connection failed (peer gone, retries exceeded).
	StatusTransport
	// StatusFlushed: the queue pair was in the error state or closed before
	// the request executed.
	StatusFlushed
)

func (s Status) String() string {
	switch s {
	case StatusSuccess:
		return "success"
	case StatusLocalLength:
		return "local length error"
	case StatusLocalProtection:
		return "local protection error"
	case StatusRemoteAccess:
		return "remote access error"
	case StatusRemoteInvalidRequest:
		return "remote invalid request"
	case StatusRemoteOperation:
		return "remote operation error"
	case StatusReceiverNotReady:
		return "receiver not ready"
	case StatusTransport:
		return "transport error"
	case StatusFlushed:
		return "flushed"
	}
	return fmt.Sprintf("Status(%d)", uint8(s))
}

// Completion reports the outcome of one work request.
type Completion struct {
	ID     uint64 // the work request's ID
	Op     Opcode // for receives: OpRecv or OpRecvImm
	Status Status
	// Len is the number of bytes received (Recv, RecvImm) or transferred.
	Len    int
	Imm    uint32
	HasImm bool
	// Err gives details of a failure; nil on success.
	Err error
}

// CompletionQueue collects completions of one or more queue pairs. It is
// safe for concurrent use.
type CompletionQueue interface {
	// Poll moves up to len(out) completions into out without blocking and
	// returns how many it moved.
	Poll(out []Completion) int
	// Wait blocks until at least one completion is available or ctx ends,
	// then behaves like Poll. It returns ctx.Err() when ctx ends first and
	// ErrClosed once the queue is closed and empty.
	Wait(ctx context.Context, out []Completion) (int, error)
	// Close releases the queue; blocked Waits return ErrClosed.
	Close() error
}

// Errors returned by posting and setup calls.
var (
	ErrClosed        = errors.New("verbs: closed")
	ErrQueueFull     = errors.New("verbs: work queue full")
	ErrNotConnected  = errors.New("verbs: queue pair not connected")
	ErrQPError       = errors.New("verbs: queue pair in error state")
	ErrInvalidInfo   = errors.New("verbs: invalid connection info")
	ErrNoDevice      = errors.New("verbs: no device")
	ErrUnsupported   = errors.New("verbs: not supported by this provider")
	ErrInvalidMemory = errors.New("verbs: invalid memory")
)

// CompletionError turns a failed completion into an error that names the
// operation and status, and wraps Err when there is one.
func CompletionError(c Completion) error {
	if c.Status == StatusSuccess {
		return nil
	}
	if c.Err != nil {
		return fmt.Errorf("verbs: %s %d: %s: %w", c.Op, c.ID, c.Status, c.Err)
	}
	return fmt.Errorf("verbs: %s %d: %s", c.Op, c.ID, c.Status)
}
