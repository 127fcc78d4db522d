package rpc

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// The options only a Server takes (NewServer). Options both sides take are
// in options.go, a Client's in dial_options.go.

// DefaultGracefulStopTimeout bounds how long GracefulStop waits for calls
// under way before it stops the server like Stop.
const DefaultGracefulStopTimeout = 10 * time.Second

// DefaultSessionQuota bounds the pool memory one session's Sends and Calls
// may bring into the server at once: 2 GiB, two tensors of
// DefaultMaxTensorBytes.
const DefaultSessionQuota = 2 * DefaultMaxTensorBytes

// DefaultReservationTimeout is how long the server's read of a client's
// memory may stay unanswered before the server ends the session.
const DefaultReservationTimeout = time.Minute

// DefaultStreamIdleTimeout is how long a client's fallback stream may make
// no progress while the server waits for its tensor bytes.
const DefaultStreamIdleTimeout = 30 * time.Second

// WithEagerThreshold sets the largest tensor, in bytes, that travels inline
// in control messages (default DefaultEagerThreshold). The server's value
// is used for a session.
func WithEagerThreshold(n int) ServerOption {
	return serverOption(func(o *options) { o.eagerThreshold = n })
}

// WithGRPCServerOptions passes options to the grpc.Server that NewServer
// makes. Its interceptors see the gRPC methods only (session setup, the
// fallback's streams, gRPC-only clients): calls of a data-plane session
// travel as frames on the data plane.
//
// Two of gRPC's limits bind the gRPC plane (the fallback) only, whose
// calls are gRPC streams carrying tensors in messages of up to 1 MiB and a
// few bytes: grpc.MaxConcurrentStreams must allow at least 2 streams per
// connection (the session holds one; Dial fails with FailedPrecondition
// when that plane is chosen and none is left), and message-size limits
// below that chunk (grpc.MaxRecvMsgSize, MaxSendMsgSize, and the client's
// call options) fail its calls with ResourceExhausted. On a data plane a
// tensor's size is bounded by WithMaxTensorBytes instead.
func WithGRPCServerOptions(opts ...grpc.ServerOption) ServerOption {
	return serverOption(func(o *options) { o.grpcServerOpts = append(o.grpcServerOpts, opts...) })
}

// WithCreds sets the transport credentials (TLS, mTLS) of the grpc.Server
// that NewServer makes. Without it the server accepts plaintext
// connections, as a grpc.Server does.
func WithCreds(c credentials.TransportCredentials) ServerOption {
	return serverOption(func(o *options) { o.creds = c })
}

// WithDataAddress sets the address the tcp data plane listens on and
// advertises: "host" (a free port is chosen) or "host:port". By default it
// is the local address of the gRPC connection each session arrived on,
// which is an address the client could reach; the environment variables
// TENSORRPC_SOCKET_IFNAME and TENSORRPC_TCP_ADDR also set it (see the
// package documentation). Give a WithProvider tcp provider instead for
// full control.
func WithDataAddress(addr string) ServerOption {
	return serverOption(func(o *options) { o.dataAddress = addr })
}

// WithoutHealth leaves the standard gRPC health service
// (grpc.health.v1.Health) off the Server's grpc.Server. By default
// NewServer registers it: "" and HealthService report SERVING, and
// NOT_SERVING from the moment Stop or GracefulStop begins (watch streams
// get that last status and end, so they do not hold GracefulStop up).
// Register, which puts tensorrpc on a grpc.Server of the application's,
// registers no health service: that server's owner decides.
func WithoutHealth() ServerOption {
	return serverOption(func(o *options) { o.noHealth = true })
}

// WithHandlerGoroutines runs every call of a handler not registered
// Inline, and every Send, on a goroutine of its own, as grpc-go runs a
// handler. By default
// a call that arrives as a frame with its request in it (the eager path:
// small calls, on a Server without interceptors that may block) runs
// where its frame is read, as an Inline handler's call does, saving the
// goroutine and the wake-up of an idle thread to run it. A watchdog looks
// at such calls every millisecond: one still running at its second look
// is left behind, the lane's receiving moving on to a new goroutine while
// the call runs on where it is, and the method's next calls run on
// goroutines of their own for a while (1, 2, 4 ... up to 1,024 calls
// after consecutive ones left behind, or that took longer than
// engine.LongCall, 200 µs, holding up the calls behind them on their
// lane; Stats.LeftBehind counts those left behind). A
// handler may so block on anything, even on a call of its own over the
// same session; what this option saves is the lane's wait of 1-2 ms
// behind a handler that blocks, or runs long, now and then. A small Send
// (its tensor in the frame) runs where its frame is read the same way:
// one that waits for pool memory is left behind.
func WithHandlerGoroutines() ServerOption {
	return serverOption(func(o *options) { o.handlersInGoroutines = true })
}

// WithGracefulStopTimeout bounds how long GracefulStop waits for calls
// under way (default DefaultGracefulStopTimeout); after it, GracefulStop
// ends them as Stop does.
func WithGracefulStopTimeout(d time.Duration) ServerOption {
	return serverOption(func(o *options) { o.gracefulStop = d })
}

// WithSessionQuota bounds the pool memory one session's Sends and Calls
// may bring into the server at once, counted while they come in (default
// DefaultSessionQuota). A request past it fails with ResourceExhausted for
// that session only; other sessions are not affected.
func WithSessionQuota(bytes int64) ServerOption {
	return serverOption(func(o *options) { o.sessionQuota = bytes })
}

// WithReservationTimeout sets how long the server's Read of a client's
// tensor (a Send or Call, or an indirect request) may stay unanswered
// (default DefaultReservationTimeout). A session that leaves one longer is
// ended and its memory freed, so a client that stops answering holds the
// server's memory only that long. 0 disables the check.
func WithReservationTimeout(d time.Duration) ServerOption {
	return serverOption(func(o *options) { o.reserveTimeout = d })
}

// WithStreamIdleTimeout sets how long a client's SendStream or CallStream
// may make no progress (deliver less than 64 KiB of its tensors' bytes)
// while the server waits for them (default DefaultStreamIdleTimeout); the
// stream then fails with DeadlineExceeded and its memory is freed. 0 waits
// as long as the stream lives.
func WithStreamIdleTimeout(d time.Duration) ServerOption {
	return serverOption(func(o *options) { o.streamIdle = d })
}

func buildServerOptions(opts []ServerOption) options {
	return buildOptions(opts, ServerOption.applyServer)
}
