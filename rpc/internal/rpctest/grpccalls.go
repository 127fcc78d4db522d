package rpctest

import (
	"context"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// ServerCalls counts a server's gRPC calls: unary ones, and streams other
// than Session. Tests use it to check that calls travel as frames.
type ServerCalls struct{ unary, streams atomic.Int64 }

// Unary is a unary server interceptor that counts.
func (u *ServerCalls) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	u.unary.Add(1)
	return h(ctx, req)
}

// Stream is a stream server interceptor that counts streams but Session.
func (u *ServerCalls) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if info.FullMethod != pb.TensorRPC_Session_FullMethodName {
		u.streams.Add(1)
	}
	return h(srv, ss)
}

// Options are the grpc.Server options that install u.
func (u *ServerCalls) Options() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.UnaryInterceptor(u.Unary), grpc.StreamInterceptor(u.Stream)}
}

// None fails t when the server saw a gRPC call besides Session.
func (u *ServerCalls) None(t testing.TB) {
	t.Helper()
	if n, m := u.unary.Load(), u.streams.Load(); n != 0 || m != 0 {
		t.Errorf("%d unary calls and %d streams over gRPC, want none (only Session)", n, m)
	}
}

// MethodCalls counts a client's unary calls of tensorrpc's methods.
type MethodCalls struct{ n map[string]*atomic.Int64 }

// NewMethodCalls returns a MethodCalls at zero.
func NewMethodCalls() *MethodCalls {
	m := &MethodCalls{n: map[string]*atomic.Int64{}}
	for _, name := range []string{pb.TensorRPC_Fetch_FullMethodName, pb.TensorRPC_Send_FullMethodName, pb.TensorRPC_Call_FullMethodName, pb.TensorRPC_Release_FullMethodName} {
		m.n[name] = new(atomic.Int64)
	}
	return m
}

// Intercept is a unary client interceptor that counts.
func (m *MethodCalls) Intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if c := m.n[method]; c != nil {
		c.Add(1)
	}
	return invoke(ctx, method, req, reply, cc, opts...)
}

// Total is the number of calls counted.
func (m *MethodCalls) Total() int64 {
	var n int64
	for _, c := range m.n {
		n += c.Load()
	}
	return n
}
