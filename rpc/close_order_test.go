package rpc_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// closeWatch wraps a provider so that closing its protection domain (the
// client's data-plane device) closes closed.
type closeWatch struct {
	verbs.Provider
	closed chan struct{}
	once   *sync.Once
}

func newCloseWatch(p verbs.Provider) closeWatch {
	return closeWatch{Provider: p, closed: make(chan struct{}), once: new(sync.Once)}
}

func (p closeWatch) Open(name string) (verbs.ProtectionDomain, error) {
	pd, err := p.Provider.Open(name)
	if err != nil {
		return nil, err
	}
	return closeWatchDomain{pd, p}, nil
}

type closeWatchDomain struct {
	verbs.ProtectionDomain
	w closeWatch
}

func (d closeWatchDomain) Close() error {
	d.w.once.Do(func() { close(d.w.closed) })
	return d.ProtectionDomain.Close()
}

// blockingHandler waits for its call's end, saying when it has begun.
func blockingHandler(entered chan<- struct{}) rpc.Handler {
	return func(ctx context.Context, _ *rpc.Message) (*rpc.Message, error) {
		entered <- struct{}{}
		<-ctx.Done()
		return nil, ctx.Err()
	}
}

// TestCloseWaitsForCallsBeforeDevices: Client.Close ends the session, so a
// call under way fails, and closes the data plane's device only once that
// call has returned (the call may still use the device's memory). The
// client's interceptor holds the failed call for a while after it failed;
// the device must not close meanwhile.
func TestCloseWaitsForCallsBeforeDevices(t *testing.T) {
	for _, tc := range []struct {
		plane    string
		provider func() verbs.Provider
	}{{rpc.TransportTCP, func() verbs.Provider { return tcp.New() }}, {rpc.TransportSHM, func() verbs.Provider { return shm.New() }}} {
		t.Run(tc.plane, func(t *testing.T) {
			w := newCloseWatch(tc.provider())
			var closedDuringCall atomic.Bool
			hold := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				err := next(ctx)
				select {
				case <-w.closed:
					closedDuringCall.Store(true)
				case <-time.After(200 * time.Millisecond):
				}
				return err
			}
			e := start(t, tc.plane, nil, []rpc.DialOption{rpc.WithProvider(w), rpc.WithInterceptors(hold)})
			entered := make(chan struct{}, 1)
			e.srv.Handle("block", blockingHandler(entered))
			errc := make(chan error, 1)
			go func() {
				_, err := e.c.Call(testCtx(t), "block", &rpc.Message{})
				errc <- err
			}()
			<-entered
			if err := e.c.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			if err := <-errc; status.Code(err) != codes.Unavailable && status.Code(err) != codes.Canceled {
				t.Errorf("a call under way at Close: %v, want Unavailable or Canceled", err)
			}
			if closedDuringCall.Load() {
				t.Error("Close closed the data plane's device while a call was still under way")
			}
			select {
			case <-w.closed:
			default:
				t.Error("Close did not close the data plane's device")
			}
		})
	}
}

// TestCloseCancelsStreamCalls: a call on the gRPC fallback travels on a
// stream of its own, which the session's end does not end; Close cancels
// it, and waits for the call to end, buffers given back, before it
// returns. An interceptor holds the failed call a while, and records when
// it lets go: that is inside the call, so Close must return after it (a
// flag set where Call returns to its caller would race Close's return).
func TestCloseCancelsStreamCalls(t *testing.T) {
	var ended atomic.Bool
	hold := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		err := next(ctx)
		time.Sleep(100 * time.Millisecond)
		ended.Store(true)
		return err
	}
	e := start(t, rpc.TransportGRPC, nil, []rpc.DialOption{rpc.WithInterceptors(hold)})
	entered := make(chan struct{}, 1)
	e.srv.Handle("block", blockingHandler(entered))
	errc := make(chan error, 1)
	go func() {
		// Caller memory: the call copies it into pool buffers it holds
		// until it returns.
		x, err := zerocopy.New(zerocopy.Uint8, []int64{64 << 10}, make([]byte, 64<<10))
		if err != nil {
			errc <- err
			return
		}
		_, err = e.c.Call(testCtx(t), "block", &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(x)}})
		errc <- err
	}()
	<-entered
	if st := e.c.Pool().Stats(); st.InUse == 0 {
		t.Error("the blocked call holds no pool buffer")
	}
	if err := e.c.Close(); err != nil {
		t.Errorf("Close: %v", err) // the pool's Close reports buffers still live
	}
	if !ended.Load() {
		t.Error("Close returned before the stream call under way ended")
	}
	if st := e.c.Pool().Stats(); st.InUse != 0 {
		t.Errorf("Close returned while the stream call under way still held %d bytes of pool buffers", st.InUse)
	}
	if err := <-errc; status.Code(err) != codes.Canceled && status.Code(err) != codes.Unavailable {
		t.Errorf("a stream call under way at Close: %v, want Canceled or Unavailable", err)
	}
}

