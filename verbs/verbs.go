// See doc.go for the package documentation and the contract every provider
// follows.
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
// where Bytes starts in that file; the shm provider shares such a region
// with its peer by mapping it, and reaches memory without one only by
// cross-memory attach (verbs/shm: "Memory without a memfd"). Registration does not
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
	// Attributes says what the device supports. Code above the provider
	// reads limits here instead of assuming them.
	Attributes() Attributes
	// Close releases the domain. Regions, queue pairs and completion queues
	// should be closed first; Close closes any that are left.
	Close() error
}

// Attributes are a device's capabilities and limits, as ibv_query_device
// reports them for a NIC; the software providers report what they really
// support.
type Attributes struct {
	// MaxMessageBytes is the largest total length of one work request (the
	// sum of its segments).
	MaxMessageBytes int64
	// MaxSegments is the most local segments one work request may have
	// (at least 4 on every provider).
	MaxSegments int
	// MaxInline is the largest Send or Write payload a work request may
	// carry inline (0: no inline data).
	MaxInline int
	// MaxOutstandingReads is how many Reads one queue pair may have under
	// way as initiator; later Reads wait their turn, in order.
	MaxOutstandingReads int
	// MaxQueueDepth is the largest MaxSend or MaxRecv of a queue pair.
	MaxQueueDepth int
	// Grants says how QueuePair.Grant narrows remote access.
	Grants GrantKind
	// RecvImmKey says that OpRecvImm completions carry the key the
	// WriteImm used (Completion.Key): true on tcp and shm; NICs do not
	// report it.
	RecvImmKey bool
}

// GrantKind is how a provider implements grants.
type GrantKind uint8

const (
	// GrantSoftware: the provider checks every remote access against its
	// grants (tcp, shm).
	GrantSoftware GrantKind = iota + 1
	// GrantWindow: a type-2 memory window bound to the queue pair (ibv).
	GrantWindow
	// GrantRegistration: a registration per grant, for devices without
	// memory windows (ibv); it cannot be bound to one queue pair, so the
	// key is valid for any queue pair of the protection domain.
	GrantRegistration
)

func (k GrantKind) String() string {
	switch k {
	case GrantSoftware:
		return "software"
	case GrantWindow:
		return "memory-window"
	case GrantRegistration:
		return "registration"
	}
	return fmt.Sprintf("GrantKind(%d)", uint8(k))
}

// Grant is a narrow remote key: it opens one range of one region, with one
// right (AccessRemoteRead or AccessRemoteWrite), to the peer of one queue
// pair, until it is revoked. Any other use of its key (another queue pair,
// the other right, a byte outside the range, after Revoke) fails with
// StatusRemoteAccess and touches no memory. It is safe for concurrent use.
type Grant interface {
	// Remote names the first granted byte for the peer's work requests.
	Remote() Remote
	// Len is the number of granted bytes.
	Len() int
	// Access is the granted right.
	Access() Access
	// Revoke ends the grant: remote accesses that start after it returns
	// fail, and those under way when it was called have ended when it
	// returns, so the memory may be reused at once. A peer that keeps an
	// access going past the provider's bound fails the queue pair. It is
	// idempotent, and a call made while another runs waits for it.
	Revoke() error
}

// AsyncRevoker is implemented by grants that can be revoked without
// blocking: RevokeAsync does what Revoke does and returns at once; done
// runs once, when Revoke would have returned, in whatever goroutine
// finished the revocation (the caller's, or the provider's receiver when
// the peer had to confirm it), so it must not block. The tcp and shm
// providers' grants implement it.
type AsyncRevoker interface {
	RevokeAsync(done func())
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
	// PostSend posts Send, Write, WriteImm and Read work requests, in order,
	// all or none: every request is checked first (opcode, segments against
	// their regions and rights, limits, queue room) and an error means none
	// was posted and no completion will come for any of them. The
	// provider keeps no reference to wrs once PostSend returns (it may
	// keep the memory their segments name, until their completions).
	PostSend(wrs ...SendRequest) error
	// PostRecv posts receive buffers for incoming Sends and WriteImms,
	// all or none, as PostSend.
	PostRecv(wrs ...RecvRequest) error
	// Grant opens length bytes at offset of region (a region of this
	// queue pair's domain) to this queue pair's peer, with exactly one
	// right: AccessRemoteRead or AccessRemoteWrite. It fails with an error
	// wrapping ErrInvalidMemory for a bad range, right or region.
	Grant(region MemoryRegion, offset, length int, access Access) (Grant, error)
	// State is the queue pair's state.
	State() QPState
	// Close moves the queue pair to the error state, completes all
	// outstanding work requests with StatusFlushed and releases it.
	Close() error
}

