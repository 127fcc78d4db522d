// Command metrics is a tensorrpc server and client with OpenTelemetry on
// every call, its metrics served for Prometheus on /metrics (OpenTelemetry's
// Prometheus exporter):
//
//	go run ./otel/examples/metrics -metrics 127.0.0.1:9464 -calls 300
//	curl -s 127.0.0.1:9464/metrics | grep rpc_client_duration
//
// It makes -calls Fetches, Sends and Calls in turn over -plane, then serves
// /metrics until interrupted (or, with -exit, returns).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"

	promclient "github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc/credentials/insecure"

	tensorrpcotel "github.com/tensorrpc/tensorrpc/otel"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

func main() {
	addr := flag.String("metrics", "127.0.0.1:9464", "address /metrics is served on")
	calls := flag.Int("calls", 300, "calls to make before serving")
	plane := flag.String("plane", rpc.TransportTCP, "data plane: shm, tcp or grpc")
	exit := flag.Bool("exit", false, "return after the calls instead of serving /metrics")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	lis, err := net.Listen("tcp", *addr)
	if err == nil {
		err = run(ctx, lis, *plane, *calls, *exit, os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "metrics:", err)
		os.Exit(1)
	}
}

// run makes calls over plane with telemetry on both sides, then serves
// the metrics on lis until ctx ends (at once with exit).
func run(ctx context.Context, lis net.Listener, plane string, calls int, exit bool, out *os.File) error {
	reg := promclient.NewRegistry()
	exporter, err := prometheus.New(prometheus.WithRegisterer(reg))
	if err != nil {
		return err
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer mp.Shutdown(context.Background())
	tel := tensorrpcotel.Interceptor(tensorrpcotel.WithMeterProvider(mp))

	srv, err := rpc.NewServer(rpc.WithInlineInterceptors(tel))
	if err != nil {
		return err
	}
	srv.Handle("echo", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		return &rpc.Message{Tensors: req.Tensors}, nil
	})
	w, err := srv.NewTensor(ctx, zerocopy.Float32, []int64{256, 256})
	if err != nil {
		return err
	}
	srv.Publish(ctx, "weights", w)
	w.Release()
	rl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go srv.Serve(rl)
	defer srv.Stop()
	c, err := rpc.Dial(ctx, rl.Addr().String(), rpc.WithTransportCredentials(insecure.NewCredentials()),
		rpc.WithTransports(plane), rpc.WithInlineInterceptors(tel))
	if err != nil {
		return err
	}
	defer c.Close()
	stopStats, err := tensorrpcotel.ObserveStats("client", c.Stats, tensorrpcotel.WithMeterProvider(mp))
	if err != nil {
		return err
	}
	defer stopStats()
	for i := range calls {
		if err := call(ctx, c, i); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "made %d calls over %s; metrics on http://%s/metrics\n", calls, c.Transport(), lis.Addr())
	hs := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{})}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(lis) }()
	if !exit {
		<-ctx.Done()
	}
	hs.Close()
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// call makes the i-th call: a Fetch, a Send or a Call, in turn.
func call(ctx context.Context, c *rpc.Client, i int) error {
	switch i % 3 {
	case 0:
		t, err := c.Fetch(ctx, "weights")
		if err != nil {
			return err
		}
		t.Release()
	case 1:
		zt, _ := zerocopy.New(zerocopy.Uint8, []int64{8 << 10}, make([]byte, 8<<10))
		return c.Send(ctx, "grads", rpc.WrapTensor(zt))
	default:
		zt, _ := zerocopy.New(zerocopy.Uint8, []int64{4 << 10}, make([]byte, 4<<10))
		reply, err := c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{rpc.WrapTensor(zt)}})
		if err != nil {
			return err
		}
		reply.Release()
	}
	return nil
}
