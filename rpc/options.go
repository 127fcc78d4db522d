package rpc

import (
	"log/slog"
	"runtime"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// DefaultEagerThreshold is the largest tensor, in bytes, that travels inside
// the control message instead of over the data plane. It is where the two
// cost the same, measured with BenchmarkEagerThreshold (a Fetch inline
// against one over the data plane, same run, 2-core VM): over tcp, inline
// took 105 against 152 µs at 4 KiB, 143 against 164 µs at 16 KiB and 326
// against 184 µs at 64 KiB; over shm the two met at 4 KiB and the data plane
// won from 16 KiB on (88 against 147 µs).
const DefaultEagerThreshold = 16 << 10

// DefaultFetchLanding is the largest tensor a Fetch on a tcp data plane
// asks the server to Write straight into the client's pool before it
// answers (a landing, see WithFetchLanding) unless WithFetchLanding says
// otherwise: 4 MiB. Past it the Read's round trip is a small part of the
// transfer (a 4 MiB tcp Fetch read at 0.97× a socket's speed on the 2-core
// VM), and the landing is pool memory granted before the size is known.
const DefaultFetchLanding = 4 << 20

// DefaultMaxTensorBytes is the largest tensor a peer may make this side
// allocate unless WithMaxTensorBytes says otherwise: 1 GiB.
const DefaultMaxTensorBytes = 1 << 30

// DefaultPoolLimit is the limit of the pool a Server or Client makes for
// itself: room for several tensors of DefaultMaxTensorBytes at once (the
// pool maps memory as it grows, so the limit costs nothing until used).
const DefaultPoolLimit = 4 * DefaultMaxTensorBytes

// DefaultConnectTimeout bounds the connection of one data plane during
// negotiation. A plane whose peer reports failure is abandoned at once; the
// timeout matters only when packets vanish (a firewall that drops them).
const DefaultConnectTimeout = 5 * time.Second

// DefaultTrimInterval is how often a Server or Client gives the memory of
// pool arenas that stayed empty back to the system.
const DefaultTrimInterval = 30 * time.Second

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
	creds          credentials.TransportCredentials
	dataAddress    string
	name           string
	topology       *gpudirect.Topology
	backoff        backoff.Config
	gracefulStop   time.Duration
	trimInterval   time.Duration
	checksums      bool
	fetchLanding   int // WithFetchLanding
	sessionQuota   int64
	reserveTimeout time.Duration
	// noReservations makes a server one from before reserved Sends
	// (SendRequest.reserve): tests of the client's fallback set it.
	noReservations bool
	streamIdle     time.Duration
	admission      Admission
	lanes          int           // 0: DefaultLanes for each data plane
	pollSpin       time.Duration // how long a caller polls or watches for its answer (EnvPollSpin)
	pollSet        bool          // EnvPollSpin was given: Go callers poll a peer in another process on few Ps too
	noHealth       bool          // WithoutHealth
	// handlersInGoroutines: WithHandlerGoroutines.
	handlersInGoroutines bool
	stageChunk           int   // 0: gpudirect.DefaultStageChunk
	envErr               error // an environment variable that could not be read (applyEnv)
	interceptors         []Interceptor
	compression          string // WithCompression; "" is auto
	// mayBlock counts the interceptors given with WithInterceptors (not
	// WithInlineInterceptors): with any, no call is served on a lane's
	// receiving goroutine.
	mayBlock    int
	cuda        ipcDriver           // WithCUDA: CUDA IPC (rpc/ipc.go)
	deviceAlloc gpudirect.Allocator // WithDeviceAllocator
	ipcHost     string              // tests: the host identity CUDA IPC compares
	ipcProcess  string              // tests: the process identity CUDA IPC compares
	// frameServe, set by the package's tests, wraps the frame handler of
	// each lane of a server's session as the session sets it up.
	frameServe func(ss *serverSession, lane int, serve func(wire.FrameHeader, []byte)) func(wire.FrameHeader, []byte)
}

