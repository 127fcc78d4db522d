package verbstest

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// testCase is one conformance case.
type testCase struct {
	name string
	run  func(t *testing.T, env Env)
}

// cases lists the conformance cases in the order Run runs them.
var cases = []testCase{
	// Attributes (features.go).
	{"Attributes", testAttributes},

	// Data movement (data.go, features.go, ordering.go).
	{"Write", testWrite},
	{"WriteImmOrdering", testWriteImmOrdering},
	{"Read", testRead},
	{"SendRecv", testSendRecv},
	{"SendWithImm", testSendWithImm},
	{"RecvPostedBeforeConnect", testRecvBeforeConnect},
	{"SharedCompletionQueue", testSharedCQ},
	{"ZeroLength", testZeroLength},
	{"ConcurrentPosts", testConcurrentPosts},
	{"CreditLoop", testCreditLoop},
	{"TwoQueuePairs", testTwoQueuePairs},
	{"ScatterGather", testScatterGather},
	{"Unsignaled", testUnsignaled},
	{"UnsignaledFailure", testUnsignaledFailure},
	{"Fence", testFence},
	{"OutstandingReads", testOutstandingReads},
	{"DetachDelivery", testDetach},

	// Posting: checks at post time, all or none (posting.go, features.go).
	{"LocalErrors", testLocalErrors},
	{"AllOrNone", testAllOrNone},
	{"TooLarge", testTooLarge},

	// Remote errors and grants (access.go, grants.go).
	{"SendLargerThanRecv", testSendTooLarge},
	{"RemoteAccess", testRemoteAccess},
	{"Grants", testGrants},

	// Mappings of the peer's memory, where supported (mapper.go).
	{"RemoteMapper", testRemoteMapper},

	// Lifecycle (lifecycle.go, closing.go).
	{"QPStates", testQPStates},
	{"InvalidInfo", testInvalidInfo},
	{"CQReservation", testCQReservation},
	{"CloseFlushesOutstanding", testCloseFlushes},
	{"PeerCloseMidTransfer", testPeerClose},
	{"CQWaitContext", testCQWait},
	{"ErrClosedAfterClose", testErrClosed},
}

// Run runs the conformance suite against the provider env describes. Every
// case is a subtest that opens fresh domains, connects a pair of queue
// pairs (and proves the connection with RoundTrip), closes everything and
// checks that no goroutine is left behind. Cases run one after another,
// never in parallel, because the leak check looks at every goroutine of
// the process.
//
// Every wait in the suite is bounded (20 seconds), so a provider that loses
// a completion fails rather than hangs.
//
// The suite checks the contract of package verbs (doc.go), with one answer
// per behaviour. Where the contract leaves a detail open, the suite holds
// providers to these InfiniBand semantics:
//
//   - a work request is outstanding, and counts against MaxSend or MaxRecv,
//     until its completion has been polled from its completion queue; an
//     unsignaled request, until the completion of a later signaled request
//     of its queue pair has been polled;
//   - PostSend before Connect fails with ErrNotConnected, while PostRecv
//     before Connect is allowed (receives may be ready before the peer can
//     send);
//   - every completion carries the request's ID and, on success, its opcode
//     and length (for sender completions the request's length);
//   - a request refused by PostSend or PostRecv leaves the queue pair in
//     its state (RTS stays RTS) and usable;
//   - a remote access error is fatal to both queue pairs: the requester's
//     queue pair is in ERR when the error completion is polled, the
//     target's goes to ERR and flushes its posted receives, and later posts
//     on either fail with ErrQPError;
//   - when the peer's queue pair or domain closes under outstanding work,
//     the first request that fails completes with StatusTransport and the
//     rest are flushed;
//   - a Send with no receive posted at the peer waits for one (receiver not
//     ready) for longer than a few tens of milliseconds before failing;
//   - Close flushes every outstanding request exactly once, in order.
//
// A Grant is made by the target's queue pair on a region registered with
// local write only (no remote right), as doc.go recommends.
func Run(t *testing.T, env Env) {
	t.Helper()
	if env.Open == nil || env.NewMemory == nil {
		t.Fatal("verbstest: Env needs Open and NewMemory")
	}
	if env.Name == "" {
		env.Name = "provider"
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			c.run(t, env)
		})
	}
}