// RemoteMapper is implemented by queue pairs whose peer's registered
// memory can be mapped into this process (shm). It lets a consumer use a
// peer's tensor in place, with no copy.
type RemoteMapper interface {
	// MapRemote maps length bytes of the peer's memory at remote, after
	// checking the key, the bounds and the remote-read right as a Read
	// would. The mapping is read-only (writing it faults) and stays valid
	// until its Release, whatever the queue pair or the peer does: closing
	// the queue pair or the peer's death never unmaps it.
	MapRemote(remote Remote, length int) (Mapping, error)
}

// Mapping is a read-only view of a peer's memory.
type Mapping interface {
	// Bytes is the peer's memory: it shows the peer's later writes (and
	// keeps the last bytes the peer wrote after the peer is gone).
	Bytes() []byte
	// Release lets go of it: the pages are unmapped once nothing shares
	// them (another Mapping, or on shm the queue pair's cached read-only
	// mapping of the peer's region, dropped when the region is
	// deregistered or the queue pair closes). Bytes must not be used
	// after. It is idempotent.
	Release() error
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
	// of Read, when Segments is empty. A zero Length is allowed.
	Local Local
	// Segments, when not empty, replace Local: the request gathers its
	// source from (or scatters a Read into) these segments, in order, up
	// to Attributes.MaxSegments of them.
	Segments []Local
	// Remote is the target of Write and WriteImm and the source of Read.
	Remote Remote
	// Imm is the immediate value of WriteImm (and of Send when HasImm).
	Imm    uint32
	HasImm bool
	// Unsignaled asks for no completion on success: the request's
	// completion comes only when it fails (flushed included). It keeps its
	// place in the send queue until a later signaled request of the queue
	// pair completes, as on a NIC.
	Unsignaled bool
	// LazyCompletion says that nothing waits for the request's completion
	// soon (it only frees what the request used). A provider that
	// acknowledges in software may then let the peer's acknowledgement wait
	// for a message going back, for a bounded time (tcp: the next frame
	// the peer sends, or after about a millisecond), saving the peer a
	// write and this side a wake-up on every request-response exchange.
	// Posted while the queue's completions are being delivered to a
	// CompletionRunner's handler (an answer posted by a handler running
	// where its request was delivered), tcp completes it as soon as its
	// bytes are written to the connection, within that delivery, and the
	// peer acknowledges nothing. Providers with hardware acknowledgements
	// ignore it.
	LazyCompletion bool
	// Fence makes the request wait until every earlier Read of the queue
	// pair has completed.
	Fence bool
	// Compress asks that a Read's data cross the wire compressed. Only a
	// provider that moves bytes over a wire of its own (tcp) does so, and
	// only when its queue pair allows it (AllowCompression); the others
	// ignore it.
	Compress Compression
}

// Codec names how a Read's data may be compressed on the wire.
type Codec uint8

// The codecs of a compressed Read.
const (
	CodecNone Codec = iota // as it is
	// CodecAuto: the responder compresses with s2, zstd or huff0 when a sample
	// of the data, compressed at the speed it measures, predicts a win
	// over the requester's Goodput; else it sends the data as it is.
	CodecAuto
	CodecS2   // s2, each chunk stored when it does not shrink
	CodecZstd // zstd at its fastest level, the same way
	// CodecHuff: huff0 entropy coding alone, the same way. CodecAuto
	// may pick it (low-entropy floats); it is also asked for by name.
	CodecHuff
)

func (c Codec) String() string {
	switch c {
	case CodecNone:
		return "none"
	case CodecAuto:
		return "auto"
	case CodecS2:
		return "s2"
	case CodecZstd:
		return "zstd"
	case CodecHuff:
		return "huff0"
	}
	return fmt.Sprintf("Codec(%d)", uint8(c))
}

// CodecNamed returns the codec String names ("s2", "zstd", "huff0", ...),
// or CodecNone.
func CodecNamed(name string) Codec {
	for c := CodecNone; c <= CodecHuff; c++ {
		if c.String() == name {
			return c
		}
	}
	return CodecNone
}

// Compression is a Read's request to compress its data on the wire.
type Compression struct {
	Codec Codec
	// Goodput is, for CodecAuto, the requester's estimate of the bytes a
	// second this queue pair's wire moves (0: unknown, which compresses
	// nothing).
	Goodput float64
}

// Compressor is a queue pair that can compress the data of Reads it
// serves (tcp). Compression is off until AllowCompression turns it on: a
// peer cannot make a responder spend its CPU on compressing unless the
// responder's side agreed to (package rpc does, per session).
type Compressor interface {
	AllowCompression(on bool)
}

