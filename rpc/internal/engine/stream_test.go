package engine

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// fakeRecv is a stream's Recv: it returns what arrives on msgs, and err
// once msgs is closed.
func fakeRecv(msgs <-chan string, err error) func() (string, error) {
	return func() (string, error) {
		if m, ok := <-msgs; ok {
			return m, nil
		}
		return "", err
	}
}

// TestStreamReaderEnd: Next hands out the messages in order; at the
// stream's end atEnd runs first, then Next fails with Recv's error and
// Ended is closed.
func TestStreamReaderEnd(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	msgs := make(chan string, 2)
	msgs <- "a"
	msgs <- "b"
	close(msgs)
	var atEnd error
	r := ReadStream(fakeRecv(msgs, io.EOF), nil, func(err error) { atEnd = err })
	ctx := context.Background()
	for _, want := range []string{"a", "b"} {
		if m, err := r.Next(ctx); m != want || err != nil {
			t.Fatalf("Next: %q, %v, want %q", m, err, want)
		}
	}
	if _, err := r.Next(ctx); err != io.EOF {
		t.Fatalf("Next at the end: %v, want io.EOF", err)
	}
	<-r.Ended()
	if atEnd != io.EOF {
		t.Fatalf("atEnd ran with %v", atEnd)
	}
}

// TestStreamReaderStops: Next fails with ctx's status when ctx ends, and
// with ErrStopped once stop is closed; the reader goes on until the
// stream ends, dropping what no one reads.
func TestStreamReaderStops(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	msgs := make(chan string)
	stop := make(chan struct{})
	broken := errors.New("broken")
	r := ReadStream(fakeRecv(msgs, broken), stop, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := r.Next(ctx); status.Code(err) != codes.Canceled {
		t.Fatalf("Next with its context ended: %v, want Canceled", err)
	}
	close(stop)
	if _, err := r.Next(context.Background()); err != ErrStopped {
		t.Fatalf("Next once stopped: %v, want ErrStopped", err)
	}
	for range 10 { // more than the queue holds: the reader never blocks
		msgs <- "unread"
	}
	close(msgs)
	<-r.Ended()
}
