// White-box: these tests count indirect frames on the lanes of both sides' sessions.

package rpc

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// indirectIn counts the frames with frameIndirect that the lanes of c's
// session (answers) or of the server's session (requests) received.
func indirectIn(lanes []*engine.Link) uint64 {
	var n uint64
	for _, l := range lanes {
		n += l.Frames.Indirect.Load()
	}
	return n
}

// TestIndirectRequests: a Fetch of a key of the longest length, and a Call
// with 64 KiB of metadata and 300 tensors, do not fit a receive slot:
// they travel indirect, still as frames (the server's gRPC interceptors
// see no call but Session), and return the right bytes. Their answers,
// too large for a slot as well, come back indirect. With an eager
// threshold of 0 (slots of 4 KiB) even the longest key's FETCH_REQ goes
// indirect.
func TestIndirectRequests(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		for _, eager := range []int{DefaultEagerThreshold, 0} {
			t.Run(fmt.Sprintf("%s/eager=%d", tr, eager), func(t *testing.T) {
				var u rpctest.ServerCalls
				s, c := pair(t, tr, []ServerOption{WithGRPCServerOptions(u.Options()...), WithEagerThreshold(eager)}, nil)
				s.Handle("echo", echo(s))
				ctx := ctxT(t)
				cs, err := c.session(ctx)
				if err != nil {
					t.Fatal(err)
				}
				ss := serverSessionOf(t, s)

				// A key of wire.MaxKeyLen bytes; a tensor at the eager
				// threshold comes inline, so its FetchResponse (key and
				// bytes) outgrows the slot; a larger one is read.
				key := strings.Repeat("k", wire.MaxKeyLen)
				for i, n := range []int{max(eager, 1), 1 << 20} {
					want := publishBytes(t, s, key, n, byte(i))
					inBefore, outBefore := indirectIn(cs.lanes), indirectIn(ss.lanes)
					got, err := c.Fetch(ctx, key)
					if err != nil {
						t.Fatalf("Fetch of a %d-byte key, %d bytes: %v", len(key), n, err)
					}
					if !bytes.Equal(got.Bytes(), want) {
						t.Fatalf("Fetch of a %d-byte key, %d bytes: other bytes", len(key), n)
					}
					got.Release()
					// Inline bytes at the eager threshold and the key
					// outgrow the slot; a location (or a byte) and the key
					// fit any (slots always have room for 8 KiB of call
					// metadata).
					if respIndirect := indirectIn(cs.lanes) != inBefore; respIndirect != (i == 0 && eager > 0) {
						t.Errorf("the FETCH_RESP for a %d-byte key (%d bytes) indirect: %v", len(key), n, respIndirect)
					}
					if reqIndirect := indirectIn(ss.lanes) != outBefore; reqIndirect != (wire.FrameHeaderLen+len(key) > cs.link.Frames.SlotSize) {
						t.Errorf("FETCH_REQ of %d bytes in slots of %d: indirect %v", wire.FrameHeaderLen+len(key), cs.link.Frames.SlotSize, reqIndirect)
					}
				}
				// A key past the longest: refused, and the session goes on.
				if _, err := c.Fetch(ctx, key+"k"); status.Code(err) != codes.InvalidArgument {
					t.Errorf("Fetch of a %d-byte key: %v, want InvalidArgument", len(key)+1, err)
				}

				// A Call of 64 KiB metadata and 300 tensors (some inline,
				// some granted), echoed.
				req := &Message{Metadata: bytes.Repeat([]byte{'m'}, 64<<10)}
				defer req.Release()
				for i := range 300 {
					n := 100
					if i%50 == 0 {
						n = 200 << 10
					}
					req.Tensors = append(req.Tensors, wrapped(t, n, byte(i)))
				}
				inBefore, outBefore := indirectIn(cs.lanes), indirectIn(ss.lanes)
				reply, err := c.Call(ctx, "echo", req)
				if err != nil {
					t.Fatalf("Call of 64 KiB metadata and 300 tensors: %v", err)
				}
				if !bytes.Equal(reply.Metadata, req.Metadata) || len(reply.Tensors) != len(req.Tensors) {
					t.Fatalf("reply: %d bytes of metadata, %d tensors", len(reply.Metadata), len(reply.Tensors))
				}
				for i, r := range reply.Tensors {
					if !bytes.Equal(r.Bytes(), req.Tensors[i].Bytes()) {
						t.Fatalf("reply tensor %d differs", i)
					}
				}
				reply.Release()
				if indirectIn(ss.lanes) == outBefore || indirectIn(cs.lanes) == inBefore {
					t.Errorf("CALL_REQ indirect: %v, CALL_RESP indirect: %v; want both", indirectIn(ss.lanes) != outBefore, indirectIn(cs.lanes) != inBefore)
				}
				if c.SessionID() != cs.id {
					t.Error("the session changed")
				}
				u.None(t)
			})
		}
	}
}

// TestUnaryMethodsAreInline: the unary methods, there for clients with
// only the .proto, carry tensors inline only, also on a data-plane
// session: a larger one fails with FailedPrecondition naming the stream
// to use instead.
func TestUnaryMethodsAreInline(t *testing.T) {
	s, c := pair(t, TransportTCP, nil, nil)
	s.Handle("big", func(ctx context.Context, _ *Message) (*Message, error) {
		o, err := s.NewTensor(ctx, 6, []int64{1 << 20})
		if err != nil {
			return nil, err
		}
		return &Message{Tensors: []*Tensor{o}}, nil
	})
	ctx := ctxT(t)
	publishBytes(t, s, "large", 1<<20, 1)
	small := publishBytes(t, s, "small", 100, 2)
	api := pb.NewTensorRPCClient(c.cc)
	id := c.SessionID()
	stream := func(what string, err error, name string) {
		t.Helper()
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: %v, want FailedPrecondition naming %s", what, err, name)
		}
	}
	_, err := api.Fetch(ctx, &pb.FetchRequest{SessionId: id, Key: "large"})
	stream("Fetch of 1 MiB", err, "FetchStream")
	_, err = api.Send(ctx, &pb.SendRequest{SessionId: id, Meta: metaOf("x", wrapped(t, 1<<20, 3).Tensor, false)})
	stream("Send of 1 MiB without inline data", err, "SendStream")
	_, err = api.Call(ctx, &pb.CallRequest{SessionId: id, Method: "big"})
	stream("Call replying 1 MiB", err, "CallStream")
	resp, err := api.Fetch(ctx, &pb.FetchRequest{SessionId: id, Key: "small"})
	if err != nil || resp.Meta.Location != nil || !bytes.Equal(resp.InlineData, small) || resp.TransferId != 0 {
		t.Fatalf("Fetch of 100 bytes: %v, %v", resp, err)
	}
}