// RecvRequest is a work request for PostRecv.
type RecvRequest struct {
	ID uint64
	// Local is where a received Send lands, when Segments is empty; a
	// WriteImm uses no bytes of it.
	Local Local
	// Segments, when not empty, replace Local: a received Send is
	// scattered into them in order.
	Segments []Local
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
	// StatusBadData: a Read's data came compressed and did not decode to
	// what it declared (a broken or hostile responder).
	StatusBadData
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
	case StatusBadData:
		return "bad data"
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
	// Packed is, for a Read whose data crossed the wire compressed, the
	// codec the responder chose (CodecS2, CodecZstd, CodecHuff) and Wire the bytes
	// that crossed it; CodecNone and 0 otherwise.
	Packed Codec
	Wire   int
	// Sampled is, for a Read that asked for CodecAuto, the ratio the
	// responder's sample of its data showed for the best codec (0: it
	// did not sample: the link was too fast for any codec, or the data
	// too short).
	Sampled float64
	// Key is, for OpRecvImm, the remote key the WriteImm wrote through,
	// where the provider knows it (Attributes.RecvImmKey): a receiver that
	// handed out one key per destination can check the write landed where
	// its immediate value says. 0 otherwise.
	Key uint32
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

// CompletionRunner is implemented by completion queues that can hand
// their completions to a function in the goroutine of the provider that
// produced them (a software provider's receiver) instead of waking a
// waiter: the common path of a request and its answer then runs to
// completion in the goroutine that is awake anyway. The tcp and shm
// providers' queues implement it; ibv's do not (poll them with Wait).
//
// Run calls handle with every completion of the queue until ctx ends or
// the queue is closed, then returns ctx.Err() or, after handing over what
// was queued before the close, ErrClosed, as Wait does. handle runs in
// one goroutine at a time and sees the completions in the order Poll
// would return them; the slice is valid only during the call. It runs
// in Run's goroutine, in one of the provider's, or in the goroutine of a
// PostSend whose request the provider ran there (shm's Reads and Writes,
// just before PostSend returns), so it must not
// block on that provider's progress: not wait for another completion,
// for anything the peer sends (an acknowledgement, a Read's data, the
// peer's confirmation that it unmapped a revoked grant), nor for a queue
// pair to close. Posting work requests, which never wait, is allowed.
// While Run runs, do not call Poll or Wait on the queue. A goroutine that
// polls a queue pair (Poller) may run handle too, one at a time with the
// provider's.
type CompletionRunner interface {
	Run(ctx context.Context, handle func([]Completion)) error
}

// Detacher is implemented by completion queues (CompletionRunner) whose
// handler, when it runs in a provider's receiver, may have to wait: a
// handler that calls DeliveryToken (in the handler, in the goroutine
// running it) gets a non-zero token when the goroutine delivering is a
// receiver that can hand its role over, else 0. Detach(token), from any
// goroutine while that handler still runs, makes the provider continue
// receiving and delivering in a new goroutine, so that the rest of the
// queue's completions, and the peer's messages, no longer wait for the
// handler; the old goroutine finishes the handler and then leaves. It
// reports false when that delivery is over. A CompletionRunner implements
// it (the conformance suite checks); a queue polled with Wait does not
// need to: its poller hands its own role over. The tcp and shm providers'
// queues implement it.
type Detacher interface {
	DeliveryToken() uint64
	Detach(token uint64) bool
}

// Poller is implemented by queue pairs whose incoming messages a goroutine
// waiting for one may handle itself, instead of being woken by the
// provider's receiver. Such a goroutine calls BeginPoll; when it returns
// true, Poll as often as it likes, then EndPoll once; when false (another
// goroutine polls the queue pair already, and handles what arrives for
// this one too), neither. Poll handles what has arrived, unless the
// receiver is handling it, and reports whether it handled anything; the completions that produces go to their queue's
// CompletionRunner handler in the polling goroutine, under the same
// rules. While any goroutine polls, the provider may let its receiver
// sleep through what arrives (the peer then needs no wake-up for it);
// EndPoll hands back to the receiver. Neither Poll nor BeginPoll blocks;
// EndPoll may wait for a Poll or the receiver under way. The shm
// provider's queue pairs implement it (their messages arrive in shared
// memory, where looking costs no system call); tcp's and ibv's do not.
type Poller interface {
	BeginPoll() bool
	Poll() bool
	EndPoll()
}

// PeerLocator is implemented by queue pairs that know whether their
// connected peer runs in this very process (shm: from the socket's
// SO_PEERCRED). Spinning for a peer in another process competes with that
// process for the host's cores, which the Go scheduler cannot arbitrate;
// spinning for one in this process does not.
type PeerLocator interface {
	PeerInProcess() bool
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
	ErrTooLarge      = errors.New("verbs: request exceeds the device's attributes")
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
