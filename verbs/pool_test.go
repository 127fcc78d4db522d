package verbs_test

import (
	"context"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// TestRegisterPool checks that every arena of a pool is registered once,
// including arenas added later, and deregistered when it leaves the pool.
func TestRegisterPool(t *testing.T) {
	defer leakcheck.Check(t)
	pd, err := tcp.New().Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	pool, err := mempool.NewPool(mempool.WithArenaSize(1<<20), mempool.WithLimit(16<<20), mempool.WithReleaseEmptyArenas(true))
	if err != nil {
		t.Fatal(err)
	}
	reg, err := verbs.RegisterPool(pd, pool, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	first := pool.Arenas()[0]
	if _, ok := reg.Region(first); !ok {
		t.Fatal("the pool's first arena is not registered")
	}
	// A buffer larger than the first arena makes the pool add one.
	big, err := pool.Alloc(context.Background(), 3<<20)
	if err != nil {
		t.Fatal(err)
	}
	mr, ok := reg.Region(big.Arena())
	if !ok || big.Arena() == first {
		t.Fatal("the new arena is not registered")
	}
	local, err := reg.Local(big)
	if err != nil || local.Region != mr || local.Offset != big.Offset() || local.Length != big.Len() {
		t.Fatalf("Local = %+v, %v", local, err)
	}
	remote, err := reg.Remote(big)
	if err != nil || remote.Key != mr.RemoteKey() || remote.Addr != mr.Addr()+uint64(big.Offset()) {
		t.Fatalf("Remote = %+v, %v", remote, err)
	}
	if mr.Access() != verbs.AccessLocalWrite|verbs.AccessRemoteRead {
		t.Fatalf("access %v", mr.Access())
	}
	arena := big.Arena()
	big.Release()
	pool.Trim() // releases the empty arena
	if _, ok := reg.Region(arena); ok {
		t.Fatal("a released arena is still registered")
	}
	reg.Close()
	if _, ok := reg.Region(first); ok {
		t.Fatal("Close left an arena registered")
	}
	if err := pool.Close(); err != nil {
		t.Fatal(err)
	}
}
