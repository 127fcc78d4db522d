//go:build linux

package mempool

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

func TestMain(m *testing.M) {
	if os.Getenv(ringChildEnv) != "" {
		os.Exit(ringChild())
	}
	leakcheck.Main(m)
}

// newTestPool makes a pool for a test. Pinning is off unless the options
// turn it on: pinning faults every page in, which tests rarely need.
func newTestPool(t testing.TB, opts ...Option) *Pool {
	t.Helper()
	p, err := NewPool(append([]Option{WithPinning(false)}, opts...)...)
	if err != nil {
		t.Fatalf("NewPool: %v", err)
	}
	return p
}

// closePool ends every pool test: nothing may be in use, the allocator's
// invariants must hold and Close must succeed.
func closePool(t testing.TB, p *Pool) {
	t.Helper()
	if err := p.verify(); err != nil {
		t.Errorf("invariants: %v", err)
	}
	if s := p.Stats(); s.InUse != 0 || s.Allocs != 0 || s.Requested != 0 {
		t.Errorf("at the end: InUse=%d Allocs=%d Requested=%d, want 0", s.InUse, s.Allocs, s.Requested)
	}
	if err := p.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}

func mustAlloc(t testing.TB, p *Pool, n int) *Buffer {
	t.Helper()
	b, err := p.TryAlloc(n)
	if err != nil {
		t.Fatalf("TryAlloc(%d): %v", n, err)
	}
	return b
}

func mustRelease(t testing.TB, b *Buffer) {
	t.Helper()
	if err := b.Release(); err != nil {
		t.Fatalf("Release: %v", err)
	}
}

// expectDoubleRelease releases b once too often and checks that it is
// reported: an error, or a panic when the invariants are on.
func expectDoubleRelease(t *testing.T, b *Buffer) {
	t.Helper()
	var err error
	panicked := func() (p any) {
		defer func() { p = recover() }()
		err = b.Release()
		return nil
	}()
	if invariants {
		if e, ok := panicked.(error); !ok || !errors.Is(e, ErrDoubleRelease) {
			t.Fatalf("double release under invariants: panic %v, error %v; want a panic with ErrDoubleRelease", panicked, err)
		}
		return
	}
	if panicked != nil || !errors.Is(err, ErrDoubleRelease) {
		t.Fatalf("double release: panic %v, error %v; want ErrDoubleRelease", panicked, err)
	}
}

// smapsFlags returns the VmFlags of the mapping that starts at addr, from
// /proc/self/smaps.
func smapsFlags(t *testing.T, addr uintptr) []string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skipf("no /proc/self/smaps: %v", err)
	}
	var in bool
	for _, line := range strings.Split(string(data), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if r := strings.SplitN(fields[0], "-", 2); len(r) == 2 && !strings.HasSuffix(fields[0], ":") {
			in = r[0] == fmt.Sprintf("%x", addr)
			continue
		}
		if in && fields[0] == "VmFlags:" {
			return fields[1:]
		}
	}
	t.Fatalf("no mapping at %#x in /proc/self/smaps", addr)
	return nil
}
