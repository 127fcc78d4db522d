// Package softrc is the software reliable-connection core that the tcp and
// shm providers share: everything about a queue pair that does not depend
// on how bytes and doorbells move between the peers.
//
//   - CQ: a completion queue with a capacity that queue pairs reserve
//     (NewQueuePair fails with ErrQueueFull instead of a queue growing).
//   - WorkQueue: the outstanding-request accounting of a send or receive
//     queue, including unsignaled requests, which keep their slot until a
//     later signaled completion of the same queue is polled.
//   - Table, Region, Grant: the key table of a protection domain, with
//     regions and per-transfer grants sharing one random 32-bit key space,
//     and the access checks a target makes before it touches memory.
//   - CheckSend, CheckRecv, Vec: post-time validation of work requests
//     (opcode, segments, rights, bounds, limits), and the gather/scatter
//     copies of their local segments; CheckSends and CheckRecvs check all
//     the requests of one post.
//   - Reserve, Reservation: the checks of NewQueuePair and the room its
//     queue pair reserves in its completion queues.
//   - NewDomainCQ: NewCompletionQueue of a domain; Table.GrantFor:
//     QueuePair.Grant.
//   - BeginClose: the start of an idempotent Close.
//   - PostError: the error every post returns for a queue pair that is
//     closed, in ERR or not connected.
//   - Secret, ShouldDial, Acceptor: the connection handshake shared by
//     both providers (one-time secrets, who dials, accept loops).
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
