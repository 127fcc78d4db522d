// Package rpctest holds what rpc's white-box tests (package rpc) and its
// black-box tests (package rpc_test) share and that does not need package
// rpc itself: byte patterns, waiting, a provider wrapper that hooks the
// data plane's posts, gRPC call counters and a raw protocol client. It is
// for tests only.
package rpctest

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/ibv"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// Context is a context that ends with the test, or after a minute.
func Context(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Pattern fills b with bytes that depend on seed and position.
func Pattern(b []byte, seed byte) {
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
}

// Fill writes Pattern quickly, also under the race detector: a small
// pattern block, then doubling copies.
func Fill(b []byte, seed byte) {
	n := min(len(b), 1<<16)
	Pattern(b[:n], seed)
	for n < len(b) {
		n += copy(b[n:], b[:n])
	}
}

// WaitFor polls cond until it holds; after 30 seconds it fails the test,
// naming what it waited for.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Provider is the default provider of the data plane named transport
// ("ibv", "shm", "tcp"), as package rpc makes it; nil for other names.
func Provider(transport string) verbs.Provider {
	switch transport {
	case "ibv":
		return ibv.New()
	case "shm":
		return shm.New()
	case "tcp":
		return tcp.New(tcp.WithLogger(slog.New(slog.DiscardHandler)))
	}
	return nil
}

// SkipWithoutDevice skips the test when transport's provider has no device
// here, with the provider's own explanation. Other names never skip.
func SkipWithoutDevice(t testing.TB, transport string) {
	t.Helper()
	if p := Provider(transport); p != nil {
		if _, err := p.Devices(); err != nil {
			t.Skipf("no %s device: %v", transport, err)
		}
	}
}

// HookProvider wraps a provider so that every PostSend of its queue
// pairs first runs OnPost, which may fail it.
type HookProvider struct {
	verbs.Provider
	OnPost func(verbs.SendRequest) error
	// WaitOnly hides the completion queues' verbs.CompletionRunner (and
	// verbs.Detacher): they are polled with Wait, as ibv's are.
	WaitOnly bool
}

// Open opens the wrapped provider's device, with hooked queue pairs.
func (p HookProvider) Open(name string) (verbs.ProtectionDomain, error) {
	pd, err := p.Provider.Open(name)
	if err != nil {
		return nil, err
	}
	onPost := p.OnPost
	if onPost == nil {
		onPost = func(verbs.SendRequest) error { return nil }
	}
	return hookDomain{pd, onPost, p.WaitOnly}, nil
}

type hookDomain struct {
	verbs.ProtectionDomain
	onPost   func(verbs.SendRequest) error
	waitOnly bool
}

// waitCQ is a completion queue with its CompletionRunner hidden.
type waitCQ struct{ verbs.CompletionQueue }

func (d hookDomain) NewCompletionQueue(capacity int) (verbs.CompletionQueue, error) {
	cq, err := d.ProtectionDomain.NewCompletionQueue(capacity)
	if err != nil || !d.waitOnly {
		return cq, err
	}
	return waitCQ{cq}, nil
}

func (d hookDomain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	for _, cq := range []*verbs.CompletionQueue{&cfg.SendCQ, &cfg.RecvCQ} {
		if w, ok := (*cq).(waitCQ); ok {
			*cq = w.CompletionQueue // the provider's own
		}
	}
	qp, err := d.ProtectionDomain.NewQueuePair(cfg)
	if err != nil {
		return nil, err
	}
	return hookQP{qp, d.onPost}, nil
}

type hookQP struct {
	verbs.QueuePair
	onPost func(verbs.SendRequest) error
}

func (q hookQP) PostSend(wrs ...verbs.SendRequest) error {
	for _, wr := range wrs {
		if err := q.onPost(wr); err != nil {
			return err
		}
	}
	return q.QueuePair.PostSend(wrs...)
}

// RawConn is a plain gRPC connection to addr, as an attacker's client
// would open: the .proto and nothing else. It closes when the test ends.
func RawConn(t testing.TB, addr string) pb.TensorRPCClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return pb.NewTensorRPCClient(cc)
}
