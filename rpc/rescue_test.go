package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// frameTransports are the planes whose calls travel as frames, where a
// handler can run where its frame is read.
var frameTransports = []string{rpc.TransportTCP, rpc.TransportSHM}

// TestHandlersRunWhereFramesAreRead: a handler not registered Inline runs
// where its call's frame was read when the request came in the frame,
// and on a goroutine of its own when it did not (a request tensor past
// the eager threshold, which is pulled) or when the Server was given
// WithHandlerGoroutines; every call answers the same.
func TestHandlersRunWhereFramesAreRead(t *testing.T) {
	for _, tr := range frameTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			var here atomic.Bool
			s.Handle("plain", inlineEcho(s, &here, 0))
			// A long call (past engine.LongCall: a slow machine, the race
			// detector) sends the next ones to goroutines (TestHandlerPace,
			// TestLongCallPace): even if every call is long, the first
			// runs where its frame was read, and one of the next four.
			var where []bool
			for range 5 {
				callBytes(t, c, "plain", 4<<10)
				where = append(where, here.Load())
			}
			if !where[0] || !slices.Contains(where[1:], true) {
				t.Fatalf("where five calls of a handler with a 4 KiB request ran (true: where the frame was read): %v", where)
			}
			callBytes(t, c, "plain", 1<<20)
			if here.Load() {
				t.Fatal("a handler whose 1 MiB request tensor is pulled ran where frames are read")
			}
		})
		t.Run(tr+"/goroutines", func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithHandlerGoroutines()}, nil)
			var here atomic.Bool
			s.Handle("plain", inlineEcho(s, &here, 0))
			callBytes(t, c, "plain", 4<<10)
			if here.Load() {
				t.Fatal("with WithHandlerGoroutines, a handler ran where frames are read")
			}
		})
	}
}

// TestBlockingHandlerLeftBehind: on one lane, a handler that waits for
// what only the same lane can bring (another call of the same client, or
// its own nested call to the same server) would wait forever where its
// frame was read; the lane's receiving moves on without it
// (engine.RescueAfter), and every call completes.
func TestBlockingHandlerLeftBehind(t *testing.T) {
	for _, tr := range frameTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithLanes(1)}, []rpc.DialOption{rpc.WithLanes(1)})
			waitThenOpen(t, s, c)
			s.Handle("inner", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				return &rpc.Message{Metadata: append([]byte("inner "), in.Metadata...)}, nil
			})
			s.Handle("outer", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				// A nested call over the same session and lane.
				return c.Call(ctx, "inner", &rpc.Message{Metadata: in.Metadata})
			})
			ctx := ctxT(t)
			for i := range 3 {
				reply, err := c.Call(ctx, "outer", &rpc.Message{Metadata: []byte(fmt.Sprint(i))})
				if err != nil {
					t.Fatalf("a handler's nested call over its own lane: %v", err)
				}
				if want := fmt.Sprint("inner ", i); string(reply.Metadata) != want {
					t.Fatalf("nested call: reply %q, want %q", reply.Metadata, want)
				}
				reply.Release()
			}
		})
	}
}

// waitThenOpen registers "wait", a handler that waits until "open" is
// called, calls it, and calls "open" from this goroutine while it waits:
// on one lane, only a lane that moved on without "wait" reads "open". It
// reports whether "wait" ran where its frame was read.
func waitThenOpen(t *testing.T, s *rpc.Server, c *rpc.Client) (here bool) {
	t.Helper()
	var ranHere atomic.Bool
	open := make(chan struct{})
	s.Handle("wait", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		ranHere.Store(ranWhereFramesAreRead())
		select {
		case <-open:
			return &rpc.Message{Metadata: []byte("waited")}, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	})
	s.Handle("open", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		close(open)
		return &rpc.Message{}, nil
	})
	ctx := ctxT(t)
	waited := make(chan error, 1)
	go func() {
		reply, err := c.Call(ctx, "wait", &rpc.Message{})
		if err == nil {
			if string(reply.Metadata) != "waited" {
				err = fmt.Errorf("reply %q", reply.Metadata)
			}
			reply.Release()
		}
		waited <- err
	}()
	// Give "wait" time to start holding the lane's receiver.
	time.Sleep(5 * time.Millisecond)
	reply, err := c.Call(ctx, "open", &rpc.Message{})
	if err != nil {
		t.Fatalf("a call behind a blocked handler on its lane: %v", err)
	}
	reply.Release()
	if err := <-waited; err != nil {
		t.Fatalf("the blocked handler's call: %v", err)
	}
	return ranHere.Load()
}

