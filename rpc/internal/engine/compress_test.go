package engine

import (
	"context"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// TestAutoChecksAProbesWord: in auto mode, a read that came compressed
// while the goodput was known only from a probe is followed by one read
// whole as it is (check), after which auto plans again with the goodput
// that read measured; a session whose goodput a whole read measured
// first, or one that never compressed, never checks.
func TestAutoChecksAProbesWord(t *testing.T) {
	ctx := context.Background()
	const n = 16 << 20
	z := &Compression{Mode: verbs.CodecAuto}
	codec, _, probe, check := z.plan(ctx, n)
	if codec != verbs.CodecAuto || !probe || check {
		t.Fatalf("first read: %v probe %v check %v, want auto, a probe, no check", codec, probe, check)
	}
	z.observe(probeBytes, 0, 2*time.Millisecond, false)      // the probe: 0.5 GB/s
	z.observe(n-probeBytes, 4480, 10*time.Millisecond, true) // the rest, compressed
	codec, goodput, probe, check := z.plan(ctx, n)
	if codec != verbs.CodecNone || !check || probe || goodput <= 0 {
		t.Fatalf("after a compressed read on a probe's word: %v probe %v check %v goodput %v, want none, a check", codec, probe, check, goodput)
	}
	z.observe(n, 0, 4*time.Millisecond, true) // as it is: 4.2 GB/s
	codec, goodput, probe, check = z.plan(ctx, n)
	if codec != verbs.CodecAuto || check || probe || goodput < 4e9 {
		t.Fatalf("after the check: %v probe %v check %v goodput %.2g, want auto at the check's goodput", codec, probe, check, goodput)
	}
	z.observe(n, 1<<20, 20*time.Millisecond, true) // compressed again: auto chose it knowing the plane
	if codec, _, _, check = z.plan(ctx, n); codec != verbs.CodecAuto || check {
		t.Fatalf("a compressed read after the check: %v check %v, want auto, no second check", codec, check)
	}

	// Measured whole first (the server chose to send the rest as it is).
	z = &Compression{Mode: verbs.CodecAuto}
	z.plan(ctx, n)
	z.observe(probeBytes, 0, 2*time.Millisecond, false)
	z.observe(n-probeBytes, 0, 4*time.Millisecond, true)
	z.observe(n, 1<<20, 20*time.Millisecond, true)
	if codec, _, _, check = z.plan(ctx, n); codec != verbs.CodecAuto || check {
		t.Fatalf("goodput measured whole first: %v check %v, want auto, no check", codec, check)
	}

	// Other modes, and small reads, never check.
	z = &Compression{Mode: verbs.CodecS2}
	z.observe(n, 4480, 10*time.Millisecond, true)
	if codec, _, _, check = z.plan(ctx, n); codec != verbs.CodecS2 || check {
		t.Fatalf("s2 mode: %v check %v", codec, check)
	}
	z = &Compression{Mode: verbs.CodecAuto}
	z.observe(probeBytes, 0, 2*time.Millisecond, false)
	z.observe(n, 4480, 10*time.Millisecond, true)
	if codec, _, _, check = z.plan(ctx, MinCompressed-1); codec != verbs.CodecNone || check {
		t.Fatalf("a small read: %v check %v", codec, check)
	}
}
