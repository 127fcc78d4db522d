package rpc

import (
	"log/slog"
	"time"

	"google.golang.org/grpc"

	"github.com/tensorrpc/tensorrpc/gpudirect"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Transport names, in priority order: a session uses the first one both
// sides can use.
const (
	TransportIBV  = "ibv"
	TransportSHM  = "shm"
	TransportTCP  = "tcp"
	TransportGRPC = "grpc"
)

// allTransports is the default set, in priority order.
var allTransports = []string{TransportIBV, TransportSHM, TransportTCP, TransportGRPC}

// DefaultEagerThreshold is the largest tensor, in bytes, that travels inside
// the control message instead of over the data plane. It is where the two
// cost the same, measured with BenchmarkEagerThreshold (a Fetch inline
// against one over the data plane, same run, 2-core VM): over tcp, inline
// took 105 against 152 µs at 4 KiB, 143 against 164 µs at 16 KiB and 326
// against 184 µs at 64 KiB; over shm the two met at 4 KiB and the data plane
// won from 16 KiB on (88 against 147 µs).
const DefaultEagerThreshold = 16 << 10

// options holds the settings of a Server or a Client. Each field's default
// is set in defaultOptions, nowhere else.
type options struct {
	pool           *mempool.Pool
	poolOptions    []mempool.Option
	transports     []string
	providers      map[string]verbs.Provider
	eagerThreshold int
	maxTensorBytes int64
	connectTimeout time.Duration
	logger         *slog.Logger
	grpcServerOpts []grpc.ServerOption
	grpcDialOpts   []grpc.DialOption
	name           string
	topology       *gpudirect.Topology
}

func defaultOptions() options {
	return options{
		poolOptions:    []mempool.Option{mempool.WithBacking(mempool.BackingMemfd), mempool.WithName("tensorrpc")},
		transports:     allTransports,
		providers:      map[string]verbs.Provider{},
		eagerThreshold: DefaultEagerThreshold,
		maxTensorBytes: 4 << 30,
		connectTimeout: 10 * time.Second,
		logger:         slog.New(slog.DiscardHandler),
	}
}

// Option configures a Server (NewServer) or a Client (Dial, NewClient).
// Options that apply to only one of them say so and are ignored by the
// other.
type Option func(*options)

// WithPool makes the Server or Client carve tensors from p instead of a
// pool of its own. p must outlive it; it is not closed with it. Data planes
// register p's arenas with their devices, so p's backing decides which data
// planes can work: shm needs BackingMemfd.
func WithPool(p *mempool.Pool) Option { return func(o *options) { o.pool = p } }

// WithPoolOptions sets the options of the pool the Server or Client makes
// for itself (default: memfd backing, so that every data plane can use it,
// and mempool's default limit). They are appended to the defaults.
func WithPoolOptions(opts ...mempool.Option) Option {
	return func(o *options) { o.poolOptions = append(o.poolOptions, opts...) }
}

// WithTransports restricts the data planes to the named ones (TransportIBV,
// TransportSHM, TransportTCP, TransportGRPC). Leaving out TransportGRPC
// makes a session fail when no other data plane connects, instead of
// falling back.
func WithTransports(names ...string) Option {
	return func(o *options) { o.transports = append([]string(nil), names...) }
}

// WithProvider replaces the default provider of a data plane, e.g. a tcp
// provider that listens on another address. The provider's Name selects
// the data plane it serves.
func WithProvider(p verbs.Provider) Option {
	return func(o *options) { o.providers[p.Name()] = p }
}

// WithEagerThreshold sets the largest tensor, in bytes, that travels inline
// in control messages (default DefaultEagerThreshold). The server's value
// is used for a session.
func WithEagerThreshold(n int) Option { return func(o *options) { o.eagerThreshold = n } }

// WithMaxTensorBytes bounds the size of a tensor a peer may make this side
// allocate (default 4 GiB). Larger requests fail with ResourceExhausted.
func WithMaxTensorBytes(n int64) Option { return func(o *options) { o.maxTensorBytes = n } }

// WithConnectTimeout bounds how long connecting one data plane may take
// before the next is tried (default 10 s).
func WithConnectTimeout(d time.Duration) Option { return func(o *options) { o.connectTimeout = d } }

// WithLogger sets the logger (default: discard). tensorrpc logs session
// set-up and failures at Info and Warn, never per transfer.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithGRPCServerOptions passes options, such as grpc.Creds, to the
// grpc.Server that NewServer makes. Server only.
func WithGRPCServerOptions(opts ...grpc.ServerOption) Option {
	return func(o *options) { o.grpcServerOpts = append(o.grpcServerOpts, opts...) }
}

// WithGRPCDialOptions passes options, such as transport credentials, to the
// gRPC client connection that Dial makes. Without transport credentials
// Dial uses insecure ones. Client only.
func WithGRPCDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.grpcDialOpts = append(o.grpcDialOpts, opts...) }
}

// WithTopology gives the PCI topology that decides how device tensors
// move (default: gpudirect.Discover on first use). Client only.
func WithTopology(t *gpudirect.Topology) Option { return func(o *options) { o.topology = t } }

// WithName names the Client in the server's logs. Client only.
func WithName(name string) Option { return func(o *options) { o.name = name } }

func buildOptions(opts []Option) options {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return o
}
