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
	// Data movement (data.go).
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

	// Remote and local errors (access.go).
	{"SendLargerThanRecv", testSendTooLarge},
	{"RemoteAccess", testRemoteAccess},
	{"LocalErrors", testLocalErrors},

	// Lifecycle (lifecycle.go).
	{"QPStates", testQPStates},
	{"InvalidInfo", testInvalidInfo},
	{"CloseFlushesOutstanding", testCloseFlushes},
	{"PeerCloseMidTransfer", testPeerClose},
	{"CQWaitContext", testCQWait},
	{"ErrClosedAfterClose", testErrClosed},
}

// Run runs the conformance suite against the provider env describes. Every
// case is a subtest that opens fresh domains, connects a pair of queue
// pairs, closes everything and checks that no goroutine is left behind.
// Cases run one after another, never in parallel, because the leak check
// looks at every goroutine of the process.
//
// Every wait in the suite is bounded (20 seconds), so a provider that loses
// a completion fails rather than hangs.
//
// Besides what verbs.go states, the suite holds providers to these
// InfiniBand semantics:
//
//   - a work request is outstanding, and counts against MaxSend or MaxRecv,
//     until its completion has been polled from its completion queue;
//   - PostSend before Connect fails with ErrNotConnected, while PostRecv
//     before Connect is allowed (receives may be ready before the peer can
//     send);
//   - every completion carries the request's ID and, on success, its opcode
//     and length (for sender completions the request's length);
//   - sends and receives complete in posting order;
//   - a remote access error is fatal: the requester's queue pair is in ERR
//     when the error completion is polled, and later posts fail with
//     ErrQPError or complete with StatusFlushed;
//   - a request refused by PostSend or PostRecv never completes; a request
//     with bad local memory is either refused or completes with an error;
//   - a Send with no receive posted at the peer waits for one (receiver not
//     ready) for longer than a few tens of milliseconds before failing;
//   - Close flushes every outstanding request exactly once, and closing
//     something twice returns nil or ErrClosed.
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
