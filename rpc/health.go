package rpc

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// HealthService is the service name under which the health service reports
// the tensorrpc service itself ("" reports the server as a whole).
const HealthService = "tensorrpc.v1.TensorRPC"

// healthService is the standard gRPC health service (grpc.health.v1.Health,
// what Kubernetes' gRPC probes and grpc_health_probe ask) of a Server's own
// grpc.Server: SERVING for "" and HealthService from NewServer on,
// NOT_SERVING as soon as Stop or GracefulStop begins. grpc-go's
// health.Server does the bookkeeping; Watch is wrapped so that a draining
// server ends its watch streams (after their last NOT_SERVING) instead of
// waiting for the clients to hang up, which would hold GracefulStop until
// its timeout.
type healthService struct {
	*health.Server
	draining context.Context
	drain    context.CancelFunc
	once     sync.Once
}

func newHealthService() *healthService {
	h := &healthService{Server: health.NewServer()}
	h.draining, h.drain = context.WithCancel(context.Background())
	h.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	h.SetServingStatus(HealthService, healthpb.HealthCheckResponse_SERVING)
	return h
}

func (h *healthService) register(gs *grpc.Server) {
	healthpb.RegisterHealthServer(gs, h)
}

// shutdown reports NOT_SERVING for every service, for good, and ends the
// watch streams.
func (h *healthService) shutdown() {
	h.once.Do(func() {
		h.Shutdown()
		h.drain()
	})
}

func (h *healthService) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	stop := context.AfterFunc(h.draining, cancel)
	defer stop()
	w := &watchStream{Health_WatchServer: stream, ctx: ctx}
	err := h.Server.Watch(req, w)
	if h.draining.Err() == nil || stream.Context().Err() != nil {
		return err
	}
	// The server drains: its watch ended with our cancel, which may have
	// come before the NOT_SERVING that Shutdown queued for it. Send that
	// last, unless it went already, and end the stream.
	if w.last != healthpb.HealthCheckResponse_NOT_SERVING {
		return stream.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING})
	}
	return nil
}

// watchStream is a Watch stream whose context also ends when the server
// drains, and which remembers the last status sent.
type watchStream struct {
	healthpb.Health_WatchServer
	ctx  context.Context
	last healthpb.HealthCheckResponse_ServingStatus
}

func (w *watchStream) Context() context.Context { return w.ctx }

func (w *watchStream) Send(r *healthpb.HealthCheckResponse) error {
	err := w.Health_WatchServer.Send(r)
	if err == nil {
		w.last = r.GetStatus()
	}
	return err
}
