package shm

import (
	"fmt"
	"runtime"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// ErrOtherHost is returned by Connect when the peer's connection info comes
// from another host (its host identity differs from ours). It wraps
// verbs.ErrInvalidInfo, so callers that only know verbs still see an invalid
// info error and can fall back to another provider.
var ErrOtherHost = fmt.Errorf("shm: peer is on another host (host identities differ): %w", verbs.ErrInvalidInfo)

// Option configures the provider made by New.
type Option func(*options)

type options struct {
	socketDir         string
	socketPrefix      string
	rnrTimeout        time.Duration
	stagingSize       int
	handshakeTimeout  time.Duration
	deregisterTimeout time.Duration
	inlineLimit       int
	// socketControl keeps control messages on the unix socket, as before
	// the shared rings; unexported, for comparisons. A queue pair uses the
	// rings only when both ends want them.
	socketControl bool
	// ringSpin is how long a receiver polls its empty ring before it
	// sleeps on the socket.
	ringSpin time.Duration
	// copyWorkers is how many goroutines one large Write or Read copies on.
	copyWorkers int
	// cmaProbeErrno, when not 0, makes every probe of cross-memory attach
	// fail with it without trying (for tests of the refusal).
	cmaProbeErrno syscall.Errno
	// cmaChunk, when not 0, caps every process_vm_readv and
	// process_vm_writev of a copy at that many bytes, so that each copy
	// is a run of short transfers (for tests).
	cmaChunk int
}

// defaultOptions holds every default of the provider in one place.
func defaultOptions() options {
	return options{
		socketPrefix:      "tensorrpc-shm-",
		rnrTimeout:        time.Second,
		stagingSize:       256 << 10,
		handshakeTimeout:  10 * time.Second,
		deregisterTimeout: 5 * time.Second,
		inlineLimit:       1 << 30,
		ringSpin:          defaultRingSpin,
		copyWorkers:       runtime.GOMAXPROCS(0),
	}
}

// WithCopyWorkers sets how many goroutines one Write or Read of at least
// 16 MiB copies on, each taking at least 8 MiB of it (default GOMAXPROCS
// at New; 1 copies on the posting goroutine only). More workers use more
// cores for one large transfer; concurrent transfers already spread over
// cores by themselves. On a 2-core VM (BenchmarkCopyWorkers) two workers
// moved 16 and 64 MiB 1.1–1.5× faster than one and 8 MiB no faster, which
// set the 8 MiB part.
func WithCopyWorkers(n int) Option {
	return func(o *options) { o.copyWorkers = max(n, 1) }
}

// WithSocketDir makes each domain listen on a unix socket file in dir
// instead of the abstract namespace. The file is removed when the domain
// closes. Use it where abstract sockets are unavailable or where file
// permissions should restrict who may connect.
func WithSocketDir(dir string) Option {
	return func(o *options) { o.socketDir = dir }
}

// WithSocketPrefix sets the prefix of the domain's socket name; a random
// suffix follows it. The default is "tensorrpc-shm-".
func WithSocketPrefix(prefix string) Option {
	return func(o *options) { o.socketPrefix = prefix }
}

// WithRNRTimeout sets how long an incoming Send or WriteImm waits for a
// posted Recv before the initiator's request fails with
// StatusReceiverNotReady. The default is one second.
func WithRNRTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.rnrTimeout = d
		}
	}
}

// WithStagingSize sets the size of each queue pair's Send staging buffer,
// the shared memory a Send payload passes through. Larger Sends are moved in
// chunks of this size. The default is 256 KiB.
func WithStagingSize(n int) Option {
	return func(o *options) {
		if n >= 4096 && n <= maxStagingSize {
			o.stagingSize = n
		}
	}
}

// WithHandshakeTimeout bounds how long an accepted data connection may take
// to present its hello. The default is ten seconds.
func WithHandshakeTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.handshakeTimeout = d
		}
	}
}

// WithDeregisterTimeout bounds how long Deregister waits for a connected
// peer to confirm that it unmapped the region. A peer that does not answer
// in time has its queue pair failed. The default is five seconds.
func WithDeregisterTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.deregisterTimeout = d
		}
	}
}

// WithInlineLimit sets the largest Write or Read that PostSend performs
// itself, in the caller's goroutine, when the queue pair has nothing else
// queued and the peer's region is already mapped: the copy is done and the
// completion queued before PostSend returns, which saves two goroutine
// hand-offs per request. Larger requests, and requests queued behind
// others, are executed by the queue pair's own goroutine. A queue pair's
// QueuePairConfig.MaxInline, when not zero, overrides this limit. Zero
// disables inline execution. The default is 1 GiB.
func WithInlineLimit(n int) Option {
	return func(o *options) {
		if n >= 0 {
			o.inlineLimit = n
		}
	}
}

// defaultRingSpin is how long a receiver polls its empty control ring
// before it sleeps on the socket.
const defaultRingSpin = 20 * time.Microsecond

// maxStagingSize bounds the staging buffer a peer may ask us to map.
const maxStagingSize = 64 << 20

// withSocketControl makes queue pairs keep their control messages on the
// unix socket instead of shared rings (for benchmarks and tests).
func withSocketControl() Option {
	return func(o *options) { o.socketControl = true }
}

// withRingSpin sets how long a receiver polls its empty control ring before
// it sleeps on the socket; zero sleeps at once.
func withRingSpin(d time.Duration) Option {
	return func(o *options) {
		if d >= 0 {
			o.ringSpin = d
		}
	}
}

// withCMAProbeErrno makes every probe of cross-memory attach, each side's
// at connect, fail with errno, as the kernel would (for tests).
func withCMAProbeErrno(errno syscall.Errno) Option {
	return func(o *options) { o.cmaProbeErrno = errno }
}

// withCMAChunk caps each system call of a copy by cross-memory attach at
// n bytes, as a kernel that moves less than asked would (for tests).
func withCMAChunk(n int) Option {
	return func(o *options) { o.cmaChunk = n }
}
