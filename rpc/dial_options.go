package rpc

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"

	"github.com/tensorrpc/tensorrpc/gpudirect"
)

// The options only a Client takes (Dial, NewClient). Options both sides
// take are in options.go, a Server's in server_options.go.

// WithTransportCredentials sets the credentials of the gRPC connection that
// Dial makes: TLS credentials, or insecure.NewCredentials() for plaintext.
// Dial requires them, as grpc.NewClient does; there is no silent insecure
// default.
func WithTransportCredentials(c credentials.TransportCredentials) DialOption {
	return dialOption(func(o *options) { o.creds = c })
}

// WithGRPCDialOptions passes options to the gRPC client connection that
// Dial makes. As with WithGRPCServerOptions, its interceptors see the gRPC
// methods only: calls of a data-plane session travel as frames; its
// message-size call options bind the gRPC plane's calls only (see there).
func WithGRPCDialOptions(opts ...grpc.DialOption) DialOption {
	return dialOption(func(o *options) { o.grpcDialOpts = append(o.grpcDialOpts, opts...) })
}

// WithTopology gives the PCI topology that decides how device tensors
// move (default: gpudirect.Discover on first use).
func WithTopology(t *gpudirect.Topology) DialOption {
	return dialOption(func(o *options) { o.topology = t })
}

// WithName names the Client in the server's logs.
func WithName(name string) DialOption { return dialOption(func(o *options) { o.name = name }) }

// WithBackoff sets how the Client waits between attempts to re-establish a
// session that ended (default: gRPC's backoff.DefaultConfig: 1 s, growing
// 1.6× with 20 % jitter up to 120 s).
func WithBackoff(c backoff.Config) DialOption { return dialOption(func(o *options) { o.backoff = c }) }

func buildDialOptions(opts []DialOption) options {
	return buildOptions(opts, DialOption.applyDial)
}
