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
	z.observe(n, 1<<20, 2*time.Millisecond, true) // compressed again, faster than the plane moves it as it is
	if codec, _, _, check = z.plan(ctx, n); codec != verbs.CodecAuto || check {
		t.Fatalf("a compressed read after the check, faster than the plane: %v check %v, want auto, no second check", codec, check)
	}

	// Measured whole first (the server chose to send the rest as it is).
	z = &Compression{Mode: verbs.CodecAuto}
	z.plan(ctx, n)
	z.observe(probeBytes, 0, 2*time.Millisecond, false)
	z.observe(n-probeBytes, 0, 4*time.Millisecond, true)
	z.observe(n, 1<<20, 2*time.Millisecond, true)
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

// TestAutoRechecksASlowCodec: in auto mode, a read that came compressed
// slower than the plane's goodput moves it as it is (a slow moment took
// the estimate down, or the codec was slower than its sample said) is
// followed by one read as it is (check), and then by as many as auto's
// backoff (TestAutoBacksOff), also as they are; a compressed read faster
// than that, as on a slow link, is not. (On the 2-core VM, a first 16 MiB
// read of 11 ms put the estimate at 1.5 GB/s, and every later read came
// s2-compressed in 10-15 ms where as it is it took 3.5-4.)
func TestAutoRechecksASlowCodec(t *testing.T) {
	ctx := context.Background()
	const n = 16 << 20
	z := &Compression{Mode: verbs.CodecAuto}
	z.plan(ctx, n)
	z.observe(n, 0, 11*time.Millisecond, true) // a slow first read: 1.5 GB/s
	for i, took := range []time.Duration{15 * time.Millisecond, 14 * time.Millisecond} {
		z.observe(n, 4480, took, true) // compressed, 1.1-1.2 GB/s
		codec, _, probe, check := z.plan(ctx, n)
		if codec != verbs.CodecNone || !check || probe {
			t.Fatalf("compressed read %d, slower than the plane: %v probe %v check %v, want none, a check", i, codec, probe, check)
		}
		for k := range 1 << i { // the backoff: 1, then 2
			if codec, _, _, check = z.plan(ctx, n); codec != verbs.CodecNone || !check {
				t.Fatalf("compressed read %d's backoff, read %d: %v check %v, want none, a check", i, k, codec, check)
			}
		}
		if codec, _, _, check = z.plan(ctx, n); codec != verbs.CodecAuto || check {
			t.Fatalf("the read after compressed read %d's backoff: %v check %v, want auto, no check", i, codec, check)
		}
	}
	z.observe(n, 0, 4*time.Millisecond, true) // a check: 4.2 GB/s as it is
	if g := z.Goodput(); g < 4e9 {
		t.Fatalf("goodput after the check %.3g, want the check's 4.2e9", g)
	}

	// A slow link: compressed reads beat what it moves as it is.
	z = &Compression{Mode: verbs.CodecAuto}
	z.plan(ctx, n)
	z.observe(n, 0, 700*time.Millisecond, true) // 24 MB/s
	for range 3 {
		z.observe(n, 1<<20, 60*time.Millisecond, true)
		if codec, _, _, check := z.plan(ctx, n); codec != verbs.CodecAuto || check {
			t.Fatalf("slow link, compressed read faster than as it is: %v check %v, want auto, no check", codec, check)
		}
	}
}

