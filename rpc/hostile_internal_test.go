// White-box: hostile peers speak the raw protocol (hand-made metadata, refs and streams) or break a session's link.

package rpc

import (
	"context"
	"io"
	"net"
	"strings"

	"github.com/tensorrpc/tensorrpc/zerocopy"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// rawConn is a plain gRPC connection to addr, as an attacker's client
// would open: the .proto and nothing else.
func rawConn(t *testing.T, addr string) pb.TensorRPCClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return pb.NewTensorRPCClient(cc)
}

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
			thief := rawConn(t, addr)
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

// TestGracefulStopWithStalledPeers: GracefulStop finishes within a bounded
// time with peers that stall every way the protocol allows: a Fetch
// waiting for a key nobody publishes, a Session stream that never sends
// its handshake, a session that never answers the plane choice, and a
// FetchStream whose reader never reads. Waiting calls fail Unavailable.
func TestGracefulStopWithStalledPeers(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	s, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP, TransportGRPC), WithGracefulStopTimeout(2*time.Second))
	ctx := ctxT(t)
	big, err := s.NewTensor(ctx, 6, []int64{64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	s.Publish(ctx, "big", big)
	big.Release()

	c, err := Dial(ctx, addr, WithTransports(TransportTCP, TransportGRPC), testPool(), insecureCreds())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waiting := make(chan error, 1)
	go func() {
		_, err := c.Fetch(ctx, "never", WaitForKey())
		waiting <- err
	}()

	raw := rawConn(t, addr)
	silent, err := raw.Session(ctx) // never sends its handshake
	if err != nil {
		t.Fatal(err)
	}
	_ = silent
	mute, err := raw.Session(ctx) // offers tcp, then never answers the choice
	if err != nil {
		t.Fatal(err)
	}
	if err := mute.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{
		ProtocolVersion: ProtocolVersion, Offers: []*pb.TransportOffer{{Transport: pb.Transport_TRANSPORT_TCP, Info: []byte("junk that is never connected")}},
	}}}); err != nil {
		t.Fatal(err)
	}
	stuck, err := raw.FetchStream(ctx, &pb.FetchRequest{Key: "big"}) // never read
	if err != nil {
		t.Fatal(err)
	}
	_ = stuck
	time.Sleep(100 * time.Millisecond) // let the server reach each stall

	done := make(chan struct{})
	start := time.Now()
	go func() { s.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("GracefulStop did not return within 60 s")
	}
	t.Logf("GracefulStop with stalled peers took %v", time.Since(start))
	if err := <-waiting; status.Code(err) != codes.Unavailable {
		t.Fatalf("Fetch waiting across GracefulStop: %v, want Unavailable", err)
	}
	for _, st := range []interface {
		Recv() (*pb.SessionResponse, error)
	}{silent, mute} {
		for {
			if _, err := st.Recv(); err != nil {
				break
			}
		}
	}
	for {
		if _, err := stuck.Recv(); err != nil {
			if err != io.EOF && status.Code(err) == codes.OK {
				t.Fatal(err)
			}
			break
		}
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
			local, _ := l.Dev.Reg.Local(src.buf)
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
	api := rawConn(t, addr)
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

// TestServerNeverDialsClientAddresses: a client's tcp offer names another
// host:port (and, as a RoleAny queue pair with the larger secret would
// have, asks to be dialled): the server only accepts, so nothing ever
// connects to that address, and the server's reasons name no address of
// its own network view.
func TestServerNeverDialsClientAddresses(t *testing.T) {
	t.Cleanup(func() { leakcheck.Check(t) })
	victim, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	dialled := make(chan struct{}, 1)
	go func() {
		if c, err := victim.Accept(); err == nil {
			c.Close()
			dialled <- struct{}{}
		}
	}()
	_, addr, _ := serveOn(t, "127.0.0.1:0", WithTransports(TransportTCP, TransportGRPC), WithConnectTimeout(500*time.Millisecond))
	// A queue pair that advertises the victim's address.
	pd, err := tcp.New(tcp.WithAdvertiseAddress(victim.Addr().String())).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	cq, _ := pd.NewCompletionQueue(64)
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 8, MaxRecv: 8})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	st, err := rawConn(t, addr).Session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{
		ProtocolVersion: ProtocolVersion, Offers: []*pb.TransportOffer{{Transport: pb.Transport_TRANSPORT_TCP, Info: qp.LocalInfo()}},
	}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil { // handshake
		t.Fatal(err)
	}
	choice, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if choice.GetChoice().GetTransport() != pb.Transport_TRANSPORT_TCP {
		t.Fatalf("server chose %v", choice.GetChoice())
	}
	// We never connect; the server's attempt times out and it reports.
	res, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	r := res.GetConnectResult()
	if r == nil || r.Ok {
		t.Fatalf("server's connect result: %v", res)
	}
	if strings.Contains(r.Error, victim.Addr().String()) {
		t.Errorf("the server's reason echoes the address: %q", r.Error)
	}
	select {
	case <-dialled:
		t.Fatal("the server dialled the address the client named")
	case <-time.After(200 * time.Millisecond):
	}
	st.CloseSend()
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
	stream, err := rawConn(t, addr).CallStream(ctx)
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
