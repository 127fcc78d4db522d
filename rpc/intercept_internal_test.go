package rpc

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/proto/wire"
	"google.golang.org/grpc/metadata"
)

// TestFrameHeadersRoundTrip: what a client puts before a request frame's
// body (metadata and the time left) is what the server's call context
// gets, and the server's own timer ends the call when the time is up, with
// no cancellation from the client.
func TestFrameHeadersRoundTrip(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "k", "v1", "k", "v2")
	b, has, err := appendHeaders(nil, ctx)
	if err != nil || !has {
		t.Fatalf("appendHeaders: %v, %v", has, err)
	}
	b = append(b, "body"...)
	h, rest, err := splitHeaders(b)
	if err != nil || string(rest) != "body" {
		t.Fatalf("splitHeaders: %q, %v", rest, err)
	}
	sctx, scancel := withHeaders(context.Background(), h)
	defer scancel()
	md, _ := metadata.FromIncomingContext(sctx)
	if v := md.Get("k"); len(v) != 2 || v[0] != "v1" || v[1] != "v2" {
		t.Errorf("metadata %v", md)
	}
	if _, ok := sctx.Deadline(); !ok {
		t.Fatal("no deadline")
	}
	select {
	case <-sctx.Done():
		if !errors.Is(sctx.Err(), context.DeadlineExceeded) {
			t.Errorf("the call's context ended with %v", sctx.Err())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the call's deadline never ended it")
	}

	// Nothing to carry: no headers.
	if b, has, err := appendHeaders(nil, context.Background()); has || err != nil || len(b) != 0 {
		t.Errorf("appendHeaders without metadata or deadline: %d bytes, %v, %v", len(b), has, err)
	}
	// A deadline already passed fails the call before it is sent.
	past, cancelPast := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancelPast()
	if _, _, err := appendHeaders(nil, past); err == nil {
		t.Error("appendHeaders with a passed deadline: no error")
	}
}

// TestSplitHeadersRefusesBadInput: lengths past the body or the bound, and
// bytes that are not a CallHeaders, are frame errors.
func TestSplitHeadersRefusesBadInput(t *testing.T) {
	for _, b := range [][]byte{
		nil, {1, 0}, {9, 0, 0, 0, 1}, {0xff, 0xff, 0xff, 0xff}, {2, 0, 0, 0, 0xff, 0xff},
	} {
		if _, _, err := splitHeaders(b); !errors.Is(err, wire.ErrInvalidFrame) {
			t.Errorf("splitHeaders(%x): %v, want a frame error", b, err)
		}
	}
	if _, rest, err := splitHeaders([]byte{0, 0, 0, 0, 'x'}); err != nil || string(rest) != "x" {
		t.Errorf("empty headers: %q, %v", rest, err)
	}
}