// TestLeftBehindWhereQueuesAreWaitedOn: on a server whose completion
// queues are polled with Wait (as ibv's are: no provider receiver to hand
// over; hookProvider.WaitOnly over tcp), a handler's call still runs where
// its frame was read, and one that waits for the next call of its lane is
// left behind, the engine starting another poller.
func TestLeftBehindWhereQueuesAreWaitedOn(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithLanes(1), rpc.WithProvider(hookProvider{Provider: tcp.New(), WaitOnly: true})}, []rpc.DialOption{rpc.WithLanes(1)})
	if !waitThenOpen(t, s, c) {
		t.Fatal("the handler ran on a goroutine of its own")
	}
	if n := s.Stats().LeftBehind; n != 1 {
		t.Fatalf("Stats.LeftBehind %d, want 1", n)
	}
}

// TestHandlerPace: a handler whose call was left behind where its frame
// was read (here: it waits for the next call of its lane) has its next
// call run on a goroutine of its own (checkPaced); a later one runs where
// its frame was read again. Stats.LeftBehind counts the one left behind.
func TestHandlerPace(t *testing.T) {
	for _, tr := range frameTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithLanes(1)}, []rpc.DialOption{rpc.WithLanes(1)})
			var mu sync.Mutex
			var where []bool
			first := true
			open := make(chan struct{})
			s.Handle("open", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				close(open)
				return &rpc.Message{}, nil
			})
			s.Handle("m", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				mu.Lock()
				where = append(where, ranWhereFramesAreRead())
				f := first
				first = false
				mu.Unlock()
				if f {
					<-open // only the lane, moved on, can read the call that opens it
				}
				return &rpc.Message{}, nil
			})
			ctx := ctxT(t)
			opened := make(chan error, 1)
			go func() {
				time.Sleep(5 * time.Millisecond)
				reply, err := c.Call(ctx, "open", &rpc.Message{})
				if err == nil {
					reply.Release()
				}
				opened <- err
			}()
			for range 5 {
				reply, err := c.Call(ctx, "m", &rpc.Message{})
				if err != nil {
					t.Fatal(err)
				}
				reply.Release()
			}
			if err := <-opened; err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			checkPaced(t, where)
			if n := s.Stats().LeftBehind; n < 1 {
				t.Fatalf("Stats.LeftBehind %d, want at least 1", n)
			}
		})
	}
}

