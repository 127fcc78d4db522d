package rpctest

import (
	"context"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// AbuserAddr is the loopback address abusive clients connect from, so
// that a server tells them from the well-behaved clients on 127.0.0.1: a
// peer is a host (and TLS identity).
const AbuserAddr = "127.0.0.2"

// DialFrom makes a gRPC connection leave from the local address host.
func DialFrom(host string) grpc.DialOption {
	return grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(host)}}
		return d.DialContext(ctx, "tcp", addr)
	})
}

// RawConnFrom is RawConn from the local address host.
func RawConnFrom(t testing.TB, addr, host string) pb.TensorRPCClient {
	t.Helper()
	api, _ := RawConnFromClosing(t, addr, host)
	return api
}

// RawConnFromClosing is RawConnFrom with a func that closes the
// connection before the test ends.
func RawConnFromClosing(t testing.TB, addr, host string) (pb.TensorRPCClient, func()) {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), DialFrom(host))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return pb.NewTensorRPCClient(cc), func() { cc.Close() }
}

// AbuseSessions opens sessions on api (a handshake of protocol version
// that offers no data plane) and holds them until one is refused or max
// are open; it returns how many opened and the refusal.
func AbuseSessions(t testing.TB, api pb.TensorRPCClient, version uint32, max int) (int, error) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	opened := 0
	for opened < max {
		st, err := api.Session(ctx)
		if err == nil {
			err = st.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: &pb.HandshakeRequest{ProtocolVersion: version}}})
		}
		if err == nil {
			_, err = st.Recv()
		}
		if err != nil {
			return opened, err
		}
		opened++
	}
	return opened, nil
}
