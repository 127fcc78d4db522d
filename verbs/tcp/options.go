package tcp

import (
	"log/slog"
	"net/netip"
	"time"
)

// Option configures the provider returned by New.
type Option func(*options)

type options struct {
	listenAddress    string
	advertiseAddress string
	dialTimeout      time.Duration
	handshakeTimeout time.Duration
	rnrTimeout       time.Duration
	lingerTimeout    time.Duration
	socketBuffer     int
	logger           *slog.Logger

	// Resolved by New from the options and the environment.
	listenFrom string     // where listenAddress came from
	ifSpec     string     // TENSORRPC_SOCKET_IFNAME, when it applies
	ifName     string     // the interface it picked
	ifAddr     netip.Addr // and that interface's address
}

// defaultOptions holds every default of the provider.
func defaultOptions() options {
	return options{
		dialTimeout:      10 * time.Second,
		handshakeTimeout: 10 * time.Second,
		rnrTimeout:       2 * time.Second,
		lingerTimeout:    2 * time.Second,
		logger:           slog.New(slog.DiscardHandler),
	}
}

// WithListenAddress sets the address each protection domain listens on for
// data connections, "host:port"; port 0 picks a free port per domain. It
// overrides the environment variables TENSORRPC_TCP_ADDR and
// TENSORRPC_SOCKET_IFNAME and the queue pair's
// verbs.QueuePairConfig.LocalAddress, except that a wildcard host
// (":7000", "0.0.0.0:7000", "[::]:7000") only sets the port: the host is
// then taken from the interface or the LocalAddress when there is one. By
// default a queue pair listens on its LocalAddress, or on 127.0.0.1 when it
// has none.
func WithListenAddress(addr string) Option {
	return func(o *options) { o.listenAddress = addr }
}

// WithAdvertiseAddress sets the address peers dial, as carried in
// LocalInfo: "host" (the listener's port is added) or "host:port". Use it
// when listening on a wildcard address or from inside a network namespace
// or container whose listen address peers cannot reach. By default peers
// dial the listener's own address. It does not change where the domain
// listens.
func WithAdvertiseAddress(addr string) Option {
	return func(o *options) { o.advertiseAddress = addr }
}

// WithLogger sets the logger of the provider's rare diagnostics (a failed
// accept, a refused data connection). By default nothing is logged; nil
// restores the default.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l == nil {
			l = slog.New(slog.DiscardHandler)
		}
		o.logger = l
	}
}

// WithDialTimeout bounds how long Connect waits for the data connection to
// be established, 10 seconds by default; Connect's context may end it
// sooner.
func WithDialTimeout(d time.Duration) Option {
	return func(o *options) { o.dialTimeout = d }
}

// WithHandshakeTimeout bounds how long an accepted connection may take to
// present its secret, 10 seconds by default.
func WithHandshakeTimeout(d time.Duration) Option {
	return func(o *options) { o.handshakeTimeout = d }
}

// WithRNRTimeout sets how long an incoming Send or WriteImm waits for a
// receive to be posted before it fails with StatusReceiverNotReady, 2
// seconds by default. The failure is fatal for both queue pairs, as a
// exhausted RNR retry count is in InfiniBand.
func WithRNRTimeout(d time.Duration) Option {
	return func(o *options) { o.rnrTimeout = d }
}

// WithLingerTimeout bounds how long a queue pair in the error state keeps
// its connection to deliver the error to the peer, 2 seconds by default.
func WithLingerTimeout(d time.Duration) Option {
	return func(o *options) { o.lingerTimeout = d }
}

// WithSocketBuffer sets the kernel send and receive buffer sizes of data
// connections. Zero, the default, leaves them to the kernel's autotuning,
// which is usually fastest.
func WithSocketBuffer(bytes int) Option {
	return func(o *options) { o.socketBuffer = bytes }
}