// TestHandlersLeftBehindUnderLoad: callers on one lane, side by side,
// call handlers that return at once, sleep past the rescue, or wait for a
// call of another caller; every reply is its request's, and the session
// ends clean (pair's cleanup checks goroutines and pool memory).
func TestHandlersLeftBehindUnderLoad(t *testing.T) {
	for _, tr := range frameTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithLanes(1)}, []rpc.DialOption{rpc.WithLanes(1)})
			tick := make(chan struct{}, 1024)
			echo := func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				o, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(len(in.Tensors[0].Bytes()))})
				if err != nil {
					return nil, err
				}
				copy(o.Bytes(), in.Tensors[0].Bytes())
				return &rpc.Message{Metadata: in.Metadata, Tensors: []*rpc.Tensor{o}}, nil
			}
			s.Handle("quick", echo)
			s.Handle("sleep", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				time.Sleep(300 * time.Microsecond)
				return echo(ctx, in)
			})
			s.Handle("give", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				tick <- struct{}{}
				return echo(ctx, in)
			})
			s.Handle("take", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				select {
				case <-tick:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
				return echo(ctx, in)
			})
			methods := []string{"quick", "sleep", "give", "take"}
			const callers, calls = 4, 60
			var wg sync.WaitGroup
			errs := make(chan error, callers)
			for g := range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range calls {
						// Caller g calls methods[g] only: the takers'
						// ticks come from the givers.
						m := methods[g]
						b := make([]byte, 512+i)
						pattern(b, byte(g*calls+i))
						meta := []byte(fmt.Sprint(g, "/", i))
						reply, err := c.Call(ctxT(t), m, &rpc.Message{Metadata: meta, Tensors: []*rpc.Tensor{rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{int64(len(b))}, b))}})
						if err != nil {
							errs <- fmt.Errorf("%s call %d: %v", m, i, err)
							return
						}
						ok := bytes.Equal(reply.Metadata, meta) && len(reply.Tensors) == 1 && bytes.Equal(reply.Tensors[0].Bytes(), b)
						reply.Release()
						if !ok {
							errs <- fmt.Errorf("%s call %d: the reply is not its request's", m, i)
							return
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

// TestSendLeftBehind: a small Send runs where its frame is read; one that
// waits there for pool memory (the pool is full) is left behind, and the
// lane serves another call meanwhile; the Send completes once memory
// frees. Stats.LeftBehind counts it.
func TestSendLeftBehind(t *testing.T) {
	for _, tr := range frameTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithLanes(1), rpc.WithPoolOptions(mempool.WithArenaSize(4<<20), mempool.WithLimit(8<<20))}, []rpc.DialOption{rpc.WithLanes(1)})
			ctx := ctxT(t)
			publishBytes(t, s, "small", 4<<10, 1)
			// Fill the pool.
			var hogs []*rpc.Tensor
			for _, n := range []int64{1 << 20, 64 << 10, 4 << 10, 256} {
				for {
					short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
					h, err := s.NewTensor(short, zerocopy.Uint8, []int64{n})
					cancel()
					if err != nil {
						break
					}
					hogs = append(hogs, h)
				}
			}
			b := make([]byte, 4<<10)
			pattern(b, 3)
			sent := make(chan error, 1)
			go func() { sent <- c.Send(ctx, "sent", rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{4 << 10}, b))) }()
			// Until the Send waits for pool memory where its frame was read
			// (a fixed 5 ms was too short for a loaded CI machine now and
			// then: the Send arrived after the memory had freed, and nothing
			// was left behind).
			for deadline := time.Now().Add(10 * time.Second); s.Pool().Stats().Waiting < 1 && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
			got, err := c.Fetch(ctx, "small")
			if err != nil {
				t.Fatalf("a Fetch on the lane of a Send waiting for pool memory: %v", err)
			}
			got.Release()
			select {
			case err := <-sent:
				t.Fatalf("the Send into a full pool returned (%v) before memory freed", err)
			default:
			}
			for _, h := range hogs {
				h.Release()
			}
			if err := <-sent; err != nil {
				t.Fatalf("Send: %v", err)
			}
			back, err := s.Take(ctx, "sent")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Bytes(), b) {
				t.Error("the Send's bytes differ")
			}
			back.Release()
			// The Send is counted once it has answered (the engine's
			// Pacer hears it after its work): maybe after the client has
			// the answer.
			for deadline := time.Now().Add(10 * time.Second); s.Stats().LeftBehind < 1 && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
			if n := s.Stats().LeftBehind; n < 1 {
				t.Fatalf("Stats.LeftBehind %d, want at least 1", n)
			}
		})
	}
}

// TestLongCallPace: a call that took longer than engine.LongCall where its
// frame was read, without being left behind, also sends its method's next
// call to a goroutine: the calls behind it on its lane waited for it.
func TestLongCallPace(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, nil, nil)
	var mu sync.Mutex
	var where []bool
	s.Handle("long", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
		mu.Lock()
		where = append(where, ranWhereFramesAreRead())
		first := len(where) == 1
		mu.Unlock()
		if first {
			time.Sleep(2 * engine.LongCall)
		}
		return &rpc.Message{}, nil
	})
	for range 5 {
		reply, err := c.Call(ctxT(t), "long", &rpc.Message{})
		if err != nil {
			t.Fatal(err)
		}
		reply.Release()
	}
	mu.Lock()
	defer mu.Unlock()
	checkPaced(t, where)
}

// checkPaced checks where a method's calls ran (true: where the frame was
// read) after its first was long: the first there, one of the next two on
// a goroutine (the penalty; the second when the call it follows was let
// in while the long one's goroutine was still noting it, or when the long
// one was left behind and the lane moved on before), and a later one
// there again (a short call ends the penalty; even if every call were
// long, the third or the fourth).
func checkPaced(t *testing.T, where []bool) {
	t.Helper()
	if len(where) != 5 || !where[0] || !slices.Contains(where[1:3], false) || !slices.Contains(where[2:], true) {
		t.Fatalf("where the calls ran (true: where the frame was read): %v; want the first there, one of the next two on a goroutine, a later one there", where)
	}
}
