// Package softrc is the software reliable-connection core of the tcp and
// shm providers, in the style of libfabric's util layer: it owns the state
// of their protection domains and queue pairs and every behaviour of the
// verbs contract that does not depend on how bytes and doorbells move. A
// provider is a thin wire under it.
//
// # Core and wire
//
// A provider's domain embeds *Domain and its queue pair *QP; the queue
// pair implements Wire, which the core calls once it has done the
// contract's part of a verb:
//
//	verb            core (this package)                       wire
//	NewQueuePair    Domain.NewQP: checks, CQ room, secret, id  its info, listener
//	PostSend        checks, state, queue room (QP.PostSend)    PostSendUnlock
//	PostRecv        checks, state, room, Recvq                 PostRecvUnlock
//	Connect         QP.Connect: own-info check, who dials,     link: dial or
//	                RESET→INIT→RTS, ctx and Close              AcceptOffer, start
//	ERR             QP.FailLocked: state, cause, flush order   FailedLocked
//	Connect's start QP.Start: the connection, goroutines       its goroutines
//	Close           QP.Close: ERR, the connection closed and   Shutdown
//	                goroutines ended, flush, grants, CQ room
//	Domain.Close    accept loops, queue pairs, regions, CQs    (its regions)
//
// tcp's wire is its frame writer and reader over one TCP connection; shm's
// is its control ring, doorbells and copies into the peer's mapped
// regions, over a unix socket.
//
// # What the core holds
//
//   - Domain: the key table, completion queues, queue pairs by id (for
//     the handshake to find: Domain.Offer) and accept loops (Acceptor).
//   - QP: the state machine (RESET, INIT, RTS, ERR) and the cause of ERR;
//     the work queues Sendq (posted), Inflight (started) and Recvq
//     (posted receives) that a wire moves requests along, and their slots
//     (WorkQueue, including unsignaled requests, which keep their slot
//     until a later signaled completion of the same queue is polled); the
//     flush that completes what is left in ERR; offers of data
//     connections (Offer, AcceptOffer); WaitRecv, a receive with the RNR
//     timeout.
//   - The flush order, in one place (WorkQueue.Fail): once a queue pair is
//     in ERR, the first send completion that fails carries the error (the
//     status given to FailLocked, e.g. StatusTransport when the connection
//     was lost) and every later one, and every receive, is StatusFlushed.
//   - CQ: a completion queue with a capacity that queue pairs reserve
//     (NewQueuePair fails with ErrQueueFull instead of a queue growing),
//     and that runs its completions where they are produced
//     (verbs.CompletionRunner: a wire's receiver Queues them and, with no
//     locks held, hands them over itself with QP.Deliver).
//   - Table, Region, Grant: regions and per-transfer grants sharing one
//     random 32-bit key space, and the access checks a target makes before
//     it touches memory.
//   - CheckSends, CheckRecvs, Vec: post-time validation of work requests
//     (opcode, segments, rights, bounds, limits), and the gather/scatter
//     copies of their local segments.
//   - RecvWR.Fit, Vec.Hold, Refused, QP.AckLocked, QP.Ack, InWindow: the
//     responder's and requester's rules for a Send landing in a receive,
//     memory deregistered under a request, what a responder's refusal
//     means, the in-order completion of started requests by cumulative
//     acknowledgements (and the failure a refusal brings), and the bounds
//     and rights of every remote access (checked at tcp's target, and at
//     shm's initiator against what the peer announced).
//   - Info, Secret, Hello, ShouldDial, QP.Dial, Bounded, Acceptor,
//     Domain.Admit: the connection info (LocalInfo) and the handshake:
//     one-time secrets, the dialer's hello, who dials, a dialer's exchange
//     bounded by its context, accept loops and the admission of an
//     accepted connection to the queue pair it names.
//   - QP.Start, CloseConn, Closing, InError: the wire's connection and
//     goroutines, which Close ends (and the last goroutine to return
//     closes the connection), and lock-free looks at Close and ERR.
//   - Provider: the provider and its one device (Devices, Open).
//   - contract.go: the checks and errors that do not depend on how queues
//     or memory are kept (PostError, QPErrorf, QueueSizes, CheckOpcode,
//     ...), which ibv uses too, so that all three providers refuse the
//     same things with the same errors, naming the queue pair and, in
//     ERR, its cause.
//
// The contract the providers implement is in package verbs (doc.go); this
// package holds one answer for each of its behaviours.
package softrc

// Limits shared by the software providers.
const (
	// MaxSegments is the most local segments of one work request.
	MaxSegments = 16
	// MaxQueueDepth is the largest MaxSend or MaxRecv of a queue pair.
	MaxQueueDepth = 1 << 16
	// DefaultQueueDepth is MaxSend and MaxRecv when the config leaves
	// them zero.
	DefaultQueueDepth = 1024
)