// TestAutoBacksOff: each compressed read that loses to the plane as it
// is, and each compressible sample a responder declined, doubles the reads that then
// go as they are (1, 2, 4, ... up to maxBackoff); a compressed read that
// wins resets it; while it backs off, the plane counts as plain (a
// Fetch may land), and a read that asked for nothing declines nothing.
func TestAutoBacksOff(t *testing.T) {
	ctx := context.Background()
	const n = 16 << 20
	z := &Compression{Mode: verbs.CodecAuto}
	z.plan(ctx, n)
	z.observe(n, 0, 5*time.Millisecond, true) // 3.4 GB/s as it is
	// skipped counts the reads planned as they are until auto asks again.
	skipped := func() int {
		t.Helper()
		for k := 0; ; k++ {
			codec, _, _, check := z.plan(ctx, n)
			if codec == verbs.CodecAuto && !check {
				return k
			}
			if codec != verbs.CodecNone || !check || k > 2*maxBackoff {
				t.Fatalf("read %d of a backoff: %v check %v", k, codec, check)
			}
		}
	}
	backoff := 0
	for i := range 9 {
		backoff = min(max(1, 2*backoff), maxBackoff)
		want := backoff
		if i%2 == 0 {
			z.observe(n, n/2, 9*time.Millisecond, true) // compressed, lost: 1.9 GB/s
			want++                                      // the recheck, then the backoff
		} else {
			z.noteSampled(&ReadReport{Asked: verbs.CodecAuto, Sampled: 120})
		}
		if !z.Plain(ctx, n) {
			t.Fatalf("loss %d: the plane is not plain while auto backs off", i)
		}
		if got := skipped(); got != want {
			t.Fatalf("loss %d: %d reads as they are, want %d", i, got, want)
		}
	}
	if backoff != maxBackoff {
		t.Fatalf("the test's losses reached a backoff of %d, not maxBackoff", backoff)
	}
	// Reports that are no decline: a read that asked for nothing, a
	// responder that did not sample, one that compressed, one whose
	// sample found the tensor incompressible or compressible less than
	// declineRatio (declined for Decide's margin on a slow link, say: the
	// next tensor may compress well).
	for _, r := range []ReadReport{{Asked: verbs.CodecNone, Sampled: 120}, {Asked: verbs.CodecAuto},
		{Asked: verbs.CodecAuto, Sampled: 120, Packed: verbs.CodecS2}, {Asked: verbs.CodecAuto, Sampled: 1.05},
		{Asked: verbs.CodecAuto, Sampled: 1.2}, {Asked: verbs.CodecAuto, Sampled: declineRatio - 0.01}} {
		z.noteSampled(&r)
		if got := skipped(); got != 0 {
			t.Fatalf("%+v backed off %d reads", r, got)
		}
	}
	// A compressed read within recheckBelow of the plane neither loses
	// nor wins: the backoff stays; one at least as fast resets it.
	g := z.Goodput()
	z.observe(n, n/100, time.Duration(float64(n)/(0.95*g)*1e9), true)
	z.noteSampled(&ReadReport{Asked: verbs.CodecAuto, Sampled: 120})
	if got := skipped(); got != maxBackoff {
		t.Fatalf("after a near-tie, a decline backed off %d reads, want %d (kept)", got, maxBackoff)
	}
	z.observe(n, n/100, time.Duration(float64(n)/(1.1*g)*1e9), true) // compressed, won
	z.noteSampled(&ReadReport{Asked: verbs.CodecAuto, Sampled: 120})
	if got := skipped(); got != 1 {
		t.Fatalf("after a win, a decline backed off %d reads, want 1 (reset)", got)
	}
	// Transfers as they are that Observe measures (landings, while the
	// plane counts as plain) count as skipped reads: the plane stops
	// counting as plain once they used the backoff up.
	z = &Compression{Mode: verbs.CodecAuto}
	z.observe(n, 0, 400*time.Millisecond, true) // a slow plane: 42 MB/s
	z.noteSampled(&ReadReport{Asked: verbs.CodecAuto, Sampled: 120})
	if !z.Plain(ctx, n) {
		t.Fatal("the plane is not plain while auto backs off")
	}
	z.Observe(MinCompressed-1, 0, time.Millisecond) // too small to count
	if !z.Plain(ctx, n) {
		t.Fatal("a transfer under MinCompressed used the backoff up")
	}
	z.Observe(n, 0, 400*time.Millisecond)
	if z.Plain(ctx, n) {
		t.Fatal("after a landing used the backoff up, a slow plane still counts as plain")
	}
	var nilZ *Compression
	nilZ.declined() // a session that does not compress
}