// breakHook wraps a provider: armed, the next PostSend of its queue pairs
// closes the queue pair under it (the data plane breaks) and that queue
// pair's Close then waits for release.
type breakHook struct {
	verbs.Provider
	armed   *atomic.Bool
	closing chan struct{} // closed when the broken queue pair's Close begins
	release chan struct{}
}

func newBreakHook(p verbs.Provider) breakHook {
	return breakHook{Provider: p, armed: new(atomic.Bool), closing: make(chan struct{}), release: make(chan struct{})}
}

func (p breakHook) Open(name string) (verbs.ProtectionDomain, error) {
	pd, err := p.Provider.Open(name)
	if err != nil {
		return nil, err
	}
	return breakHookDomain{pd, p}, nil
}

type breakHookDomain struct {
	verbs.ProtectionDomain
	h breakHook
}

func (d breakHookDomain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	qp, err := d.ProtectionDomain.NewQueuePair(cfg)
	if err != nil {
		return nil, err
	}
	return &breakHookQP{QueuePair: qp, h: d.h}, nil
}

type breakHookQP struct {
	verbs.QueuePair
	h      breakHook
	broken atomic.Bool
}

func (q *breakHookQP) PostSend(wrs ...verbs.SendRequest) error {
	if q.h.armed.CompareAndSwap(true, false) {
		q.broken.Store(true)
		q.QueuePair.Close()
		return errors.New("broken by the test")
	}
	return q.QueuePair.PostSend(wrs...)
}

func (q *breakHookQP) Close() error {
	if q.broken.Load() {
		close(q.h.closing)
		<-q.h.release
	}
	return q.QueuePair.Close()
}

// TestCloseWaitsForReplacedSession: a session whose data plane broke is
// replaced by a new one at the next call while the old one is still
// closing its lanes; Client.Close waits for that old session too, so
// that its lanes' memory is back when Close returns.
func TestCloseWaitsForReplacedSession(t *testing.T) {
	h := newBreakHook(tcp.New())
	e := start(t, rpc.TransportTCP, nil, []rpc.DialOption{rpc.WithProvider(h), rpc.WithLanes(1)})
	x, err := e.srv.NewTensor(testCtx(t), zerocopy.Uint8, []int64{100})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.srv.Publish(testCtx(t), "k", x); err != nil {
		t.Fatal(err)
	}
	x.Release()
	h.armed.Store(true)
	if _, err := e.c.Fetch(testCtx(t), "k"); status.Code(err) != codes.Unavailable {
		t.Fatalf("a Fetch on a broken data plane: %v, want Unavailable", err)
	}
	<-h.closing // the old session's lane is closing, and stays so until release
	var got *rpc.Tensor
	for deadline := time.Now().Add(20 * time.Second); got == nil; {
		if got, err = e.c.Fetch(testCtx(t), "k"); err != nil {
			if time.Now().After(deadline) {
				t.Fatalf("a Fetch on a new session: %v", err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	got.Release()
	closed := make(chan error, 1)
	go func() { closed <- e.c.Close() }()
	select {
	case err := <-closed:
		close(h.release)
		t.Fatalf("Close returned (%v) while an ended session was still closing its lanes", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(h.release)
	if err := <-closed; err != nil {
		t.Errorf("Close: %v", err)
	}
}
