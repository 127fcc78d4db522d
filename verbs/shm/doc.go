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
// Memory with an fd must be a memfd sealed with F_SEAL_SHRINK (F_SEAL_GROW
// too, usually), which peers map; RegisterMemory refuses other fds with
// verbs.ErrInvalidMemory. Memory without an fd (a Go slice, a framework's
// array) registers too, with any rights; peers reach it by cross-memory
// attach (see "Memory without a memfd" below). A region's Addr is its
// local virtual address; its local and remote keys are the same 32-bit
// key, unique in its domain (random, skipping the ones in use by regions
// and grants).
//
// The provider is a wire under the soft-RC core shared with tcp (see "Soft
// providers" in package verbs): the queue pair's states, work queues,
// post-time checks, flush order, Close, regions' keys and grants'
// accounting, completion queues and the connection info and handshake
// rules are the core's. A queue pair's LocalInfo carries, besides the
// core's secret and queue pair id, the host identity and the domain's
// socket address. Connect refuses info from another host (ErrOtherHost,
// which wraps verbs.ErrInvalidInfo). shm has no roles: of the two peers,
// the one with the smaller secret dials the other's socket. The connection
// is a SOCK_SEQPACKET unix socket. The handshake passes, with SCM_RIGHTS, each side's staging buffer
// and control ring (sealed memfds; see below), and each side probes
// whether it can read the other's memory by cross-memory attach
// (CrossMemory); afterwards the socket carries only wake-ups, the memfds
// of regions and the end of the connection.
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
// Queue pairs implement verbs.RemoteMapper: MapRemote checks a key, bounds
// and the remote-read right as a Read would, through the same cache of
// announced regions and grants (asking the peer on first use), and
// returns a verbs.Mapping: the peer's memfd mapped PROT_READ (writing it
// faults), one mapping per peer region (for a grant, its whole region),
// made on first use and shared by the Mappings of the region and by the
// cache while the region stays cached, so that a Mapping costs no mmap
// once there is one. The last of them to let go (Release, or the region
// leaving the cache) unmaps it. A refusal is an error and leaves the
// queue pair usable.
//
// Grants (QueuePair.Grant) take keys from the same random 32-bit space as
// regions. The peer asks for a grant's key like a region's; the domain
// answers only the queue pair the grant was made on, with the granted
// range and its one right, the grant's offset in its region, the
// region's range of its memfd and an exposure id, a number the queue pair
// gives each region the first time it exposes it to the peer through a
// grant (never reused on the queue pair). The memfd rides along only that
// first time: the peer checks its seals and size for the whole region,
// maps the whole region once (PROT_READ, plus PROT_WRITE from the first
// write grant on, which remaps it once) and caches the mapping by
// exposure id; each grant is then an entry in the key cache, a window
// (key, the peer's address range, one right) on that mapping, and the
// answers for later grants of the region carry no fd and cost no mmap.
// Better still, a grant made while its region is already exposed is
// announced to the peer at once (msgGrant, the same fields, never an fd),
// so its first use needs no question at all; the peer ignores such
// announcements past a bound on its key cache, and asks when it uses one.
// The peer's provider checks the grant's range and right before every
// copy, and refuses an answer whose exposure id contradicts what it
// holds. Revoke, like Deregister, has the peer drop the key and waits for
// its confirmation, so no copy with the grant starts after Revoke
// returns; the region's mapping stays cached for the region's next
// grants. Deregister of the region (and so an arena trimmed or a pool
// closed) tells every queue pair the region was exposed on to drop the
// exposure, the region's mapping and every grant on it, and waits for
// each to confirm, as it does for regions announced by their own keys.
//
// Every request checks the remote key, bounds and rights against the
// peer's announced region before memory is touched; a refusal is a
// StatusRemoteAccess completion and moves the queue pair to the error
// state, as on InfiniBand RC.
//
// Copies per byte:
//
//   - Write: one, from the local region straight into the mapped remote
//     region. WriteImm adds a doorbell record (88 bytes, through the
//     peer's control ring) that consumes a Recv at the peer. The target
//     checks the doorbell's key and length against what it lets the peer
//     write (a region with remote write, or a write grant made on that
//     queue pair, at least that long) before it takes the Recv: otherwise
//     StatusRemoteAccess, and both queue pairs go to ERR.
//   - Read: one, from the mapped remote region into the local region.
//   - Send: two, into this queue pair's staging buffer (a sealed memfd the
//     peer maps read-only) and from there into the peer's Recv buffer.
//     Sends larger than the staging buffer (WithStagingSize, 256 KiB by
//     default) move in chunks, each acknowledged.
//   - Control messages (doorbells, acks): written once into the peer's
//     control ring and copied once out of it by the peer; no system call
//     while the peer's receiver is awake.
//
// Requests run one at a time, in posting order, with one exception
// below. When the queue pair is idle, PostSend runs the request itself, in
// the caller's goroutine (see WithInlineLimit): all of a Write or Read
// whose remote region is mapped, the copy and doorbell of a WriteImm or of
// a Send that fits the staging buffer. A Send or WriteImm waits for the
// peer's acknowledgement before the next request runs, so the data of
// earlier Writes is in place when the peer sees it, and nothing runs after
// a request that failed. What is posted behind a running request waits;
// when the acknowledgement comes, the goroutine that handled it (the
// receiver, or a caller polling the queue pair) runs the next ones itself
// while they are small (64 KiB), and the queue pair's sender goroutine
// runs the rest. A Send or WriteImm that finds no Recv waits at the peer
// for one up to the RNR timeout (WithRNRTimeout, one second by default)
// and then fails with StatusReceiverNotReady.
//
// The exception: a Read (not fenced) posted behind requests that do not
// write (a Send or WriteImm awaiting its acknowledgement, with its data
// placed; Sends and Reads queued), whose peer region is mapped, copies at
// once in the poster's goroutine, ahead of its turn (up to 64 such Reads
// a queue pair); its completion still comes at its turn, in posting
// order, and should a request ahead of it fail it flushes. Concurrent
// streams on one queue pair so copy side by side instead of each Read
// waiting for the other streams' requests to be acknowledged and then
// for the sender. The one ordering given up: such a Read may copy before
// the peer placed a Send posted ahead of it in its receive buffer, so it
// must not read that buffer expecting the Send's bytes (fence it). A
// Read behind a Write or WriteImm still waiting to run waits its turn.
// Copies hold no lock on the mapping cache while they copy, so the
// receiver, which changes it for every grant the peer makes or revokes,
// never waits for them.
//
// With TENSORRPC_COPY=share (off by default), a Read or Write of 256 KiB
// to 16 MiB (past which WithCopyWorkers' goroutines split it) is offered,
// in 64 KiB chunks, to the ring receivers of the process that poll an
// empty ring meanwhile: each takes one chunk between looks at its ring,
// on the core it spins on anyway, and the copy's goroutine waits for the
// chunks taken before the request completes (internal/memcopy's Share).
//
// The control path is a pair of shared rings, one per direction. Each
// queue pair makes a sealed 64 KiB memfd for the messages it receives,
// formats it as a mempool.Ring and passes it to the peer at connect; both
// map it read-write, the peer produces, we consume. Every control message
// (doorbells, acknowledgements, region requests, announcements and
// revocations) is an 88-byte record in the receiver's ring, in order. What
// memory cannot carry stays on the socket: a region's memfd follows its
// announcement record (which says so) as an SCM_RIGHTS message, and the
// socket is the wake-up and the sign of the peer's death.
//
// Wake-ups: a receiver whose ring is empty polls it for a while (20 µs,
// longer, up to 200 µs, while its peer's records keep coming within that
// after it slept: a peer copying a large tensor between records; see
// adaptSpin), yielding the processor between looks, so it costs little
// when the host is busy, then publishes a sleeping word in the ring's memory, looks at
// the ring once more and, if it is still empty, blocks reading the socket.
// A sender commits its record, then atomically swaps the sleeping word
// from 1 to 0 and, if it did, writes a wake-up message on the socket. With
// sequentially consistent atomics on both sides, either the receiver's
// second look sees the record or the sender's swap sees the word, so no
// wake-up is lost, and a sleep costs one wake-up message at most. The
// wake-up reaches the receiver through Go's netpoller, which a process
// whose every P runs goroutines looks at only every 10 ms (the runtime's
// monitor): there a sleeping receiver's lane would stall that long. So
// the process's awake receivers look after its sleeping ones: between
// their own drains they look at one sleeping receiver's ring (round
// robin) and, when records have waited there 100 µs, kick it: a read deadline in the
// past ends its read at once, and Go readies it without the netpoller
// (asleep_linux.go). Only the
// peer's records are trusted as far as mempool.Ring checks them: a corrupt
// ring, a record that is not a control message, or anything but a wake-up
// or an announced fd on the socket fails the queue pair with
// StatusTransport, as does a peer whose ring stays full for a second (a
// peer that stopped reading; honest peers hold a handful of records), or
// whose socket takes no message for a second (a wake-up, an fd, or any
// message without rings): the connection is then closed, so that nothing
// waits on such a peer for good (Deregister, Revoke, acks). The receiver
// looks for Close between records, so a peer that keeps its ring full
// does not hold Close. The
// producer's counter shares a page with the consumer's, so a hostile
// consumer can corrupt it too; the producer reports that as ring
// corruption, not a panic. The rings are negotiated in the handshake
// (flagRing); the socket-only control path of earlier versions remains,
// behind an unexported switch, for comparison: when either end keeps to
// it, every control message travels on the socket as an 88-byte
// SOCK_SEQPACKET record and the socket is the wake-up.
//
// Besides the data and the rings, each staging buffer starts with a state
// word: a queue pair marks it down when it fails or closes, before closing
// its socket, so the peer's next request fails with StatusTransport at
// once instead of landing in memory of a queue pair that is gone.
//
// # Memory without a memfd
//
// Memory without an fd (Memory.HasFD false) is the local side of this
// process's work requests (the destination of a Read or Recv, the source
// of a Write or Send) like any region: this process copies it itself. A
// peer reaches it, through the region's remote rights or a grant, by
// cross-memory attach (CMA): the peer's provider copies with
// process_vm_readv and process_vm_writev against this process's pid and
// the region's virtual addresses, instead of mapping a memfd. The key's
// announcement names that address (flagCMA) and passes no fd; a grant on
// such memory is announced as it is made. The checks are the same as for
// a mapped region: key, bounds, right, the grant's queue pair, and
// Revoke and Deregister have the peer drop the key and confirm. Each such
// Read or Write is one copy, made by the kernel in one system call (more
// when cut short, see below), not split over WithCopyWorkers. MapRemote
// refuses such memory (verbs.ErrUnsupported).
//
// Whether CMA works is decided per connection, in Connect, by a real
// probe each way: each side reads 16 known bytes of the other (its
// secret, at an address given in the handshake) with process_vm_readv,
// from the pid the socket names (SO_PEERCRED; never a pid the peer
// sends), and tells the other how that went. A queue pair's CMA method
// (CrossMemory) is nil when the peer reaches this process's memory, and
// otherwise an error wrapping ErrCMAUnusable that says why: the errno and
// what explains it (Yama's ptrace_scope, different users, a kernel
// without CMA), a pid outside the pid namespace, or a peer whose provider
// does not take part. Registration never fails for that, since memory is
// registered before connections exist: what fails is the peer's access,
// with a StatusRemoteAccess completion carrying the same reason, which
// (as every refused access) moves the queue pairs to ERR. A layer that
// grants memory without an fd asks CMA first, and copies through memfd
// memory when it is not nil.
//
// A transfer the kernel cuts short (it moves at most about 2 GiB a call,
// and stops at the first page it cannot reach) is continued where it
// stopped; memory its owner unmapped without deregistering it fails the
// access with StatusRemoteAccess (EFAULT), never a fault in either
// process. Before each copy the provider polls a pidfd of the peer,
// opened before the probe that showed the pid to be the peer's, so that
// a pid whose process has exited, which another process may get, is
// never touched: the access fails with StatusTransport.
//
// Under Yama ptrace_scope 1 a process may let one other process read its
// memory with prctl(PR_SET_PTRACER, pid). The provider does not do that
// for its peers: the setting is one slot per process, shared with the
// application (crash reporters use it), which a second connection would
// silently take from the first, and it opens more than reads and writes
// of memory (ptrace attach). Where that is acceptable the application can
// name its one peer before Connect; or run the memory's owner as a
// descendant of its peer, which ptrace_scope 1 allows; or lower
// ptrace_scope. Otherwise the layer above copies.
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
// the fd and closes it in Deregister. A peer's copy mapping of a region,
// whether announced by its own key or exposed by a grant, lasts until the
// region is deregistered or the queue pair closes (not merely until its
// grants are revoked). A Mapping from MapRemote is independent of both:
// it stays readable until its Release even after the peer deregisters the
// region, the queue pair closes or the peer process dies, and it reads
// the original bytes (the last the peer wrote), because the mapping keeps
// the shared memory, whose memfd is sealed against shrinking. Revocation relies on the peer's
// cooperation: a peer process that ignores the unmap request keeps its
// mapping (and can go on writing the memory) for as long as it lives;
// Deregister then fails the queue pair after WithDeregisterTimeout. Share
// regions only with processes you trust with that memory.
//
// Grants narrow what the provider lets the peer's requests touch, not what
// the peer process can touch: the peer receives the region's memfd (the
// whole region, not just the granted range) and a process that does not
// follow the protocol can map all of it, read and write it, and keep it
// after Revoke and Deregister. Where CMA works, the peer process can read
// and write all of this process's memory, registered or not: the kernel
// allows it because the peer may ptrace us, whatever this provider does. Grants protect against a peer that speaks
// the protocol with forged keys, offsets or lengths (its provider checks
// every request, ours answers only for the grants of its queue pair), not
// against a hostile process on the same host. Use tcp between processes
// that do not trust each other.
//
// A queue pair that goes to ERR shuts down its side of the socket after
// the acks it owes, so that its peer goes to ERR too. Peer death is seen
// when the socket closes, which a receiver notices when its ring runs dry
// and it sleeps on the socket: the queue pair fails with StatusTransport
// (see the flush order in package verbs). A peer that hangs without dying keeps a Send or
// WriteImm waiting until the queue pair is closed.
//
// The provider is Linux-only; on other systems New returns a provider
// without devices.
package shm
