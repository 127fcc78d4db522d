package rpc_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// TestRegisterOnExistingServer serves tensorrpc from a grpc.Server the
// application owns, and opens the session over an existing ClientConn.
func TestRegisterOnExistingServer(t *testing.T) {
	s, err := rpc.NewServer(rpc.WithTransports(rpc.TransportSHM, rpc.TransportGRPC), testPool())
	if err != nil {
		t.Fatal(err)
	}
	// The grpc.Server's and the connection's interceptors see the gRPC
	// methods only: the session's calls travel as frames.
	var u rpctest.ServerCalls
	gs := grpc.NewServer(u.Options()...)
	s.Register(gs)
	lis := listen(t)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	m := rpctest.NewMethodCalls()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUnaryInterceptor(m.Intercept))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := rpc.NewClient(ctx, cc, rpc.WithTransports(rpc.TransportSHM, rpc.TransportGRPC), testPool())
	if err != nil {
		t.Fatal(err)
	}
	in := wrapped(t, 200000, 2)
	if err := c.Send(ctx, "k", in); err != nil {
		t.Fatal(err)
	}
	got, err := s.Take(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), in.Bytes()) {
		t.Fatal("data differs")
	}
	got.Release()
	if c.Transport() != rpc.TransportSHM || !rpc.SessionHasFrames(c) {
		t.Fatalf("session on %s, frames %v", c.Transport(), rpc.SessionHasFrames(c))
	}
	u.None(t)
	if n := m.Total(); n != 0 {
		t.Errorf("%d unary calls from NewClient's connection, want none", n)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	cc.Close() // NewClient does not own cc
	gs.GracefulStop()
	<-served
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	leakcheck.Check(t)
}
