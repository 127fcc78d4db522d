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
//	srv.Publish("weights", w)
//	srv.Handle("scale", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) { ... })
//
//	c, _ := rpc.Dial(ctx, addr)
//	defer c.Close()
//	t, _ := c.Fetch(ctx, "weights") // waits until "weights" is published
//	defer t.Release()
//	_ = c.Send(ctx, "grad", g)       // into the server's rendezvous
//	reply, _ := c.Call(ctx, "scale", &rpc.Message{Tensors: []*rpc.Tensor{t}})
//	defer reply.Release()
//
// Dial negotiates the data plane: the client offers every plane it can
// open, the server picks the first both can use in the order ibv > shm >
// tcp, both connect it, and if that fails the next is tried, down to the
// gRPC fallback. Client.Transport says which plane a session uses and
// Client.Rejections why the others were not used. WithTransports restricts
// the choice.
//
// How bytes move, and the copies this side makes (Stats counts them):
//
//   - Tensors up to the eager threshold (DefaultEagerThreshold) travel
//     inside the control message: one copy into it, one out of it.
//   - Fetch: the server returns a descriptor of its pool buffer; the client
//     reads it with one one-sided Read into its own pool buffer (no CPU copy
//     on tcp's receive path beyond the socket, one memcpy on shm) and then
//     releases the server's buffer.
//   - Send and Call: the server allocates the destination; the client writes
//     into it with WriteImm, whose immediate value completes the transfer.
//   - Fetch with Lease on shm: the tensor is the server's memory mapped into
//     the client, no copy at all, until the tensor is released.
//   - The gRPC fallback streams chunks that view pool memory (no copy of
//     ours on send; gRPC's transport copies into its frames) and copies once
//     out of gRPC's buffers on receive.
//   - A tensor over caller memory (WrapTensor) is copied once into pool
//     memory before it moves; NewTensor allocates pool memory to avoid that.
//
// Errors carry gRPC status codes: InvalidArgument for malformed tensors or
// descriptors, PermissionDenied for a remote key the peer refuses,
// ResourceExhausted for tensors over the limit, Unavailable when the peer or
// the data plane is gone, and the context's code for deadlines and
// cancellation.
//
// # Caveats
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
// When a call's context ends while a one-sided operation is under way, the
// call returns at once but the buffers the operation uses are released only
// when it completes; a cancelled Send may still have delivered its tensor.
//
// A leased tensor is the server's memory: it must not be written, and it
// reflects later writes by the server to that buffer (a published tensor is
// not written by tensorrpc; do not write a tensor after publishing it).
//
// The tcp data plane listens on 127.0.0.1 by default; for sessions across
// hosts, give both sides a tcp provider with a reachable address
// (WithProvider(tcp.New(tcp.WithListenAddress(...)))).
package rpc