// TestGoodputEstimate: a read faster than the estimate replaces it; a
// slower one lowers it by half the difference when it is long (trustMin),
// a quarter when shorter; compressed reads only raise it, to their wire
// bytes' rate.
func TestGoodputEstimate(t *testing.T) {
	z := &Compression{Mode: verbs.CodecAuto}
	const n = 16 << 20
	rate := func(b int, d time.Duration) float64 { return float64(b) / d.Seconds() }
	near := func(what string, want float64) {
		t.Helper()
		if got := z.Goodput(); got < want*0.999 || got > want*1.001 {
			t.Errorf("%s: goodput %.4g, want %.4g", what, got, want)
		}
	}
	z.observe(probeBytes, 0, 2*time.Millisecond, false)
	near("the first measure", rate(probeBytes, 2*time.Millisecond))
	z.observe(n, 0, 4*time.Millisecond, true)
	fast := rate(n, 4*time.Millisecond)
	near("a faster read", fast)
	z.observe(n, 0, 10*time.Millisecond, true)
	near("a slower long read", fast-(fast-rate(n, 10*time.Millisecond))/2)
	z.observe(n, 0, 4*time.Millisecond, true)
	near("fast again", fast)
	z.observe(probeBytes, 0, 2*time.Millisecond, false)
	near("a slower probe", fast-(fast-rate(probeBytes, 2*time.Millisecond))/4)
	before := z.Goodput()
	z.observe(n, 4480, 10*time.Millisecond, true)
	near("a compressed read of few wire bytes", before)
	z.observe(n, n/2, time.Millisecond, true)
	near("a compressed read whose wire bytes went faster", rate(n/2, time.Millisecond))
	z.observe(measureMin-1, 0, time.Second, true)
	near("a read too short to measure", rate(n/2, time.Millisecond))
}

// TestPlanNoProbe: a read that cannot probe first (ReadPlanned) is not
// planned where plan would probe (nothing measured yet, or a probe due
// again), and leaves the plan as it was, so that the read planned
// instead (ReadLanes) still probes; otherwise it is planned as plan
// plans it, and counts toward the next probe.
func TestPlanNoProbe(t *testing.T) {
	ctx := context.Background()
	const n = 16 << 20
	z := &Compression{Mode: verbs.CodecAuto}
	if _, _, _, ok := z.planNoProbe(ctx, n); ok {
		t.Fatal("planned with nothing measured")
	}
	if _, _, probe, _ := z.plan(ctx, n); !probe {
		t.Fatal("the read after a refused one did not probe")
	}
	z.observe(probeBytes, 0, 2*time.Millisecond, false)
	z.observe(n-probeBytes, 0, 4*time.Millisecond, true)
	for i := 1; i < reprobeEvery; i++ {
		codec, goodput, check, ok := z.planNoProbe(ctx, n)
		if !ok || codec != verbs.CodecAuto || check || goodput <= 0 {
			t.Fatalf("read %d: %v goodput %v check %v ok %v, want auto at the measured goodput", i, codec, goodput, check, ok)
		}
	}
	if _, _, _, ok := z.planNoProbe(ctx, n); ok {
		t.Fatalf("planned the %dth read, when a probe is due", reprobeEvery)
	}
	if _, _, probe, _ := z.plan(ctx, n); !probe {
		t.Fatal("the due probe was lost")
	}
	// Below MinCompressed, or with a fixed codec, there is nothing to probe.
	if codec, _, _, ok := z.planNoProbe(ctx, MinCompressed-1); !ok || codec != verbs.CodecNone {
		t.Fatalf("a small read: %v ok %v, want none, planned", codec, ok)
	}
	if codec, _, _, ok := (&Compression{Mode: verbs.CodecS2}).planNoProbe(ctx, n); !ok || codec != verbs.CodecS2 {
		t.Fatalf("s2: %v ok %v, want s2, planned", codec, ok)
	}
}