func defaultOptions() options {
	return options{
		poolOptions:    []mempool.Option{mempool.WithBacking(mempool.BackingMemfd), mempool.WithName("tensorrpc"), mempool.WithLimit(DefaultPoolLimit)},
		transports:     allTransports,
		providers:      map[string]verbs.Provider{},
		eagerThreshold: DefaultEagerThreshold,
		fetchLanding:   DefaultFetchLanding,
		pollSpin:       engine.PollSpin,
		maxTensorBytes: DefaultMaxTensorBytes,
		connectTimeout: DefaultConnectTimeout,
		logger:         slog.New(slog.DiscardHandler),
		backoff:        backoff.DefaultConfig,
		gracefulStop:   DefaultGracefulStopTimeout,
		trimInterval:   DefaultTrimInterval,
		sessionQuota:   DefaultSessionQuota,
		reserveTimeout: DefaultReservationTimeout,
		streamIdle:     DefaultStreamIdleTimeout,
	}
}

// ServerOption configures a Server (NewServer).
type ServerOption interface{ applyServer(*options) }

// DialOption configures a Client (Dial, NewClient).
type DialOption interface{ applyDial(*options) }

// Option configures either side: it is both a ServerOption and a
// DialOption.
type Option interface {
	ServerOption
	DialOption
}

type sharedOption func(*options)

func (f sharedOption) applyServer(o *options) { f(o) }
func (f sharedOption) applyDial(o *options)   { f(o) }

type serverOption func(*options)

func (f serverOption) applyServer(o *options) { f(o) }

type dialOption func(*options)

func (f dialOption) applyDial(o *options) { f(o) }

// WithPool makes the Server or Client carve tensors from p instead of a
// pool of its own. p must outlive it; it is not closed with it. Data planes
// register p's arenas with their devices, so p's backing decides which data
// planes can work: shm needs BackingMemfd.
func WithPool(p *mempool.Pool) Option { return sharedOption(func(o *options) { o.pool = p }) }

// WithPoolOptions sets the options of the pool the Server or Client makes
// for itself (default: memfd backing, so that every data plane can use it,
// and a limit of DefaultPoolLimit). They are appended to the defaults.
func WithPoolOptions(opts ...mempool.Option) Option {
	return sharedOption(func(o *options) { o.poolOptions = append(o.poolOptions, opts...) })
}

// WithTransports restricts the data planes to the named ones (TransportIBV,
// TransportSHM, TransportTCP, TransportGRPC). Leaving out TransportGRPC
// makes a session fail when no other data plane connects, instead of
// falling back.
func WithTransports(names ...string) Option {
	return sharedOption(func(o *options) { o.transports = append([]string(nil), names...) })
}

// WithProvider replaces the default provider of a data plane, e.g. a tcp
// provider with options of its own. The provider's Name selects the data
// plane it serves.
func WithProvider(p verbs.Provider) Option {
	return sharedOption(func(o *options) { o.providers[p.Name()] = p })
}

// WithMaxTensorBytes bounds the size of a tensor a peer may make this side
// allocate (default DefaultMaxTensorBytes). Larger tensors fail with
// ResourceExhausted, on the side whose limit they exceed.
func WithMaxTensorBytes(n int64) Option {
	return sharedOption(func(o *options) { o.maxTensorBytes = n })
}

// WithConnectTimeout bounds how long connecting one data plane may take
// before the next is tried (default DefaultConnectTimeout). A data plane
// the peer reports as failed is abandoned at once, without waiting.
func WithConnectTimeout(d time.Duration) Option {
	return sharedOption(func(o *options) { o.connectTimeout = d })
}

// WithLogger sets the logger (default: discard). tensorrpc logs session
// set-up, refused data planes and failures at Info and Warn, never per
// transfer.
func WithLogger(l *slog.Logger) Option { return sharedOption(func(o *options) { o.logger = l }) }

// MaxLanes bounds WithLanes.
const MaxLanes = 16

// WithLanes sets how many queue pairs (lanes) a session opens on its data
// plane (default: DefaultLanes for the plane and this machine). Concurrent
// calls spread over the lanes, each with its own connection and polling
// goroutine; a session uses the smaller of the client's and the server's
// number. n is clamped to 1..MaxLanes; 0 restores the default.
func WithLanes(n int) Option {
	return sharedOption(func(o *options) { o.lanes = min(max(n, 0), MaxLanes) })
}

