// White-box: hostile peers speak the raw protocol (hand-made metadata, refs and streams) or break a session's link.

package rpc

import (
	"context"

	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/zerocopy"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestSessionIsBoundToItsConnection: another gRPC connection that knows a
// session's id (and guesses its client refs) can neither use nor release
// the session's transfers: PermissionDenied, and the victim's calls go on.
func TestSessionIsBoundToItsConnection(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportGRPC} {
		t.Run(tr, func(t *testing.T) {
			t.Cleanup(func() { leakcheck.Check(t) })
			s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(tr, TransportGRPC))
			ctx := ctxT(t)
			c, err := Dial(ctx, addr, WithTransports(tr, TransportGRPC), testPool(), insecureCreds())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			in := wrapped(t, 1<<20, 9)
			s.Publish(ctx, "w", in)
			victim := c.SessionID()
			thief := rpctest.RawConn(t, addr)
			denied := func(what string, err error) {
				t.Helper()
				if status.Code(err) != codes.PermissionDenied {
					t.Errorf("%s with another connection's session: %v, want PermissionDenied", what, err)
				}
			}
			_, err = thief.Fetch(ctx, &pb.FetchRequest{SessionId: victim, Key: "w"})
			denied("Fetch", err)
			_, err = thief.Send(ctx, &pb.SendRequest{SessionId: victim, Meta: metaOf("x", in.Tensor, false), InlineData: nil})
			denied("Send", err)
			_, err = thief.Call(ctx, &pb.CallRequest{SessionId: victim, Method: "m"})
			denied("Call", err)
			refs := make([]uint64, 64)
			for i := range refs {
				refs[i] = uint64(i + 1)
			}
			_, err = thief.Release(ctx, &pb.ReleaseRequest{SessionId: victim, TransferIds: refs, ClientRefs: refs})
			denied("Release", err)
			fs, err := thief.FetchStream(ctx, &pb.FetchRequest{SessionId: victim, Key: "w"})
			if err == nil {
				_, err = fs.Recv()
			}
			denied("FetchStream", err)
			// The victim is untouched.
			got, err := c.Fetch(ctx, "w")
			if err != nil {
				t.Fatal(err)
			}
			got.Release()
			// Refs are not a counter an attacker could follow.
			if a, b := c.newRef(), c.newRef(); b == a+1 || a == 0 || b == 0 {
				t.Errorf("client refs %d, %d look sequential", a, b)
			}
		})
	}
}

// TestDeadDataPlaneEndsSession: a request the server's data plane refuses
// (a Read with a forged key) kills the queue pairs; both sides notice, the server ends
// the session instead of handing out locations on a dead plane, and the
// Client's next call opens a new session.
func TestDeadDataPlaneEndsSession(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			first := c.SessionID()
			api := pb.NewTensorRPCClient(c.cc)
			publishBytes(t, s, "w", 1<<20, 1)
			sess, err := c.session(ctx)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := c.askFrame(ctx, sess, sess.link, "w", fetchOptions{})
			if err != nil || resp.Meta.Location == nil {
				t.Fatalf("askFrame: %v", err)
			}
			src, _ := c.NewTensor(ctx, zerocopy.Uint8, []int64{1 << 20})
			defer src.Release()
			l := sess.link
			local, _ := l.Domain.Reg.Local(src.buf)
			loc := resp.Meta.Location
			if err := l.Post(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey ^ 0xffff}}, nil); status.Code(err) != codes.PermissionDenied {
				t.Fatalf("forged read: %v, want PermissionDenied", err)
			}
			waitFor(t, "the server to end the session", func() bool {
				for _, si := range s.Sessions() {
					if si.ID == first {
						return false
					}
				}
				return true
			})
			if _, err := api.Fetch(ctx, &pb.FetchRequest{SessionId: first, Key: "w"}); status.Code(err) != codes.Unavailable {
				t.Fatalf("a call on the dead session: %v, want Unavailable", err)
			}
			waitFor(t, "the client to notice", func() bool { return sessionGone(c) })
			in := wrapped(t, 1<<20, 4)
			var sendErr error
			for range 100 { // the first attempt may race the old session's end
				if sendErr = c.Send(ctx, "again", in); sendErr == nil {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if sendErr != nil {
				t.Fatal(sendErr)
			}
			if c.SessionID() == first || c.Transport() != tr {
				t.Fatalf("after the dead plane: session %s (was %s) on %s", c.SessionID(), first, c.Transport())
			}
		})
	}
}

// TestSilentStreamIsDropped: a sessionless SendStream that declares a
// 64 MiB tensor and goes silent fails with DeadlineExceeded after the idle
// timeout, and its memory is freed while the client still holds the
// stream open.
func TestSilentStreamIsDropped(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportGRPC), WithStreamIdleTimeout(300*time.Millisecond))
	ctx := ctxT(t)
	api := rpctest.RawConn(t, addr)
	stream, err := api.SendStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	in := wrapped(t, 64<<20, 1)
	if err := stream.Send(&pb.Chunk{Header: &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf("silent", in.Tensor, false)}}}); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&pb.Chunk{Data: in.Bytes()[:1<<20]}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the server to allocate the tensor", func() bool { return s.Pool().Stats().InUse >= 64<<20 })
	err = stream.RecvMsg(new(pb.SendResponse)) // the server's verdict, while our side stays open
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("silent stream: %v, want DeadlineExceeded", err)
	}
	waitFor(t, "the silent stream's memory to be freed", func() bool { return s.Pool().Stats().InUse == 0 })
}

// TestCallStreamBytesPastTheEnd: a CallStream client that sends a Chunk
// after the last byte of its tensors fails with InvalidArgument, as the
// .proto's stream rules say, and the method never runs; its memory is
// freed.
func TestCallStreamBytesPastTheEnd(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportGRPC))
	ran := make(chan struct{}, 1)
	s.Handle("m", func(ctx context.Context, req *Message) (*Message, error) {
		ran <- struct{}{}
		return nil, nil
	})
	ctx := ctxT(t)
	stream, err := rpctest.RawConn(t, addr).CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	in := wrapped(t, 8, 1)
	for _, ch := range []*pb.Chunk{
		{Header: &pb.ChunkHeader{Method: "m", Tensors: []*pb.TensorMeta{metaOf("", in.Tensor, false)}}},
		{Data: in.Bytes()},
		{Data: []byte{1}},
	} {
		if err := stream.Send(ch); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a Chunk past the last tensor: %v, want InvalidArgument", err)
	}
	select {
	case <-ran:
		t.Error("the method ran")
	default:
	}
	waitFor(t, "the stream's memory to be freed", func() bool { return s.Pool().Stats().InUse == 0 })
}
