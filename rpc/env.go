package rpc

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// Environment variables. NewServer, Dial and NewClient read them once each,
// when they build their options; an explicit option wins over the
// environment. A value that cannot be understood makes NewServer or Dial
// fail with an error that names the variable, rather than being ignored.
//
// EnvKnobs lists them with their current values (tensorrpc doctor prints
// that table).
const (
	// EnvLog turns logging on without code changes, like NCCL_DEBUG or
	// GRPC_GO_LOG_SEVERITY_LEVEL: "debug", "info", "warn" or "error"
	// (NCCL's TRACE, INFO and WARN are accepted too; "off" or unset: no
	// logs). Logs go to stderr. Used when WithLogger is not given.
	EnvLog = "TENSORRPC_LOG"
	// EnvLogFormat is the format of those logs: "text" (default, slog's
	// key=value lines) or "json" (one JSON object a line).
	EnvLogFormat = "TENSORRPC_LOG_FORMAT"
	// EnvTransports restricts the data planes, like UCX_TLS: a
	// comma-separated list of the planes to enable ("shm,tcp,grpc"), or
	// "^" and a list to exclude ("^ibv,shm"). Negotiation still prefers
	// ibv > shm > tcp > grpc among the enabled ones. Used when
	// WithTransports is not given. A list without grpc has no fallback: sessions fail when no
	// listed data plane connects.
	EnvTransports = "TENSORRPC_TRANSPORTS"
	// EnvSocketIfname and EnvTCPAddr choose the tcp data plane's address:
	// see package verbs/tcp (TENSORRPC_SOCKET_IFNAME in NCCL's syntax,
	// TENSORRPC_TCP_ADDR as host[:port]). WithDataAddress wins over both.
	EnvSocketIfname = tcp.EnvSocketIfname
	EnvTCPAddr      = tcp.EnvAddr
	// EnvLanes sets the lanes (queue pairs) a session opens on its data
	// plane, 1 to MaxLanes, as WithLanes does. Used when WithLanes is not
	// given.
	EnvLanes = "TENSORRPC_LANES"
	// EnvPollSpin is how long, in microseconds, a caller alone on its
	// lane polls (shm) or, when it called from a foreign thread through
	// the C ABI, watches (tcp; not while the process has no P to spare
	// for its receivers) for its answer before it parks: 0 to
	// 1000, default 50 (a watch on tcp lasts twice as long as the link's
	// recent waits, up to 8 times this). Longer spins trade a core's time for the
	// wake-up of a parked caller (an OS wake-up for a thread-locked one);
	// a tuning knob for measurements, like UCX's and NCCL's spin counts.
	// Unset, a Go caller in a process of at most 2 Ps polls an shm peer
	// only when the peer is this process (between two processes on 2
	// cores, polling made the tail of small calls 2-5 times longer); set,
	// it polls any peer. Unset, a caller through the C ABI polls shm 4
	// times as long (200 µs); set, exactly as long as it says.
	EnvPollSpin = "TENSORRPC_POLL_US"
	// EnvCopy chooses how the data planes copy 1 MiB and more in memory
	// (shared memory's Reads and Writes, a Fetch into a caller's tensor):
	// "auto" (default) with a loop of cached 256-bit loads and stores where
	// the Go runtime's copy would use its non-temporal loop (amd64 CPUs
	// with AVX but not both ERMS and FSRM on Intel; measured 1.5-3.8x
	// faster on a 2-core Xeon VM; on other CPUs than Intel's only up to
	// an eighth of the last-level cache, past which the runtime's loop is
	// the faster: 4 MiB on an AMD EPYC with 32 MiB of L3), "runtime" with
	// Go's built-in copy. Read once, when the process starts; NewServer
	// and Dial check its value.
	EnvCopy = memcopy.Env
)

// Knob is one environment variable tensorrpc reads, as EnvKnobs reports it.
type Knob struct {
	Name    string `json:"name"`
	Value   string `json:"value"` // "" when unset
	Default string `json:"default"`
	Meaning string `json:"meaning"`
}

// EnvKnobs returns every environment variable tensorrpc reads, with its
// value in this process's environment now.
func EnvKnobs() []Knob {
	k := []Knob{
		{Name: EnvLog, Default: "off", Meaning: "log level to stderr: debug, info, warn, error or off (NCCL's TRACE, INFO, WARN too)"},
		{Name: EnvLogFormat, Default: "text", Meaning: "log format: text or json"},
		{Name: EnvTransports, Default: strings.Join(allTransports, ","), Meaning: "data planes to enable (negotiation prefers ibv > shm > tcp > grpc), or ^list to exclude"},
		{Name: EnvSocketIfname, Default: "the gRPC connection's local address", Meaning: "tcp data plane interface (NCCL_SOCKET_IFNAME syntax: prefixes, =exact, ^exclude)"},
		{Name: EnvTCPAddr, Default: "unset", Meaning: "tcp data plane listen address host[:port]"},
		{Name: EnvLanes, Default: "cores/2, at least 2 (1 on one core), at most 8", Meaning: "queue pairs (lanes) a session opens on its data plane, 1 to 16"},
		{Name: EnvCompression, Default: CompressionAuto, Meaning: "compression of tensors on tcp and the gRPC fallback: off, auto (when it pays on the link), s2, zstd or huff0"},
		{Name: EnvCopy, Default: "auto", Meaning: copyMeaning()},
		{Name: EnvPollSpin, Default: fmt.Sprint(engine.PollSpin.Microseconds()), Meaning: "microseconds a caller alone on its lane polls (shm; unset, a Go caller in a process of at most 2 Ps only when the peer is this process, and a C ABI caller 4 times as long) or watches (tcp, C ABI callers; up to 8 times as long when the link's answers take longer) for its answer before it parks, 0 to 1000"},
	}
	for i := range k {
		k[i].Value = os.Getenv(k[i].Name)
	}
	return k
}

