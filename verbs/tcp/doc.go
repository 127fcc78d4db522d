// Package tcp is the verbs provider for any pair of hosts: a software
// reliable-connected queue pair over one TCP connection.
//
// # Basics
//
// New returns the provider; Open returns a protection domain. Every queue
// pair's LocalInfo carries its role, the address peers dial, a random
// 128-bit one-time secret and the queue pair's id. One of two queue pairs
// being connected dials the other and presents both secrets; the accepting
// side takes only a connection that presents the secret it issued and the
// secret from the info its own Connect was given, and only once, so a data
// connection is bound to the control-plane session that carried the infos.
//
// Who dials follows verbs.QueuePairConfig.Role: a RoleDial queue pair
// dials, listens for nothing and advertises no address; a RoleAccept one
// only accepts and never dials an address taken from the peer's info, so a
// server that makes its queue pairs RoleAccept cannot be made to connect
// anywhere by a client; a RoleAny one does the opposite of a peer with a
// role, and of two RoleAny queue pairs the one with the smaller secret
// dials. Two RoleDial or two RoleAccept queue pairs fail to connect with
// verbs.ErrInvalidInfo.
//
// # Addresses
//
// A domain keeps one listener per local address, started by the first
// queue pair (other than RoleDial) that uses it; peers dial the listener's
// address unless WithAdvertiseAddress says otherwise. A queue pair listens
// on the first of
//
//   - the explicit listen address: WithListenAddress, else the environment
//     variable TENSORRPC_TCP_ADDR ("host[:port]");
//   - the address of the interface named by TENSORRPC_SOCKET_IFNAME, a
//     list of name prefixes in the style of NCCL_SOCKET_IFNAME ("eth,ib",
//     "=eth0", "^docker,lo");
//   - verbs.QueuePairConfig.LocalAddress, this host's address on the
//     control connection (package rpc passes the gRPC connection's);
//   - 127.0.0.1,
//
// with a free port, or the port of an explicit listen address whose host is
// a wildcard (such an address gives only its port when an interface or a
// LocalAddress is known). Since LocalAddress is the address the peer
// already reached this host on, sessions between hosts work with no
// configuration. A loopback address is never offered to a peer on another
// host: when LocalAddress is not loopback but the address a queue pair
// would advertise is, NewQueuePair fails and says how to fix it. The
// environment is read once, by New; EnvSettings reports it.
//
// One goroutine writes frames in posting order and one reads and applies
// them in order, so the RC ordering guarantee holds: the data of Writes
// posted before a WriteImm or Send is in place when that WriteImm or Send
// completes at the target. A frame is a 36-byte little-endian header
// (opcode, status, flags, remote key, immediate, sequence number, remote
// address, length) followed by the payload of Writes, Sends and read
// responses. The target checks key, rights and bounds before it touches
// memory; a refused access is reported to the requester (its request
// completes with StatusRemoteAccess), its payload is discarded unread into
// memory, and both queue pairs go to ERR, as in InfiniBand.
//
// Copies: a Write's or Send's payload goes from the registered memory to
// the kernel with writev (payloads up to MaxInline, 1 KiB by default, are
// first copied next to their header to batch small messages), and from the
// kernel straight into the target region or receive buffer. Only the part
// of a payload that the connection's 16 KiB read-ahead buffer already
// holds is copied from that buffer, so a large payload is copied once by
// each kernel and almost never in user space. Read responses travel the
// same way in the other direction. While the receiver reads a payload of
// 64 KiB or more straight into its destination, it raises the socket's
// receive low water mark (SO_RCVLOWAT, on Linux) to what it still wants,
// at most 256 KiB, so that the netpoller wakes it for a few large reads
// instead of one per segment that arrives; any other read sets the mark
// back first, so it never waits for bytes the peer does not send.
//
// The provider is a wire under the soft-RC core shared with shm (see
// "Soft providers" in package verbs): regions, grants, completion queues,
// post-time checks, the work queues, the queue pair's states, the flush
// order, Close and the connection info are the core's; the writer and the
// receiver, the frames and the listeners are tcp's. A grant's key is
// checked like a region's, and the target also checks that the request
// arrived on the queue pair the grant was made on. Scattered
// local segments go out with the same writev and are read into in order.
// A Fence request is not written until every earlier Read has completed.
//
// Completions: Writes, WriteImms and Sends complete at the requester when
// the target acknowledges them (acknowledgements are cumulative), Reads
// when their data has arrived. Sends and receives complete in order. The
// completion queues implement verbs.CompletionRunner: while Run runs, the
// receiver hands what it completed to the handler itself, before it reads
// on. The acknowledgement of a Send or WriteImm, which completed a
// receive, waits for a reply posted in reaction to carry it; what no reply
// took the receiver writes before it waits for the next frame. The
// receiver never blocks on a write: it writes what the socket's send
// queue takes at once (up to 2 MiB), and the writer goroutine writes the
// rest, before anything else (so does a poster writing on an idle
// connection, the direct path); a Read's response, when nothing more was
// read, goes the same way, unless it is to be compressed. A
// request-response exchange thus costs one write per direction and wakes
// neither the writer nor a poller. A request marked LazyCompletion and
// posted while the completion queue's Run handler is being given
// completions (an answer posted where its request was delivered) is
// Early: it completes as soon as it is written, within that delivery,
// and its frame tells the target not to acknowledge it at all. Such
// answers to a burst of requests read at once are held until the
// receiver has delivered the burst, and then written in one batch.
//
// # Caveats
//
// An incoming Send or WriteImm with no receive posted waits up to the RNR
// timeout (WithRNRTimeout, 2 seconds by default) for one and then fails
// with StatusReceiverNotReady; like every responder error, this is fatal for
// both queue pairs. While it waits, the connection is not read.
//
// A Read is served when the target processes it, not when it was posted:
// like RDMA without a fence, a Write posted after a Read on the same queue
// pair may land before the Read's data is sent.
//
// Deregister waits only for transfers in progress on the region's memory
// (a payload being read from or written to the socket); a transfer stalled
// by its peer holds it until the connection fails or its queue pair is
// closed. Work requests merely posted on the region do not hold it: one that
// reaches it after Deregister fails with StatusLocalProtection and, like
// every local or responder error, moves its queue pair to ERR.
//
// When a queue pair goes to ERR, its connection lingers (WithLingerTimeout,
// 2 seconds by default) to deliver the error to the peer, then closes. A
// queue pair that loses its connection fails with StatusTransport (see the
// flush order in package verbs). Close closes the connection and stops
// both goroutines before it returns.
//
// PostSend may write a small request to the socket itself when the
// connection is nearly idle, instead of handing it to the writer goroutine,
// which saves a hand-off on each message of a round trip.
package tcp
