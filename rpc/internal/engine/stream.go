package engine

import (
	"context"
	"errors"

	"google.golang.org/grpc/status"
)

// StreamReader is the one reader of a session's gRPC stream, for the
// stream's life: during the negotiation Next hands out the peer's
// messages; the stream's end is the session's end. Nothing is expected
// once the session is open, so a message that finds the queue full is
// dropped (only a confused peer sends it) rather than keep the reader
// from seeing the end.
type StreamReader[T any] struct {
	in    chan T
	stop  <-chan struct{}
	ended chan struct{}
	err   error // why the stream ended; set before in is closed
}

// ErrStopped is Next's error once the reader's stop channel is closed.
var ErrStopped = errors.New("tensorrpc: stopped")

// ReadStream starts reading with recv until recv fails. Once stop (nil:
// never) is closed, Next fails with ErrStopped. atEnd (nil: nothing) runs
// with recv's error when the stream has ended, before Next and Ended see
// the end.
func ReadStream[T any](recv func() (T, error), stop <-chan struct{}, atEnd func(error)) *StreamReader[T] {
	r := &StreamReader[T]{in: make(chan T, 4), stop: stop, ended: make(chan struct{})}
	go func() {
		defer close(r.ended)
		for {
			msg, err := recv()
			if err != nil {
				r.err = err
				if atEnd != nil {
					atEnd(err)
				}
				close(r.in)
				return
			}
			select {
			case r.in <- msg:
			default:
			}
		}
	}()
	return r
}

// Next returns the stream's next message. Once the stream has ended it
// fails with recv's error (io.EOF for the peer's half-close); when ctx
// ends, with ctx's status; once stop is closed, with ErrStopped.
func (r *StreamReader[T]) Next(ctx context.Context) (T, error) {
	var zero T
	select {
	case msg, ok := <-r.in:
		if !ok {
			return zero, r.err
		}
		return msg, nil
	case <-ctx.Done():
		return zero, status.FromContextError(ctx.Err()).Err()
	case <-r.stop:
		return zero, ErrStopped
	}
}

// Ended is closed once the stream has ended and atEnd has run.
func (r *StreamReader[T]) Ended() <-chan struct{} { return r.ended }
