package fallback

import (
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
)

// ReceiveIdle runs receive, which reads a client's stream through the
// receiver it is given, and fails the stream with DeadlineExceeded when
// it makes no progress (watchedReceiver) for idle: a client that declares
// a tensor and goes silent, or sends a byte at a time, holds its memory
// only that long. When it gives up, the handler returns; the stream's end
// then fails receive's pending read, and receive frees what it allocated
// (or, if it finished just then, discard is given its result). With idle
// 0 or less, ReceiveIdle is receive(r).
func ReceiveIdle[T any](r MsgReceiver, idle time.Duration, receive func(MsgReceiver) (T, error), discard func(T)) (T, error) {
	if idle <= 0 {
		return receive(r)
	}
	type result struct {
		v   T
		err error
	}
	w := &watchedReceiver{r: r}
	w.last.Store(time.Now().UnixNano())
	done := make(chan result, 1)
	go func() {
		v, err := receive(w)
		done <- result{v, err}
	}()
	tick := time.NewTicker(max(idle/4, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case res := <-done:
			return res.v, res.err
		case <-tick.C:
			if time.Since(time.Unix(0, w.last.Load())) > idle {
				go func() {
					if res := <-done; res.err == nil {
						discard(res.v)
					}
				}()
				var zero T
				return zero, status.Errorf(codes.DeadlineExceeded, "tensorrpc: the stream sent nothing for %v (the server's rpc.WithStreamIdleTimeout)", idle)
			}
		}
	}
}

// watchedReceiver records when the stream last made progress: when
// streamProgress bytes of data arrived since the time before, or the
// stream ended. Messages alone are no progress, so a client that sends a
// byte at a time within the idle timeout cannot hold its tensor's memory
// for ever.
type watchedReceiver struct {
	r        MsgReceiver
	last     atomic.Int64
	received int // data bytes since last
}

// streamProgress is the data a stream must deliver within each
// WithStreamIdleTimeout: 64 KiB.
const streamProgress = 64 << 10

func (w *watchedReceiver) RecvMsg(m any) error {
	err := w.r.RecvMsg(m)
	if in, ok := m.(*chunkcodec.InChunk); ok && err == nil {
		w.received += in.Len()
	}
	if err != nil || w.received >= streamProgress {
		w.received = 0
		w.last.Store(time.Now().UnixNano())
	}
	return err
}
