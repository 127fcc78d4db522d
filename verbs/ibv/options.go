package ibv

// Option configures the provider returned by New.
type Option func(*options)

// options holds every knob of the provider. The defaults live in
// defaultOptions and nowhere else.
type options struct {
	device       string // device Open uses for name ""; "" means the first
	port         uint8  // 1-based port number
	gidIndex     int    // -1: select automatically
	mtu          int    // largest path MTU in bytes; 0: the port's active MTU
	trafficClass uint8  // RoCE traffic class (DSCP << 2 | ECN)
	hopLimit     uint8  // RoCE hop limit
	timeout      uint8  // local ACK timeout exponent: 4.096 µs << timeout
	retryCount   uint8  // transport retries before StatusTransport (0-7)
	rnrRetry     uint8  // RNR retries before StatusReceiverNotReady (0-7, 7 = forever)
	minRNRTimer  uint8  // RNR NAK timer code advertised to the sender (0-31)
	maxInline    int    // default inline size of queue pairs; 0: the device's
	sysfs        string // root of the sysfs tree; tests point it at fixtures
}

func defaultOptions() options {
	return options{
		port:         1,
		gidIndex:     -1,
		trafficClass: 0,
		hopLimit:     64,
		timeout:      14, // ≈67 ms per retry
		retryCount:   7,
		rnrRetry:     7,
		minRNRTimer:  12, // 0.64 ms
		maxInline:    64,
		sysfs:        "/sys",
	}
}

// WithDevice makes Open("") open the named device (e.g. "mlx5_0") instead of
// the first one listed.
func WithDevice(name string) Option { return func(o *options) { o.device = name } }

// WithPort selects the 1-based port of the device. The default is 1.
func WithPort(port uint8) Option { return func(o *options) { o.port = port } }

// WithGIDIndex fixes the source GID index. By default the provider picks the
// first RoCE v2 GID that holds an IPv4-mapped address, then the first RoCE v2
// GID, then index 0; on InfiniBand it uses index 0 and routes by LID.
func WithGIDIndex(index int) Option { return func(o *options) { o.gidIndex = index } }

// WithMTU caps the path MTU in bytes (256, 512, 1024, 2048 or 4096). Both
// ends use the smallest of their caps and their ports' active MTUs. Other
// values are rounded down to one of those; values below 256 mean 256.
func WithMTU(bytes int) Option { return func(o *options) { o.mtu = bytes } }

// WithTrafficClass sets the RoCE traffic class (DSCP in the upper six bits,
// ECN in the lower two) of the packets this side sends.
func WithTrafficClass(tc uint8) Option { return func(o *options) { o.trafficClass = tc } }

// WithRetry sets the transport retry count and the receiver-not-ready retry
// count (each 0 to 7; an RNR count of 7 retries forever). The defaults are
// 7 and 7.
func WithRetry(retryCount, rnrRetry uint8) Option {
	return func(o *options) {
		o.retryCount = min(retryCount, 7)
		o.rnrRetry = min(rnrRetry, 7)
	}
}

// WithTimeout sets the local ACK timeout exponent: a request is retried after
// 4.096 µs × 2^exponent without an ACK (0 to 31; 0 means wait forever). The
// default is 14, about 67 ms.
func WithTimeout(exponent uint8) Option {
	return func(o *options) { o.timeout = min(exponent, 31) }
}

// WithRNRTimer sets the minimal RNR NAK timer code (0 to 31, as in the
// InfiniBand specification) this side asks a sender to wait before it
// retries a Send that found no Recv posted. The default, 12, is 0.64 ms.
func WithRNRTimer(code uint8) Option {
	return func(o *options) { o.minRNRTimer = min(code, 31) }
}

// WithMaxInline sets the inline size requested for queue pairs whose
// QueuePairConfig.MaxInline is zero. The default is 64 bytes; the device may
// grant more or refuse it (then the provider retries without inline data).
func WithMaxInline(bytes int) Option { return func(o *options) { o.maxInline = max(bytes, 0) } }

// withSysfs points the provider at another sysfs root; tests use fixture
// trees.
func withSysfs(root string) Option { return func(o *options) { o.sysfs = root } }
