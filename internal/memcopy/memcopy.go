// Package memcopy copies large byte ranges faster than the built-in copy
// where the Go runtime's own choice is slow.
//
// For copies of 1 MiB and more on amd64 CPUs with AVX, the runtime's
// memmove switches to non-temporal stores with a PREFETCHNTA ahead of each
// 128-byte block (unless it prefers REP MOVSB, on Intel CPUs with ERMS and
// FSRM: runtime/cpuflags_amd64.go and memmove_amd64.s as of Go 1.26). On
// the 2-core Xeon VM this project is developed on, that loop moves 2.8-3.7
// GB/s on one core at every size from 1 MiB, where a plain AVX loop of
// cached loads and stores moves 5.2 GB/s at 16 MiB and 11-17 GB/s at 1-4
// MiB (hot in the cache), and C's memcpy 4.5-4.8 GB/s at 16 MiB (memcopy's
// benchmark; RESULTS "Session 24"). Copy takes over the copies the runtime
// would run that loop for on every CPU of that kind, and leaves every
// other copy to the runtime (it declines, for example, all copies on an
// Intel CPU with FSRM, even the few the runtime streams there).
//
// On AMD CPUs the runtime's streaming loop is fast, and Copy's loop wins
// only while both buffers sit in the cache. On a 2-core AMD EPYC (Zen 3,
// 32 MiB L3) VM, hot buffers: the loop 30 GB/s at 1-4 MiB against the
// runtime's 20, even at 6 MiB (24 against 21), behind from 7 MiB (19
// against 21) and at 8-256 MiB (7.2-11 GB/s against 11.6-15.4); buffers
// cycled over 96 MiB (cold): the runtime's 12.6-14 GB/s against the
// loop's 8.0-8.8 at every size from 1 MiB (RESULTS "Session 29"). So on
// CPUs other than Intel's, Copy runs its loop only up to an eighth of the
// last-level cache (Limit; 4 MiB there), and leaves larger copies to the
// runtime.
//
// The data plane's copies (shared memory's Reads and Writes, a Fetch into
// a caller's memory) go through Copy; TENSORRPC_COPY=runtime turns it off
// (every copy the built-in), for a measurement or a CPU where it loses.
// TENSORRPC_COPY=share keeps Copy's loop and also shares shared memory's
// copies of 256 KiB and more with idle spinning goroutines (Share, Help;
// off by default until measured on a many-core machine).
// Race detector and sanitizer builds always use the built-in copy, which
// they check (they cannot see into assembly).
package memcopy

import (
	"fmt"
	"os"
	"strings"
)

// Env is the environment variable that chooses the copy: "auto" (the
// default: Copy's loop where the runtime would use its non-temporal loop)
// or "runtime" (the built-in copy always).
const Env = "TENSORRPC_COPY"

// MinBytes is the smallest copy Copy runs its own loop for: the size from
// which the runtime's memmove switches to its non-temporal loop.
const MinBytes = 1 << 20

// chunk is how much one call of the assembly loop copies: between chunks
// the goroutine can be preempted (an assembly loop cannot), so a large
// copy does not hold up a garbage collection's stop for milliseconds.
const chunk = 256 << 10

// envRuntime is whether TENSORRPC_COPY said "runtime" when the process
// started: the environment is read once, and Active reports what Copy
// does, not what a later change of the environment would make it do.
var envRuntime = !parseEnv(os.Getenv(Env))

// enabled reports whether Copy runs its own loop for large copies.
var enabled = !envRuntime && haveLoop() && !checked

// maxBytes is the largest copy Copy runs its loop for, 0 for no bound.
var maxBytes = loopMax()

// Limit is the largest copy Copy runs its own loop for where it is active
// (Active), 0 when no size is too large for it: larger copies are the
// built-in's.
func Limit() int { return maxBytes }

// useLoop reports whether Copy runs its loop for a copy of n bytes.
func useLoop(n int) bool { return enabled && n >= MinBytes && (maxBytes == 0 || n <= maxBytes) }

// ParseEnv checks a value of TENSORRPC_COPY: nil for "", "auto",
// "share" and "runtime" (in any case, spaces around ignored), an error
// naming the variable otherwise.
func ParseEnv(v string) error {
	switch norm(v) {
	case "", "auto", "share", "runtime":
		return nil
	}
	return fmt.Errorf("%s=%q: want auto, share or runtime", Env, v)
}

func parseEnv(v string) bool { return norm(v) != "runtime" }

func norm(v string) string { return strings.ToLower(strings.TrimSpace(v)) }

// Active reports whether Copy runs its own loop in this process (on this
// CPU, with TENSORRPC_COPY as it was when the process started), and why
// not when it does not (for tensorrpc doctor).
func Active() (bool, string) {
	switch {
	case envRuntime:
		return false, Env + "=runtime"
	case !haveLoop():
		return false, whyNot()
	case checked:
		return false, "a race detector or sanitizer build (it checks the built-in copy)"
	}
	return true, ""
}

// Copy is copy(dst, src) for dst and src that do not overlap: it copies
// min(len(dst), len(src)) bytes and returns that count. Copies of MinBytes
// and more, up to Limit, run Copy's own loop where it is active (see the
// package comment); all others, and overlapping ranges, the built-in copy.
func Copy(dst, src []byte) int {
	n := min(len(dst), len(src))
	if !useLoop(n) || overlap(dst[:n], src[:n]) {
		return copy(dst, src)
	}
	bulk(dst[:n], src[:n])
	return n
}

// bulk copies len(src) bytes, at least MinBytes, from src to dst with the
// assembly loop: a head to align dst to 32 bytes, whole chunks of 128-byte
// blocks, and a tail by the built-in copy.
func bulk(dst, src []byte) {
	head := int(-uintptrOf(dst) & 31)
	copy(dst[:head], src[:head])
	dst, src = dst[head:], src[head:]
	for len(dst) >= 128 {
		m := min(len(dst), chunk) &^ 127
		loop(dst[:m], src[:m])
		dst, src = dst[m:], src[m:]
	}
	copy(dst, src)
}
