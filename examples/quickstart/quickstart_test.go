package main

import (
	"bytes"
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// TestMain lets the test binary play the server when quickstart
// re-executes it.
func TestMain(m *testing.M) {
	if childproc.Role() == serverRole {
		os.Exit(serveChild())
	}
	os.Exit(m.Run())
}

func TestQuickstart(t *testing.T) {
	defer leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	cfg := config{sizes: []int{4 << 10, 256 << 10, 1 << 20}, planes: allPlanes, iters: 3}
	var out bytes.Buffer
	rep, err := run(ctx, cfg, &out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	// shm, tcp and the gRPC fallback work on every Linux host; ibv needs a
	// NIC and is either measured or skipped with a reason.
	want := map[string]bool{rpc.TransportSHM: true, rpc.TransportTCP: true, rpc.TransportGRPC: true}
	got := map[string]int{}
	for _, r := range rep.Results {
		got[r.Plane]++
		if r.PerOp <= 0 || r.Iters != cfg.iters {
			t.Errorf("%+v: not measured", r)
		}
	}
	for plane := range want {
		ops := 2 * len(cfg.sizes)
		if plane == rpc.TransportSHM {
			ops = 3 * len(cfg.sizes)
		}
		if got[plane] != ops {
			t.Errorf("%s: %d rows, want %d", plane, got[plane], ops)
		}
	}
	if got[rpc.TransportIBV] == 0 && !strings.Contains(out.String(), "ibv: not measured: ") {
		t.Error("ibv neither measured nor explained")
	}
	if rep.Negotiated == "" || rep.Negotiated == rpc.TransportGRPC {
		t.Errorf("negotiated %q, want a data plane", rep.Negotiated)
	}
	// Tensors from the client's pool move over a data plane without a
	// CPU copy on the client.
	for _, r := range rep.Results {
		if r.Size > rpc.DefaultEagerThreshold && r.Plane != rpc.TransportGRPC && r.Copies != 0 {
			t.Errorf("%s %d %s: %v copies per operation, want 0", r.Plane, r.Size, r.Op, r.Copies)
		}
	}
}

func TestParseSize(t *testing.T) {
	got, err := parseSizes("4096,4KiB,64MiB,1GiB,7B")
	if err != nil || !slices.Equal(got, []int{4096, 4096, 64 << 20, 1 << 30, 7}) {
		t.Errorf("parseSizes = %v, %v", got, err)
	}
	for _, in := range []string{"", "0", "-1KiB", "4KiB,0", "1.5MiB", "MiB"} {
		if _, err := parseSizes(in); err == nil {
			t.Errorf("parseSizes(%q) succeeded", in)
		}
	}
}
