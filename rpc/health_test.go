package rpc_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc"
)

func healthClient(t *testing.T, addr string) healthpb.HealthClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

// TestHealthServing: a Server answers the standard health service for the
// server as a whole and for the tensorrpc service, SERVING, and
// NOT_FOUND for a service it does not have.
func TestHealthServing(t *testing.T) {
	if rpc.HealthService != tensorrpcpb.TensorRPC_ServiceDesc.ServiceName {
		t.Fatalf("HealthService %q, the service is %q", rpc.HealthService, tensorrpcpb.TensorRPC_ServiceDesc.ServiceName)
	}
	_, addr, _ := serveOn(t, "127.0.0.1:0")
	hc := healthClient(t, addr)
	ctx := ctxT(t)
	for _, svc := range []string{"", rpc.HealthService} {
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("Check(%q) = %v, %v; want SERVING", svc, r.GetStatus(), err)
		}
	}
	if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "no.such.Service"}); status.Code(err) != codes.NotFound {
		t.Errorf("Check of an unknown service: %v, want NotFound", err)
	}
}

// TestHealthWithout: WithoutHealth registers no health service.
func TestHealthWithout(t *testing.T) {
	_, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithoutHealth())
	_, err := healthClient(t, addr).Check(ctxT(t), &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("Check with WithoutHealth: %v, want Unimplemented", err)
	}
}

// TestHealthGracefulStop: a watcher sees NOT_SERVING as soon as
// GracefulStop begins, while a call under way still holds the server
// open, and its stream then ends, so that it does not hold GracefulStop up.
func TestHealthGracefulStop(t *testing.T) {
	s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithGracefulStopTimeout(10*time.Second))
	entered, release := make(chan struct{}), make(chan struct{})
	s.Handle("hold", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		close(entered)
		<-release
		return &rpc.Message{}, nil
	})
	ctx := ctxT(t)
	watch, err := healthClient(t, addr).Watch(ctx, &healthpb.HealthCheckRequest{Service: rpc.HealthService})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("first status %v, %v; want SERVING", r.GetStatus(), err)
	}

	c, err := rpc.Dial(ctx, addr, insecureCreds(), rpc.WithTransports(rpc.TransportTCP))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	called := make(chan error, 1)
	go func() {
		_, err := c.Call(ctx, "hold", &rpc.Message{})
		called <- err
	}()
	<-entered
	stopped := make(chan struct{})
	go func() { s.GracefulStop(); close(stopped) }()

	r, err := watch.Recv()
	if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("status once GracefulStop began: %v, %v; want NOT_SERVING", r.GetStatus(), err)
	}
	select {
	case <-stopped:
		t.Fatal("GracefulStop returned while a call was under way")
	default:
	}
	if _, err := watch.Recv(); err == nil {
		t.Error("the watch stream went on after NOT_SERVING")
	}
	close(release)
	if err := <-called; err != nil {
		t.Errorf("the call under way: %v", err)
	}
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("GracefulStop did not return after the call under way ended")
	}
}
