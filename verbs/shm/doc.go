// Package shm is the same-host verbs provider: queue pairs between processes
// of one host (one kernel, one network namespace) that move bytes through
// shared memory.
//
// # Basics
//
// New returns the provider; it has one device, "shm", whose description
// names the host identity (see HostIdentity). Open makes a protection domain
// that listens on its own unix socket, "@tensorrpc-shm-<random>" in the
// abstract namespace by default (WithSocketDir puts a socket file in a
// directory instead).
//
// Memory must be memfd-backed: Memory.HasFD set, FD a memfd sealed with
// F_SEAL_SHRINK (F_SEAL_GROW too, usually). RegisterMemory refuses anything
// else with verbs.ErrInvalidMemory. A region's Addr is its local virtual
// address; its local and remote keys are the same 32-bit key, unique in its
// domain (keys count up from a random start and skip the ones in use).
//
// A queue pair's LocalInfo carries a version, the host identity, the
// domain's socket address, the queue pair's id and a 128-bit one-time
// secret. Connect refuses info from another host (ErrOtherHost, which wraps
// verbs.ErrInvalidInfo). Of the two peers, the one with the smaller secret
// dials the other's socket and presents both secrets; the acceptor takes
// exactly one connection, the one that presents its own secret and its
// peer's, and closes any other. The connection is a SOCK_SEQPACKET unix
// socket that carries small control messages and, with SCM_RIGHTS, memfds.
//
// Regions are announced lazily: the first time a queue pair targets a
// remote key, it asks the peer, which answers with the region's bounds,
// rights and memfd; the queue pair checks the memfd's seals and size, maps
// it once (PROT_READ, plus PROT_WRITE only if the region grants remote
// write) and caches the mapping by key. Because the question goes to the
// peer, a Write posted right after the peer registered a region finds it.
// Deregister tells every peer that mapped the region to unmap it and waits
// for each to confirm, so remote accesses after Deregister returns fail
// with StatusRemoteAccess.
//
// Every request checks the remote key, bounds and rights against the
// peer's announced region before memory is touched; a refusal is a
// StatusRemoteAccess completion and moves the queue pair to the error
// state, as on InfiniBand RC.
//
// Copies per byte:
//
//   - Write: one, from the local region straight into the mapped remote
//     region. WriteImm adds a doorbell message that consumes a Recv at the
//     peer.
//   - Read: one, from the mapped remote region into the local region.
//   - Send: two, into this queue pair's staging buffer (a sealed memfd the
//     peer maps read-only) and from there into the peer's Recv buffer.
//     Sends larger than the staging buffer (WithStagingSize, 256 KiB by
//     default) move in chunks, each acknowledged.
//
// Requests run one at a time, in posting order. When the queue pair is
// idle, PostSend runs the request itself, in the caller's goroutine (see
// WithInlineLimit): all of a Write or Read whose remote region is mapped,
// the copy and doorbell of a WriteImm or of a Send that fits the staging
// buffer. Everything else, and everything posted behind a running request,
// runs in the queue pair's sender goroutine. A Send or WriteImm waits for
// the peer's acknowledgement before the next request runs, so the data of
// earlier Writes is in place when the peer sees it, and nothing runs after
// a request that failed. A Send or WriteImm that finds no Recv waits at the
// peer for one up to the RNR timeout (WithRNRTimeout, one second by
// default) and then fails with StatusReceiverNotReady.
//
// The control channel is the unix socket: doorbells, acknowledgements and
// region announcements are 88-byte SOCK_SEQPACKET records, and the socket
// is the wake-up. The one thing shared through memory besides the data is
// a state word at the head of each staging buffer: a queue pair marks it
// down when it fails or closes, before closing its socket, so the peer's
// next request fails with StatusTransport at once instead of landing in
// memory of a queue pair that is gone.
//
// # Caveats
//
// Same host only. Both peers must share the kernel and the network
// namespace (abstract sockets live there); HostIdentity tells them apart.
// Processes in different mount or user namespaces work as long as they
// share the network namespace.
//
// Sealing is what makes a shared region safe to touch: without
// F_SEAL_SHRINK the owner could truncate the memfd and turn our next access
// into SIGBUS. Both RegisterMemory and the peer that maps an announced
// region (or a staging buffer) insist on the seal, and a queue pair maps
// only regions it asked for. RegisterMemory cannot check that Bytes really
// is the mapping of FD at FDOffset; the caller vouches for it.
//
// PostSend may copy: a Write or Read of up to the inline limit (1 GiB by
// default) posted to an idle queue pair is done when PostSend returns.
// Use WithInlineLimit or QueuePairConfig.MaxInline to keep large copies
// off the posting goroutine.
//
// Lifetimes. Memory.Bytes and its memfd belong to the caller and must stay
// mapped until Deregister returns; the provider keeps its own duplicate of
// the fd and closes it in Deregister. A peer's mapping of a region lasts
// until the region is deregistered or the queue pair closes. Revocation
// relies on the peer's cooperation: a peer process that ignores the unmap
// request keeps its mapping (and can go on writing the memory) for as long
// as it lives; Deregister then fails the queue pair after
// WithDeregisterTimeout. Share regions only with processes you trust with
// that memory.
//
// Peer death is seen when the socket closes: outstanding requests complete
// with StatusTransport (the one executing) or StatusFlushed, posted Recvs
// with StatusFlushed. A peer that hangs without dying keeps a Send or
// WriteImm waiting until the queue pair is closed.
//
// The provider is Linux-only; on other systems New returns a provider
// without devices.
package shm