// WithStagingChunk sets the size of the chunks in which a staged device
// tensor moves (SendDevice, FetchToDevice, PublishDevice of an
// asynchronous device buffer, gpudirect.AsyncBuffer): the device copy of
// one chunk overlaps the data-plane transfer of another, through a ring of
// gpudirect.DefaultStageSlots chunks of pool memory. 0 restores the
// default, gpudirect.DefaultStageChunk (8 MiB); sizes are rounded up to
// 4 KiB.
func WithStagingChunk(n int) Option {
	return sharedOption(func(o *options) { o.stageChunk = (max(n, 0) + 4095) &^ 4095 })
}

// DefaultLanes is the number of lanes a session opens on the named data
// plane when WithLanes is not given: on tcp, ibv and shm, half the cores,
// at least 2 (1 on one core) and at most 8; always 1 on grpc. Measured
// (benchmarks/RESULTS.md, "Lanes"): on 2 cores, 2 lanes against 1 kept
// one stream's 4 KiB latency (calls one after another stay on the least
// busy lane) and took 4 streams of 4 KiB shm Fetches from a p50 of 90 to
// 26 µs and of 64 MiB tcp ones from 0.63× to 0.92× of 4 sockets; on 16 cores, 16
// streams of 1 MiB and 64 MiB tcp Fetch reach 0.24× and 0.40× of 16
// sockets with 4 lanes, 0.42× and 0.74× with 8, 0.54× and 0.88× with 16,
// at no cost to one stream's 4 KiB latency. 8 and not 16: each lane is a
// connection with its receive slots, and the server's default admission
// budget (Admission.LanesPerPeer, 64) then still gives 8 sessions from
// one host all their lanes. 4 to 7 cores are not measured.
func DefaultLanes(transport string, cores int) int {
	switch transport {
	case TransportTCP, TransportIBV, TransportSHM:
		return max(min(cores/2, 8), min(cores, 2))
	}
	return 1
}

// lanesFor is the lanes this side wants on transport.
func (o options) lanesFor(transport string) int {
	if transport == TransportGRPC {
		return 1
	}
	if o.lanes > 0 {
		return o.lanes
	}
	return DefaultLanes(transport, runtime.NumCPU())
}

// WithTrimInterval sets how often the Server or Client returns the memory
// of pool arenas that were empty at the previous check to the system
// (default DefaultTrimInterval; 0 never does). A spike of large tensors
// then costs memory only until the next checks, not for the life of the
// process. It applies to the pool the Server or Client makes for itself,
// not to one given with WithPool.
func WithTrimInterval(d time.Duration) Option {
	return sharedOption(func(o *options) { o.trimInterval = d })
}

// WithChecksums makes this side send a CRC32C of every tensor it sends
// (TensorMeta.crc32c), on every path. Receivers always verify a checksum
// that is present, whatever their own setting, and fail the transfer with
// DataLoss when it does not match. Off by default: at data-plane speeds
// the checksum costs a pass over the bytes on each side (hash/crc32 does
// about 25 GB/s here), and TCP and the RDMA link layer already check what
// they carry.
func WithChecksums(on bool) Option { return sharedOption(func(o *options) { o.checksums = on }) }

// WithFetchLanding sets the largest tensor, in bytes, that a Fetch on a
// tcp data plane lands (default DefaultFetchLanding; 0 turns landing off
// on this side). A client that fetched a key before, at a size between
// the eager threshold and this bound, grants a pool buffer of that size
// writable with its next request for the key; the server Writes the
// tensor into it, then answers, and the client's Read of the bytes (a
// round trip, and the transfer's release) is saved: a 64 KiB tcp Fetch
// takes one round trip instead of two. A tensor that has grown past the
// landing, or a server that takes none, is fetched as before. The
// session uses the smaller of the two sides' bounds. A Fetch with Into
// lands in the Into tensor's own memory (caller memory the provider
// registers, or pool memory), from the first Fetch on, and only a tensor
// of exactly its dtype and shape (another is refused as before, that
// memory untouched). A Fetch with Rows or Lease never lands, nor, from
// 1 MiB (where compression may start), one that a compressing session's
// mode would compress. A Call's reply tensors that do not go inline land
// the same way, in buffers sized as the method's last reply's were.
func WithFetchLanding(n int) Option {
	return sharedOption(func(o *options) { o.fetchLanding = max(n, 0) })
}

// buildOptions is the defaults, then the environment, then opts in order.
func buildOptions[T any](opts []T, apply func(T, *options)) options {
	o := defaultOptions()
	o.applyEnv()
	for _, opt := range opts {
		apply(opt, &o)
	}
	return o
}
