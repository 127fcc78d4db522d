// White-box: these tests check the unexported codec of frame call headers.

package rpc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/proto/wire"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
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

// TestFrameHeadersAreCallHeaders: the hand-made encoding is
// tensorrpc.proto's CallHeaders, both ways: protobuf decodes what
// appendHeaders writes, and splitHeaders decodes what protobuf writes
// (with a field it does not know, which it skips).
func TestFrameHeadersAreCallHeaders(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "a", "1", "b-bin", "\x00\xff")
	b, _, err := appendHeaders(nil, ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ch pb.CallHeaders
	if err := proto.Unmarshal(b[4:], &ch); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range ch.Metadata {
		got[e.Key] = string(e.Value)
	}
	if len(got) != 2 || got["a"] != "1" || got["b-bin"] != "\x00\xff" || ch.TimeoutMicros < uint64(59*time.Minute/time.Microsecond) || ch.TimeoutMicros > uint64(time.Hour/time.Microsecond) {
		t.Errorf("protobuf read %v, timeout %d µs", got, ch.TimeoutMicros)
	}

	enc, err := proto.Marshal(&pb.CallHeaders{Metadata: []*pb.Header{{Key: "k", Value: []byte("v")}}, TimeoutMicros: 5})
	if err != nil {
		t.Fatal(err)
	}
	enc = protowire.AppendTag(enc, 9, protowire.VarintType) // a field from a later version
	enc = protowire.AppendVarint(enc, 1)
	body := binary.LittleEndian.AppendUint32(nil, uint32(len(enc)))
	body = append(append(body, enc...), "rest"...)
	h, rest, err := splitHeaders(body)
	if err != nil || string(rest) != "rest" || h.timeout != 5*time.Microsecond || h.md.Get("k")[0] != "v" {
		t.Errorf("splitHeaders of protobuf's encoding: %+v, %q, %v", h, rest, err)
	}
}

// TestFrameHeadersEntries: keys with several values, empty values, binary
// values holding the entries' tag byte, an uppercase key from a peer that
// did not lower it, and an entry without a key all decode as gRPC's
// metadata would hold them.
func TestFrameHeadersEntries(t *testing.T) {
	md := metadata.MD{"a": {"1", "2", ""}, "b-bin": {"\n\n\x0a\x00"}, "c": {""}}
	b, _, err := appendHeaders(nil, metadata.NewOutgoingContext(context.Background(), md))
	if err != nil {
		t.Fatal(err)
	}
	// One more entry, as a peer might write it: an uppercase key.
	extra := protowire.AppendTag(nil, 1, protowire.BytesType)
	extra = protowire.AppendString(extra, "Up")
	extra = protowire.AppendTag(extra, 2, protowire.BytesType)
	extra = protowire.AppendString(extra, "x")
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, extra)
	// And one without a key.
	nokey := protowire.AppendTag(nil, 2, protowire.BytesType)
	nokey = protowire.AppendString(nokey, "v")
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, nokey)
	binary.LittleEndian.PutUint32(b, uint32(len(b)-4))
	h, rest, err := splitHeaders(append(b, "body"...))
	if err != nil || string(rest) != "body" {
		t.Fatalf("splitHeaders: %q, %v", rest, err)
	}
	want := metadata.MD{"a": {"1", "2", ""}, "b-bin": {"\n\n\x0a\x00"}, "c": {""}, "up": {"x"}, "": {"v"}}
	if !reflect.DeepEqual(h.md, want) {
		t.Errorf("decoded %q, want %q", h.md, want)
	}
	// Appending to a decoded value must not write into another's.
	h.md["c"] = append(h.md["c"], "more")
	if !reflect.DeepEqual(h.md["a"], []string{"1", "2", ""}) || !reflect.DeepEqual(h.md["b-bin"], want["b-bin"]) {
		t.Errorf("an append to one key changed another: %q", h.md)
	}
}

// FuzzSplitHeaders: whatever a peer sends, splitHeaders returns an error
// or headers that encode and decode again to themselves.
func FuzzSplitHeaders(f *testing.F) {
	ctx := metadata.AppendToOutgoingContext(context.Background(), "k", "v1", "k", "v2", "traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	b, _, _ := appendHeaders(nil, ctx)
	f.Add(b)
	f.Add([]byte{0, 0, 0, 0})
	f.Add([]byte{2, 0, 0, 0, 0x0a, 0x00})
	f.Fuzz(func(t *testing.T, body []byte) {
		h, _, err := splitHeaders(body)
		if err != nil {
			return
		}
		again, _, err := encodeHeaders(nil, h.md, nil, context.Background())
		if err != nil {
			return // over the size a call may carry, once its keys are lowered
		}
		h2, _, err := splitHeaders(again)
		if len(again) == 0 && len(h.md) == 0 {
			return
		}
		if err != nil || !reflect.DeepEqual(h.md, h2.md) {
			t.Fatalf("%x: decoded %q, again %q (%v)", body, h.md, h2.md, err)
		}
	})
}

// TestFrameHeadersManyEntries: past the entries decoded into one array,
// more (here 100, one key repeated and many keys) still decode in order.
func TestFrameHeadersManyEntries(t *testing.T) {
	md := metadata.MD{}
	for i := range 50 {
		md.Append("same", fmt.Sprint(i))
		md.Append(fmt.Sprint("k", i), "\n")
	}
	b, _, err := appendHeaders(nil, metadata.NewOutgoingContext(context.Background(), md))
	if err != nil {
		t.Fatal(err)
	}
	h, _, err := splitHeaders(b)
	if err != nil || !reflect.DeepEqual(h.md, md) {
		t.Fatalf("decoded %d keys (%v), want %d", len(h.md), err, len(md))
	}
}

// TestIncomingMetadataKeyLearnt: the gRPC metadata package in go.mod is
// one whose incoming metadata key an icall answers (so that a Fetch
// answered at once decodes its metadata only when asked for), and an
// icall's answer reads as metadata.NewIncomingContext's would.
func TestIncomingMetadataKeyLearnt(t *testing.T) {
	if incomingMDKey == nil {
		t.Fatal("the incoming metadata key was not learnt from google.golang.org/grpc/metadata")
	}
	b, _, _ := appendHeaders(nil, metadata.AppendToOutgoingContext(context.Background(), "k", "v", "k", "w"))
	h, _, err := cutHeaders(b)
	if err != nil || h.md != nil || h.entries == "" {
		t.Fatalf("cutHeaders: %v, %v, %q", err, h.md, h.entries)
	}
	f := &fetchNowCall{hdr: h}
	ic := &icall{Context: context.Background()}
	ic.info.mdSrc = f
	if got := metadata.ValueFromIncomingContext(ic, "k"); fmt.Sprint(got) != "[v w]" {
		t.Fatalf("ValueFromIncomingContext: %q", got)
	}
	if md, ok := metadata.FromIncomingContext(ic); !ok || fmt.Sprint(md["k"]) != "[v w]" {
		t.Fatalf("FromIncomingContext: %v, %v", md, ok)
	}
}
