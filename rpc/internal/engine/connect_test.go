package engine

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// TestConnectBothLeavesNoReader: when reporting our outcome fails (the
// session's stream broke), connectBoth returns that error, and the
// reader of the peer's report has stopped by then: it reads nothing of
// the stream after connectBoth returned.
func TestConnectBothLeavesNoReader(t *testing.T) {
	var reading atomic.Bool
	broken := errors.New("stream broken")
	theirResult := func(ctx context.Context) (*pb.ConnectResult, error) {
		reading.Store(true)
		defer reading.Store(false)
		select { // the peer's report never comes
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(30 * time.Second):
			return nil, errors.New("never stopped")
		}
	}
	_, err := connectBoth(context.Background(), 5*time.Second,
		func(context.Context) error { return nil },
		func(bool, error) error { return broken },
		theirResult, "peer")
	if !errors.Is(err, broken) {
		t.Fatalf("connectBoth: %v, want the report's error", err)
	}
	if reading.Load() {
		t.Fatal("the peer's report is still being read after connectBoth returned")
	}
}

// TestConnectBothBothReport: the usual case, both sides connect and
// report.
func TestConnectBothBothReport(t *testing.T) {
	o, err := connectBoth(context.Background(), 5*time.Second,
		func(context.Context) error { return nil },
		func(bool, error) error { return nil },
		func(context.Context) (*pb.ConnectResult, error) { return &pb.ConnectResult{Ok: true}, nil }, "peer")
	if err != nil || o.Mine != nil || o.Theirs == nil || !o.Theirs.Ok {
		t.Fatalf("connectBoth: %+v, %v", o, err)
	}
}