// copyMeaning says what EnvCopy does and whether its loop runs here.
func copyMeaning() string {
	m := "in-memory copies of 1 MiB and more: auto (a loop of cached AVX loads and stores where Go's copy would stream) or runtime (Go's copy)"
	if ok, why := memcopy.Active(); !ok {
		return m + "; here Go's copy (" + why + ")"
	}
	if lim := memcopy.Limit(); lim > 0 {
		size := fmt.Sprintf("%d KiB", lim>>10)
		if lim%(1<<20) == 0 {
			size = fmt.Sprintf("%d MiB", lim>>20)
		}
		return m + "; here the loop up to " + size + ", Go's copy above"
	}
	return m + "; here the loop"
}

// applyEnv sets the defaults the environment asks for; options applied
// after it override them. The first value it cannot read is kept in
// o.envErr.
func (o *options) applyEnv() {
	if v := strings.TrimSpace(os.Getenv(EnvLog)); v != "" {
		l, err := envLogger(v, os.Getenv(EnvLogFormat))
		if err != nil {
			o.envErr = err
		} else if l != nil {
			o.logger = l
		}
	}
	if v := strings.TrimSpace(os.Getenv(EnvLanes)); v != "" {
		n, err := strconv.Atoi(v)
		switch {
		case (err != nil || n < 1 || n > MaxLanes) && o.envErr == nil:
			o.envErr = fmt.Errorf("tensorrpc: %s=%q: want a number of lanes from 1 to %d", EnvLanes, v, MaxLanes)
		case err == nil && n >= 1 && n <= MaxLanes:
			o.lanes = n
		}
	}
	if v := strings.TrimSpace(os.Getenv(EnvPollSpin)); v != "" {
		n, err := strconv.Atoi(v)
		switch {
		case (err != nil || n < 0 || n > 1000) && o.envErr == nil:
			o.envErr = fmt.Errorf("tensorrpc: %s=%q: want microseconds from 0 to 1000", EnvPollSpin, v)
		case err == nil && n >= 0 && n <= 1000:
			o.pollSpin, o.pollSet = time.Duration(n)*time.Microsecond, true
		}
	}
	if v := strings.TrimSpace(os.Getenv(EnvCompression)); v != "" {
		if _, err := parseCompression(v); err != nil && o.envErr == nil {
			o.envErr = fmt.Errorf("%s: %w", EnvCompression, err)
		} else if err == nil {
			o.compression = v
		}
	}
	if err := memcopy.ParseEnv(os.Getenv(EnvCopy)); err != nil && o.envErr == nil {
		o.envErr = fmt.Errorf("tensorrpc: %w", err)
	}
	if v := strings.TrimSpace(os.Getenv(EnvTransports)); v != "" {
		ts, err := parseTransports(v)
		if err != nil && o.envErr == nil {
			o.envErr = err
		} else if err == nil {
			o.transports = ts
		}
	}
}

func envLogger(level, format string) (*slog.Logger, error) {
	var lv slog.Level
	switch strings.ToLower(level) {
	case "off", "none", "0":
		return nil, nil
	case "debug", "trace":
		lv = slog.LevelDebug
	case "info":
		lv = slog.LevelInfo
	case "warn", "warning":
		lv = slog.LevelWarn
	case "error":
		lv = slog.LevelError
	default:
		return nil, fmt.Errorf("tensorrpc: %s=%q: want debug, info, warn, error or off", EnvLog, level)
	}
	ho := &slog.HandlerOptions{Level: lv}
	switch strings.ToLower(strings.TrimSpace(format)) {
	case "", "text":
		return slog.New(slog.NewTextHandler(os.Stderr, ho)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, ho)), nil
	}
	return nil, fmt.Errorf("tensorrpc: %s=%q: want text or json", EnvLogFormat, format)
}

// parseTransports reads an EnvTransports value.
func parseTransports(v string) ([]string, error) {
	exclude := strings.HasPrefix(v, "^")
	var names []string
	for _, n := range strings.Split(strings.TrimPrefix(v, "^"), ",") {
		n = strings.ToLower(strings.TrimSpace(n))
		if n == "" {
			continue
		}
		if !slices.Contains(allTransports, n) {
			return nil, fmt.Errorf("tensorrpc: %s=%q: unknown transport %q (known: %s)", EnvTransports, v, n, strings.Join(allTransports, ", "))
		}
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("tensorrpc: %s=%q names no transport", EnvTransports, v)
	}
	if !exclude {
		return names, nil
	}
	var keep []string
	for _, n := range allTransports {
		if !slices.Contains(names, n) {
			keep = append(keep, n)
		}
	}
	if len(keep) == 0 {
		return nil, fmt.Errorf("tensorrpc: %s=%q excludes every transport", EnvTransports, v)
	}
	return keep, nil
}
