// Package rpc moves tensors between processes and hosts: gRPC carries the
// control messages, and tensor bytes move over the best data plane both
// peers can use — RDMA verbs (ibv), shared memory (shm), a TCP socket
// (tcp) — or, when none connects, through plain gRPC streams.
//
// # Basics
//
// A Server publishes tensors and serves methods; a Client opens a session
// with it:
//
//	srv, _ := rpc.NewServer()
//	go srv.Serve(lis)
//	srv.Publish(ctx, "weights", w)
//	srv.Handle("scale", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) { ... })
//
//	c, _ := rpc.Dial(ctx, addr, rpc.WithTransportCredentials(insecure.NewCredentials()))
//	defer c.Close()
//	t, _ := c.Fetch(ctx, "weights")  // NotFound unless published; rpc.WaitForKey() waits
//	defer t.Release()
//	_ = c.Send(ctx, "grad", g)        // into the server's rendezvous
//	reply, _ := c.Call(ctx, "scale", &rpc.Message{Tensors: []*rpc.Tensor{t}})
//	defer reply.Release()
//
// Options are typed by side, as in grpc-go: ServerOption for NewServer,
// DialOption for Dial and NewClient, and Option for those that fit both.
// Dial requires transport credentials (TLS, or insecure.NewCredentials()
// for plaintext), as grpc.NewClient does.
//
// # Words
//
// A transport is one way tensor bytes move between two peers: ibv, shm,
// tcp (TransportIBV, TransportSHM, TransportTCP), or grpc, the fallback
// of plain gRPC streams (TransportGRPC). A provider (verbs.Provider,
// WithProvider) is the code behind one of the first three. A session's
// data plane is the transport it negotiated, connected: one or more lanes
// (queue pairs, WithLanes). Device means GPU memory only (DeviceTensor,
// SendDevice, FetchToDevice, PublishDevice).
//
// # Sessions and negotiation
//
// Dial opens a session: the client offers every data plane it can open,
// the server picks the first both can use in the order ibv > shm > tcp,
// and both connect it. Each side reports its outcome as soon as it knows
// it, and a side that hears the other failed abandons its own attempt, so
// a plane that cannot work costs about one round trip, not a timeout
// (WithConnectTimeout bounds only a plane whose packets vanish). A plane
// is used only after a verifying round trip over it; when none verifies,
// the session falls back to gRPC streams. Client.Transport says which
// plane a session uses and Client.Rejections why the others were not used
// and what would fix it; both sides also log each refused plane at Info.
// WithTransports restricts the choice.
//
// Across hosts the defaults work: the server's tcp plane listens on, and
// advertises, the local address of the gRPC connection the session
// arrived on — an address the client could reach — and the client dials
// it; the server never dials an address a client names. A loopback
// address is never advertised to a client that is not on loopback.
// WithDataAddress, or the environment variables TENSORRPC_SOCKET_IFNAME
// (interface name prefixes, as NCCL_SOCKET_IFNAME: "eth", "=eth0",
// "^docker") and TENSORRPC_TCP_ADDR ("host[:port]"), choose another
// address, e.g. a faster network than the control plane's.
//
// A Client is a channel, like a grpc.ClientConn: when its session ends
// (the server restarted, the connection was lost) calls under way fail
// with Unavailable, and the next call opens a new session and renegotiates
// the data plane, with gRPC's connection backoff between failed attempts
// (WithBackoff). Client.State and Client.WaitForStateChange report the
// connectivity state in gRPC's terms.
//
// How bytes move, and the copies this side makes (Stats counts them):
//
//   - Tensors up to the eager threshold (DefaultEagerThreshold) travel
//     inside the control message: one copy into it, one out of it.
//   - Fetch: the server returns a descriptor of its pool buffer; the client
//     reads it with one one-sided Read into its own pool buffer (no CPU copy
//     on tcp's receive path beyond the socket, one memcpy on shm) and then
//     releases the server's buffer. On tcp, a Fetch of a key fetched
//     before lands (WithFetchLanding): the client grants a pool buffer of
//     the size the tensor had with its request, and the server writes the
//     tensor into it before it answers, saving the Read's round trip.
//   - Send and Call: the client grants the server read access to its pool
//     buffer and names it in the request; the server reads it into a
//     buffer of its own (all of a Call's tensors at once), publishes a
//     Send's tensor and only then answers. The receiver pulls, but for a
//     landed Fetch.
//   - Frames: on a data-plane session every call's request and answer (a
//     small tensor inline) are frames on the data plane's own queue pairs,
//     not gRPC calls, which saves the gRPC round trip; a request or answer
//     too large for a frame (a long key, large metadata, many tensors) is
//     itself pulled, as a tensor is. A session may have several queue
//     pairs (lanes, WithLanes): a call takes the least busy and transfers of
//     8 MiB or more are read in parts over all of them at once. gRPC's own
//     interceptors (WithGRPCServerOptions, WithGRPCDialOptions, a
//     grpc.Server given to Register, the connection given to NewClient)
//     see only the gRPC methods: session setup, the fallback's streams and
//     clients that have only the .proto.
//   - Fetch with Lease on shm: the tensor is the server's memory mapped into
//     the client, no copy at all, until the tensor is released.
//   - The gRPC fallback streams chunks that view pool memory (no copy of
//     ours on send; gRPC's transport copies into its frames) and copies once
//     out of gRPC's buffers on receive.
//   - A tensor over caller memory (WrapTensor: a Go slice, a framework's
//     array) is sent in place where the plane can read it: on tcp it is
//     registered (through a per-plane registration cache; Register keeps
//     a registration across calls) and granted as pool memory is, and a
//     Send that gives up ends the grant before it returns, so the memory
//     is the caller's again; elsewhere it is copied once into pool memory.
//     Fetch with Into lands a tensor in the caller's memory (read in place
//     on tcp, copied in once where the plane cannot register it).
//
// # Rows
//
// Fetch with Rows(idx...) returns rows of a published tensor (indices
// along dimension 0) back to back, in one request: on a data plane the
// server grants the whole tensor and the client reads its rows in one
// batch of Reads, over every lane for a large source; on the fallback the
// server gathers them. A server that publishes a tensor Writable lets
// clients write rows of it in place with Client.SendRows (the server
// reads each row into its place); rows written by different clients at
// once do not interfere, and a write is visible to Fetches that start
// after it returns. Together they move the blocks of a paged KV cache
// without a round trip per block (examples/kvcache).
//
// # CUDA IPC
//
// With WithCUDA on both sides, a session between two processes of one
// host (the shm plane's host identity) with a GPU in common negotiates
// CUDA IPC beside its data plane ("cuda-ipc" in Client.Rejections says why
// not: no CUDA driver on one side, not the same host, both in one process
// (the driver opens no IPC handle in the process that exported it), no
// common GPU, or, for SendDevice only, no WithDeviceAllocator on the server). Then:
//
//   - FetchToDevice of a tensor the server published with
//     PublishDeviceInPlace (or one a client sent over CUDA IPC) gets its
//     IPC handle, the tensor's offset inside the allocation the handle
//     names, and an allocation id; the client opens the handle, copies
//     device to device on a stream of dst's device, waits for the copy
//     (also when ctx ends, so nothing lands in dst afterwards) and
//     releases the transfer without waiting for the answer. Host memory
//     is never touched.
//   - SendDevice of a buffer that exports IPC handles sends its handle;
//     the server copies the tensor into device memory from its
//     WithDeviceAllocator and publishes it there before it answers.
//   - A host Fetch of a tensor held on a device is staged out (one
//     device-to-host copy), and so is a FetchToDevice on a session without
//     CUDA IPC, or into a buffer without streams (gpudirect.AsyncBuffer).
//
// Each session caches the handles it opened, by handle bytes and
// allocation id, for as long as the peer exports the allocation: opening
// costs milliseconds and closing synchronises the device. The server
// names each allocation it exports with a new id once no published tensor
// or transfer used the previous one, and tells the sessions that opened
// it (on their next FetchDevice); a handle is opened from the allocation's
// base up to the end of the farthest tensor fetched, and reopened larger
// when a tensor lies further. The control messages are gRPC unary calls
// (FetchDevice, SendDevice, ReleaseDevice), one round trip per transfer
// whatever the data plane. Stats.IPC counts the transfers.
//
// Errors carry gRPC status codes: InvalidArgument for malformed tensors or
// descriptors, NotFound for a key that is not published (without
// WaitForKey), PermissionDenied for a remote key the peer refuses,
// ResourceExhausted for a tensor over a limit (WithMaxTensorBytes, the
// pool's limit) or a full queue, Unavailable when the peer, the session or
// the data plane is gone, and the context's code for deadlines and
// cancellation. A local limit is never reported as Unavailable.
//
// Limits agree by default: a tensor may be up to DefaultMaxTensorBytes
// (1 GiB), and the pool a Server or Client makes for itself may grow to
// DefaultPoolLimit (4 GiB), mapping memory only as it grows.
//
// # Metadata, deadlines and interceptors
//
// A call carries what a gRPC call carries, however it travels (a frame on
// the data plane, a gRPC stream of the fallback, a unary method called by
// a gRPC-only client). The client sets metadata as for a gRPC call, with
// metadata.AppendToOutgoingContext or metadata.NewOutgoingContext
// (google.golang.org/grpc/metadata), and the handler reads it with
// metadata.FromIncomingContext; as in gRPC, keys are lower case and a key
// whose value is binary ends in "-bin". On a data plane a call carries at
// most MaxFrameMetadataBytes of it. The handler's context has the caller's
// deadline, and a call still running when it passes is cancelled on the
// server: the handler's context is done and the caller gets
// DeadlineExceeded. A handler that returns its context's error reports
// DeadlineExceeded or Canceled, as in gRPC.
//
// Interceptors (WithInterceptors, on a Client or a Server) see every
// Fetch, Send and Call, once each, whatever path it took, with a CallInfo
// (operation, key or method, peer, session, data plane, path, bytes) and
// the call's status; several chain in order, the first outermost, as
// grpc.ChainUnaryInterceptor chains. A client's interceptor may add
// outgoing metadata (trace context, say); a server's may put values into
// the context its handler gets. Interceptors that never block are given
// with WithInlineInterceptors, so that a server's small calls stay where
// their frames are read (see Inline). gRPC's own interceptors, given with
// WithGRPCServerOptions or WithGRPCDialOptions, see only the gRPC methods:
// session setup, the fallback's streams and the unary methods gRPC-only
// clients call.
//
// # Caveats
//
// A buffer published with PublishDeviceInPlace stays the caller's and must
// not be freed or written until UnpublishDevice returns (it waits for the
// clients copying it). A SendDevice over CUDA IPC that is cancelled may
// return while the server still copies from the buffer; reuse it only
// after a SendDevice that succeeded. A host Fetch already waiting
// (WaitForKey) for a key is not woken by a device publish of it. The
// sender's handles a server opens for SendDevice are cached by their bytes
// only: the sender names no allocation, so this relies on the driver
// giving a new allocation a new handle.
//
// Received tensors belong to the receiver's pool. A tensor is valid until
// its Release; after that its memory is reused for other tensors. Release
// every received tensor: the pool applies backpressure (allocation waits)
// when it is full, and Client.Close and Server.Close report buffers that
// are still outstanding.
//
// A handler's request tensors are released when the handler returns; to
// keep one, Publish it (which takes a reference) or copy it. The tensors of
// the handler's reply pass to tensorrpc.
//
// A handler's small calls (the request and its tensors in the frame) run
// where their frame is read, without a goroutine per call; a handler may
// still block or run long: the call is then left behind, the lane reading
// on in another goroutine, and the method's next calls get goroutines of
// their own for a while. Server.Handle, Inline and WithHandlerGoroutines
// say more.
//
// When a call's context ends while a one-sided operation is under way, the
// call returns at once but the buffers the operation uses are released only
// when it completes; a cancelled Send may still have delivered its tensor.
//
// A leased tensor is the server's memory: it must not be written, and it
// reflects later writes by the server to that buffer (a published tensor is
// not written by tensorrpc; do not write a tensor after publishing it).
//
// What a peer can make a Server hold is bounded. A peer is a client host
// (its gRPC connection's address without the port, and its TLS
// certificate), and WithAdmission sets its budgets, per peer and in total
// (defaults in DefaultAdmission): sessions (64 per peer, 1024 in all);
// data-plane lanes (64, 192), each with receive slots from a small control
// pool, so a full tensor pool never stops a new session from opening;
// fallback streams under way (64, 1024) and the bytes they hold — the
// tensors a SendStream or CallStream declares, the reply a FetchStream or
// CallStream is sending (2 GiB, 3 GiB); and unreleased transfers, each
// with its grant (4096 per session). Over a budget a request is refused at
// once with ResourceExhausted naming the budget, never queued on a pool: a
// session gets fewer lanes, then none. The per-peer budgets are well under
// the totals, so a host that takes all it may leaves room for new clients
// from other hosts; processes on one host share its budgets. A session
// that makes no call and holds nothing for Admission.IdleSession (10
// minutes) is ended, and its Client opens a new one on its next call.
// Stats counts what was refused (RefusedSessions, RefusedLanes,
// RefusedStreams, RefusedTransfers), and each refusal is logged at Info.
// The tensors a session's Sends and Calls bring in count against
// WithSessionQuota while they come (ResourceExhausted past it, for that
// session only); a client that leaves the server's read of its memory
// unanswered longer than WithReservationTimeout has its session ended; a
// fallback stream that makes no progress (delivers less than 64 KiB) for
// WithStreamIdleTimeout fails with DeadlineExceeded. A Client whose
// releases wait for credits the server withholds ends the session past
// 16384 of them. When a session ends, everything it held is freed except
// what its Sends published: a published tensor belongs to the rendezvous,
// like one the server published itself, until the next Send or Publish of
// its key, Unpublish or Take. Pool arenas that stay empty are unmapped every
// WithTrimInterval. A session belongs to the gRPC connection (and TLS
// identity) that opened it: naming it from elsewhere is PermissionDenied.
// GracefulStop ends calls waiting for a key with Unavailable and gives
// calls under way at most WithGracefulStopTimeout. The Server's grpc.Server
// answers the standard health service (grpc.health.v1.Health, for
// Kubernetes probes and grpc_health_probe): SERVING for "" and
// HealthService, NOT_SERVING from the moment Stop or GracefulStop begins
// (WithoutHealth leaves it off).
//
// A data-plane peer reaches only what a transfer grants it: pool arenas are
// registered for local access only, and each Location names a grant that
// opens one tensor's bytes to be read by that session's queue pair,
// revoked when the transfer ends (Release, answer, session end). No grant
// opens memory for writing: the receiver always pulls. Any other access is
// refused before a byte moves (PermissionDenied), and revoking waits for
// accesses already under way. On shm the peer process receives the pool arenas'
// memfds: grants stop a peer that forges keys, offsets or lengths, not a
// hostile process on the same host; between processes that do not trust
// each other, use tcp (WithTransports).
//
// Writes are visible to later reads: once Send (or a Call) returns, any
// later Fetch of that key, from any client, sees the tensor.
//
// Importing rpc changes nothing process-wide: the fallback's zero-copy
// codec is registered under its own content-subtype ("tensorrpc-chunk")
// and chosen per call, so other gRPC services in the process keep gRPC's
// own proto codec.
package rpc
