package gpudirect

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
)

func TestHostAllocator(t *testing.T) {
	a := NewHostAllocator()
	var _ Allocator = a
	if a.Name() != "host-fake" {
		t.Errorf("Name %q", a.Name())
	}
	b, err := a.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	if b.Device() != "host-fake:0" || b.Len() != 64 {
		t.Errorf("buffer %s of %d bytes", b.Device(), b.Len())
	}
	if _, ok := b.Direct(); ok {
		t.Error("a host-fake buffer offers Direct memory")
	}
	if _, ok := b.(PCIMemory); ok {
		t.Error("a host-fake buffer claims a PCI device")
	}
	if err := b.CopyFromHost([]byte("tensor"), 10); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 6)
	if err := b.CopyToHost(got, 10); err != nil || string(got) != "tensor" {
		t.Errorf("read back %q, %v", got, err)
	}
	for _, tc := range []struct{ n, off int }{{65, 0}, {1, 64}, {1, -1}} {
		if err := b.CopyToHost(make([]byte, tc.n), tc.off); err == nil {
			t.Errorf("CopyToHost(%d bytes at %d) into 64 bytes succeeded", tc.n, tc.off)
		}
		if err := b.CopyFromHost(make([]byte, tc.n), tc.off); err == nil {
			t.Errorf("CopyFromHost(%d bytes at %d) into 64 bytes succeeded", tc.n, tc.off)
		}
	}
	want := HostStats{Live: 1, Allocs: 1, CopiesToHost: 1, CopiesFromHost: 1, BytesToHost: 6, BytesFromHost: 6}
	if s := a.Stats(); s != want {
		t.Errorf("stats %+v, want %+v", s, want)
	}
	if err := a.Close(); !errors.Is(err, ErrOutstanding) {
		t.Errorf("Close with a live buffer: %v", err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); !errors.Is(err, ErrFreed) {
		t.Errorf("double Free: %v", err)
	}
	if err := b.CopyToHost(got, 0); !errors.Is(err, ErrFreed) {
		t.Errorf("copy after Free: %v", err)
	}
	if _, err := a.Alloc(-1); err == nil {
		t.Error("Alloc(-1) succeeded")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Alloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close: %v", err)
	}
	if s := a.Stats(); s.Live != 0 {
		t.Errorf("live buffers after Close: %+v", s)
	}
}

func TestHostAllocatorConcurrent(t *testing.T) {
	defer leakcheck.Check(t)
	a := NewHostAllocator()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 100 {
				b, err := a.Alloc(128)
				if err != nil {
					t.Error(err)
					return
				}
				src := bytes.Repeat([]byte{byte(g)}, 128)
				if err := b.CopyFromHost(src, 0); err != nil {
					t.Error(err)
				}
				dst := make([]byte, 128)
				if err := b.CopyToHost(dst, 0); err != nil || !bytes.Equal(dst, src) {
					t.Errorf("goroutine %d, round %d: read back differs (%v)", g, i, err)
				}
				if err := b.Free(); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if s := a.Stats(); s.Live != 0 || s.Allocs != 800 || s.CopiesToHost != 800 || s.CopiesFromHost != 800 || s.BytesToHost != 800*128 {
		t.Errorf("stats %+v", s)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestHostStaging sends a host-fake "device" tensor the way the rpc layer
// will when Plan says Staged: one copy out to a pinned pool buffer, one copy
// in on the other side, and the pool's statistics back at zero.
func TestHostStaging(t *testing.T) {
	defer leakcheck.Check(t)
	topo := discoverFixture(t, "switch")
	a := NewHostAllocator()
	src, err := a.Alloc(100 << 10)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 100<<10/16)
	if err := src.CopyFromHost(payload, 0); err != nil {
		t.Fatal(err)
	}
	for _, provider := range []string{"ibv", "ibv:mlx5_0", "tcp", "shm", "grpc"} {
		d := Plan(src, provider, topo)
		if d.Path != Staged || !strings.Contains(d.Reason, "host-fake:0 has no memory the NIC can address directly; using host staging") {
			t.Errorf("Plan(host-fake, %s) = %+v", provider, d)
		}
	}
	if d := Plan(src, "ibv", nil); d.Path != Staged || !strings.Contains(d.Reason, "no PCI topology") {
		t.Errorf("Plan without a topology: %+v", d)
	}

	pool, err := mempool.NewPool(mempool.WithPinning(false), mempool.WithArenaSize(256<<10), mempool.WithLimit(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	host, err := StageOut(ctx, pool, src, 1000, 50<<10)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(host.Bytes()[:50<<10], payload[1000:1000+50<<10]) {
		t.Error("staged bytes differ")
	}
	dst, err := a.Alloc(50 << 10)
	if err != nil {
		t.Fatal(err)
	}
	if err := StageIn(dst, 0, host.Bytes()[:50<<10]); err != nil {
		t.Fatal(err)
	}
	if err := host.Release(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 50<<10)
	if err := dst.CopyToHost(got, 0); err != nil || !bytes.Equal(got, payload[1000:1000+50<<10]) {
		t.Errorf("unstaged bytes differ (%v)", err)
	}
	// One copy each way for the transfer, plus the test's own two.
	if s := a.Stats(); s.CopiesToHost != 2 || s.CopiesFromHost != 2 {
		t.Errorf("stats %+v, want 2 copies each way", s)
	}

	if _, err := StageOut(ctx, pool, src, 100<<10-10, 11); err == nil {
		t.Error("StageOut past the end succeeded")
	}
	if _, err := StageOut(ctx, pool, src, 0, 2<<20); err == nil {
		t.Error("StageOut beyond the pool's limit succeeded")
	}
	if err := StageIn(dst, 50<<10-1, []byte("xx")); err == nil {
		t.Error("StageIn past the end succeeded")
	}
	freed, _ := a.Alloc(16)
	freed.Free()
	if _, err := StageOut(ctx, pool, freed, 0, 16); !errors.Is(err, ErrFreed) {
		t.Errorf("StageOut of a freed buffer: %v", err)
	}

	for _, b := range []DeviceBuffer{src, dst} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if s := pool.Stats(); s.InUse != 0 || s.Allocs != 0 {
		t.Errorf("pool stats at the end: %+v", s)
	}
	if err := pool.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}
