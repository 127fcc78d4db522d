package rpc

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestRegisterOnExistingServer serves tensorrpc from a grpc.Server the
// application owns, and opens the session over an existing ClientConn.
func TestRegisterOnExistingServer(t *testing.T) {
	s, err := NewServer(WithTransports(TransportSHM, TransportGRPC), testPool())
	if err != nil {
		t.Fatal(err)
	}
	// The grpc.Server's and the connection's interceptors see the gRPC
	// methods only: the session's calls travel as frames.
	var u unaryCounter
	gs := grpc.NewServer(grpc.UnaryInterceptor(u.intercept), grpc.StreamInterceptor(u.interceptStream))
	s.Register(gs)
	lis := listen(t)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	m := newMethodCounter()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUnaryInterceptor(m.intercept))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := NewClient(ctx, cc, WithTransports(TransportSHM, TransportGRPC), testPool())
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
	if c.Transport() != TransportSHM || c.last.link.Frames == nil {
		t.Fatalf("session on %s, frames %v", c.Transport(), c.last.link != nil && c.last.link.Frames != nil)
	}
	u.none(t)
	if n := m.total(); n != 0 {
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
