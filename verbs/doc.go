// Package verbs expresses every tensorrpc data plane as one-sided RDMA
// semantics: protection domains, registered memory regions with remote
// keys and narrower grants, reliable connected queue pairs, work requests
// (Send, Recv, Write, WriteImm, Read) with scatter-gather, and completion
// queues.
//
// The tensor protocols in package rpc are written once against these
// interfaces and run unchanged on every provider:
//
//   - ibv: libibverbs through cgo (build tag rdma), real RDMA NICs;
//   - shm: the same host, memfd regions shared over a unix socket;
//   - tcp: any host, a software reliable-connected queue pair over TCP.
//
// Each provider lives in its own sub-package and implements Provider. The
// software providers (tcp, shm) share one reliable-connection core and
// differ only in how bytes and doorbells move (see Soft providers).
//
// # Basics
//
// The contract below has one answer for every behaviour; the conformance
// suite (package verbstest) checks each answer on every provider.
//
//   - Close, Deregister, Revoke and Mapping.Release are idempotent: a
//     second call returns nil. Using a closed object returns an error
//     wrapping ErrClosed.
//   - Completion queues have a capacity. NewQueuePair reserves MaxSend
//     (in its send CQ) and MaxRecv (in its receive CQ) and fails with an
//     error wrapping ErrQueueFull when a CQ has no room left, so a CQ never
//     overflows. Closing the queue pair returns its reservation.
//   - PostSend and PostRecv are all or none. Every request is checked
//     before any is posted: the opcode, each local segment against its
//     region (same protection domain, in bounds, local-write right for a
//     Read or Recv destination), the number of segments and the total
//     length against Attributes, and the room left in the queue. A bad
//     local segment (a deregistered region included) is refused at post
//     time with an error wrapping ErrInvalidMemory; a request over the device's limits with one
//     wrapping ErrTooLarge; no room with ErrQueueFull; a queue pair that is
//     not connected with ErrNotConnected; one in ERR with ErrQPError. An
//     error means nothing of that call was posted.
//   - PostRecv is allowed from creation on (Recvs posted before Connect
//     catch the first Sends); PostSend needs a connected queue pair. A
//     closed, unconnected or ERR queue pair refuses a post (ErrClosed,
//     ErrNotConnected, ErrQPError) before its requests are checked.
//   - An invalid opcode is refused at post time with ErrUnsupported;
//     MaxSend or MaxRecv over Attributes.MaxQueueDepth with ErrTooLarge.
//   - A posted request completes exactly once, unless it is Unsignaled
//     and succeeds. Completions of one queue pair's send queue arrive in
//     posting order, as do those of its receive queue.
//   - Remote keys (a region's RemoteKey, or a Grant's) are checked by the
//     target before any byte is touched: an unknown or revoked key, a range
//     outside the region or grant, a missing right, or a grant used on
//     another queue pair fails the request with StatusRemoteAccess, and
//     both queue pairs go to ERR, as in InfiniBand.
//   - A Send larger than the Recv that takes it fails with
//     StatusRemoteInvalidRequest at the sender and StatusLocalLength at the
//     receiver; a Send or WriteImm with no Recv posted waits up to the
//     provider's RNR timeout, then fails with StatusReceiverNotReady. Both
//     are fatal to the connection.
//   - When the connection to the peer is lost, the oldest outstanding
//     request completes with StatusTransport and the others with
//     StatusFlushed; the queue pair is in ERR. An Unsignaled request that
//     already executed never completes.
//   - Closing a queue pair gives its completion-queue room back once its
//     flushed completions have been polled (at once when none is
//     outstanding).
//   - Errors are fatal to a queue pair: after its first failed request it
//     is in ERR; requests still outstanding complete with StatusFlushed
//     (unsignaled ones too), later posts fail with ErrQPError, and the
//     peer's queue pair goes to ERR as well.
//   - Connect moves a queue pair to RTS once this side is ready; it does
//     not prove that the peer can reach it (on ibv, Connect only changes
//     QP state). Verify a new connection with a round trip over it — a
//     Send answered by a Send — before relying on it; package rpc does so
//     in its negotiation.
//   - Work requests of one queue pair execute in order: the data of Writes
//     posted before a WriteImm or Send is in place at the target when that
//     WriteImm or Send completes there. A Fence request starts only after
//     every earlier Read of the queue pair has completed.
//
// # Soft providers
//
// tcp and shm are thin wires under one core, package
// verbs/internal/softrc, as libfabric's providers sit on its util layer.
// The core owns the state of their domains and queue pairs: the key table
// of regions and grants, completion queues and the room queue pairs
// reserve in them (MaxSend and MaxRecv default to 1024 each, at most
// 65,536), the work queues and their accounting, post-time checks, the
// queue pair's states and the cause of ERR, the flush order above (the
// oldest outstanding request carries the error, every later one is
// StatusFlushed), Close, the connection info (LocalInfo) and the
// handshake's rules. LocalInfo carries a random 128-bit one-time secret:
// one side dials the other (by QueuePairConfig.Role; of two RoleAny
// sides, the one with the smaller secret) and presents both secrets, and
// the accepting side takes only the connection that presents its own
// secret and its peer's, once, which binds the data connection to the
// control-plane session that carried the infos. A wire only moves bytes:
// tcp writes and reads frames on one TCP connection; shm rings doorbells
// through a shared control ring and copies straight into the peer's mapped
// regions. ibv shares the core's contract checks and errors. On every
// provider an error from a queue pair names the provider and the queue
// pair ("tcp: queue pair 7: ...", ibv by QP number) and, for a queue pair
// in ERR, the cause.
//
// # Caveats
//
// A region registered with remote rights exposes all of it, with its
// RemoteKey, to every peer of the domain. To open only what one transfer
// needs, register without remote rights and Grant a range of it to one
// queue pair for the transfer, then Revoke the grant.
//
// Unsignaled requests still occupy their place in the send queue until a
// later signaled request of the same queue pair completes; a queue pair
// that posts only unsignaled requests fills up (ErrQueueFull).
//
// On shm the peer maps the shared regions' memory: a grant hands the
// peer the file descriptor of the grant's whole region, which the peer's
// provider maps once and keeps mapped for the region's later grants until
// the region is deregistered. Grants are enforced by the provider on both
// sides, which protects against a peer that speaks the protocol with
// forged keys, offsets or lengths, not against a hostile process on the
// same host: that process holds the region's file descriptor and can map
// and write all of the region, and keep it. Use tcp between processes
// that do not trust each other.
//
// A Mapping from MapRemote stays readable until its Release even if the
// peer dies or the queue pair closes (the mapping holds the shared memory,
// whose size is sealed), and it is read-only.
package verbs
