package shm

import (
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc/granttest"
	"golang.org/x/sys/unix"
)

func TestGrants(t *testing.T) { granttest.Run(t, testEnv()) }

// grantState is what a's queue pair holds for the peer's grants: the
// exposed regions it mapped, the mappings made for them, and the map
// requests it sent.
func grantState(qp *queuePair) (regions, maps int, requests uint64) {
	qp.fetchMu.Lock()
	requests = qp.mapSeq
	qp.fetchMu.Unlock()
	qp.remoteMu.RLock()
	defer qp.remoteMu.RUnlock()
	return len(qp.peerRegions), qp.regionMaps, requests
}

// waitCached waits until the peer's announcement of grant key reached
// qp's cache.
func waitCached(t *testing.T, qp *queuePair, key uint32) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		qp.remoteMu.RLock()
		_, ok := qp.remote[key]
		qp.remoteMu.RUnlock()
		if ok {
			return
		}
	}
	t.Fatalf("grant %#x was not announced", key)
}

// exposedRegion returns a's mapping of the one region the peer exposed.
// dataAddr is the address pm's copy mapping starts at, read under the
// lock its receiver changes it with (an upgrade to a writable mapping).
func dataAddr(qp *queuePair, pm *peerMemory) uintptr {
	qp.remoteMu.RLock()
	defer qp.remoteMu.RUnlock()
	return addrOf(pm.data)
}

func exposedRegion(t *testing.T, qp *queuePair) *peerMemory {
	t.Helper()
	qp.remoteMu.RLock()
	defer qp.remoteMu.RUnlock()
	if len(qp.peerRegions) != 1 {
		t.Fatalf("%d exposed regions mapped, want 1", len(qp.peerRegions))
	}
	for _, pm := range qp.peerRegions {
		return pm
	}
	return nil
}

// TestGrantsShareRegionMapping: the initiator maps a granted region once,
// on its first grant; later grants on it are windows of that mapping,
// announced by the target as they are made (no map request, no fd, no
// mmap), a write grant upgrades it once, Revoke
// drops the key but keeps the mapping, MapRemote shares one read-only
// mapping, and Deregister makes the initiator drop the region's mapping
// (a Mapping from MapRemote stays until its Release).
func TestGrantsShareRegionMapping(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	mem := sealedMemory(t, 1<<16)
	pattern(mem.Bytes, 3)
	mr, err := b.pd.RegisterMemory(mem, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	grant := func(off, n int, acc verbs.Access) verbs.Grant {
		t.Helper()
		g, err := b.qp.Grant(mr, off, n, acc)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	do := func(op verbs.Opcode, r verbs.Remote, n int) {
		t.Helper()
		if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: op, Local: verbs.Local{Region: a.mr, Length: n}, Remote: r}); err != nil {
			t.Fatal(err)
		}
		if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess {
			t.Fatalf("%v: %v", op, verbs.CompletionError(c))
		}
	}

	g1 := grant(0, 4096, verbs.AccessRemoteRead)
	do(verbs.OpRead, g1.Remote(), 4096)
	if string(a.mr.Bytes()[:4096]) != string(mem.Bytes[:4096]) {
		t.Fatal("read through the first grant returned other bytes")
	}
	if regions, maps, reqs := grantState(a.qp); regions != 1 || maps != 1 || reqs != 1 {
		t.Fatalf("after the first grant: %d regions, %d mappings, %d requests; want 1, 1, 1", regions, maps, reqs)
	}
	pm := exposedRegion(t, a.qp)
	base := dataAddr(a.qp, pm)
	if p := mappingPerms(t, base); len(p) < 2 || p[1] != '-' {
		t.Fatalf("region mapped for a read grant is %q, want read-only", p)
	}

	// The region is exposed: the next grant is announced as it is made.
	g2 := grant(8192, 4096, verbs.AccessRemoteRead)
	waitCached(t, a.qp, g2.Remote().Key)
	do(verbs.OpRead, g2.Remote(), 4096)
	if string(a.mr.Bytes()[:4096]) != string(mem.Bytes[8192:12288]) {
		t.Fatal("read through the second grant returned other bytes")
	}
	if regions, maps, reqs := grantState(a.qp); regions != 1 || maps != 1 || reqs != 1 {
		t.Fatalf("after a second grant: %d regions, %d mappings, %d requests; want 1, 1, 1", regions, maps, reqs)
	}
	if exposedRegion(t, a.qp) != pm || dataAddr(a.qp, pm) != base {
		t.Fatal("the second grant remapped the region")
	}

	// A write grant upgrades the mapping once; the next one reuses it.
	copy(a.mr.Bytes(), "written through a grant")
	g3 := grant(16384, 4096, verbs.AccessRemoteWrite)
	waitCached(t, a.qp, g3.Remote().Key)
	do(verbs.OpWrite, g3.Remote(), 23)
	g4 := grant(20480, 4096, verbs.AccessRemoteWrite)
	waitCached(t, a.qp, g4.Remote().Key)
	do(verbs.OpWrite, g4.Remote(), 23)
	if string(mem.Bytes[16384:16384+23]) != "written through a grant" || string(mem.Bytes[20480:20480+23]) != "written through a grant" {
		t.Fatal("the writes did not land")
	}
	if regions, maps, reqs := grantState(a.qp); regions != 1 || maps != 2 || reqs != 1 {
		t.Fatalf("after two write grants: %d regions, %d mappings, %d requests; want 1, 2, 1", regions, maps, reqs)
	}
	base = dataAddr(a.qp, pm)
	if p := mappingPerms(t, base); len(p) < 2 || p[1] != 'w' {
		t.Fatalf("region mapped for a write grant is %q, want writable", p)
	}
	// The read grants still read, through the new mapping.
	do(verbs.OpRead, g2.Remote(), 4096)
	if string(a.mr.Bytes()[:4096]) != string(mem.Bytes[8192:12288]) {
		t.Fatal("read through the second grant after the upgrade returned other bytes")
	}

	// A revoked key is refused; the region stays mapped.
	if err := g1.Revoke(); err != nil {
		t.Fatal(err)
	}
	if _, err := a.qp.MapRemote(g1.Remote(), 8); err == nil {
		t.Fatal("MapRemote of a revoked grant succeeded")
	}
	if regions, _, _ := grantState(a.qp); regions != 1 || !isMapped(t, base) {
		t.Fatal("revoking a grant unmapped its region")
	}

	// Leases share one read-only mapping, which stays cached.
	m1, err := a.qp.MapRemote(g2.Remote(), 4096)
	if err != nil {
		t.Fatal(err)
	}
	view := m1.Bytes()
	if p := mappingPerms(t, addrOf(view)); len(p) < 2 || p[1] != '-' {
		t.Fatalf("a lease's mapping is %q, want read-only", p)
	}
	if err := m1.Release(); err != nil {
		t.Fatal(err)
	}
	m2, err := a.qp.MapRemote(g2.Remote(), 4096)
	if err != nil {
		t.Fatal(err)
	}
	if addrOf(m2.Bytes()) != addrOf(view) || string(m2.Bytes()) != string(mem.Bytes[8192:12288]) {
		t.Fatal("a second lease of the region did not reuse the cached read-only mapping")
	}
	if regions, maps, _ := grantState(a.qp); regions != 1 || maps != 2 {
		t.Fatalf("after leases: %d regions, %d mappings; want 1, 2", regions, maps)
	}

	// Deregister drops the region at the initiator, grants and all; the
	// lease stays readable until its Release.
	want := string(mem.Bytes[8192:12288])
	if err := mr.Deregister(); err != nil {
		t.Fatal(err)
	}
	if regions, _, _ := grantState(a.qp); regions != 0 {
		t.Fatalf("%d exposed regions still mapped after Deregister", regions)
	}
	if isMapped(t, base) {
		t.Fatal("the region's copy mapping survived Deregister")
	}
	a.qp.remoteMu.RLock()
	left := len(a.qp.remote)
	a.qp.remoteMu.RUnlock()
	if left != 0 {
		t.Fatalf("%d keys still cached after Deregister", left)
	}
	if string(m2.Bytes()) != want {
		t.Fatal("the lease changed after Deregister")
	}
	if err := m2.Release(); err != nil {
		t.Fatal(err)
	}
	if isMapped(t, addrOf(view)) {
		t.Fatal("the lease's pages are still mapped after its Release and Deregister")
	}
	if st := a.qp.State(); st != verbs.QPReadyToSend {
		t.Fatalf("queue pair is %v, want RTS", st)
	}
}

// TestGrantAnnouncementsChecked plays a peer announcing grants with bad
// rights, bounds, file ranges, seals and exposure ids: each is refused
// (or, for an id reused or contradicted, is a protocol violation), and
// what is accepted allows exactly its range and right.
func TestGrantAnnouncementsChecked(t *testing.T) {
	defer leakcheck.Check(t)
	a, _, closeAll := connected(t, 4096)
	defer closeAll()
	qp := a.qp
	m := sealedMemory(t, 1<<16)
	dup := func(fd int) int {
		t.Helper()
		d, err := unix.Dup(fd)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	ann := func(key uint32, acc verbs.Access, addr, off, n, exposure, regOff, regLen uint64) message {
		msg := message{typ: msgMapReply, flags: flagFound | flagRegion, key: key, access: acc, addr: addr, offset: off, length: n, total: exposure}
		msg.setRegionRange(regOff, regLen)
		return msg
	}
	const rd, wr = verbs.AccessRemoteRead, verbs.AccessRemoteWrite
	for _, c := range []message{
		ann(1, rd|wr, 1<<20, 0, 4096, 1, 0, 1<<16),                  // two rights
		ann(2, verbs.AccessLocalWrite, 1<<20, 0, 4096, 1, 0, 1<<16), // no remote right
		ann(3, rd, 1<<20, 1<<16-100, 4096, 1, 0, 1<<16),             // past the region
		ann(4, rd, 1<<20, 0, 0, 1, 0, 1<<16),                        // empty
		ann(5, rd, ^uint64(0)-100, 0, 4096, 1, 0, 1<<16),            // address wraps
		ann(6, rd, 1<<20, 0, 4096, 1, 0, 1<<17),                     // region longer than the file
		ann(7, rd, 1<<20, 0, 4096, 1, ^uint64(0)-8, 4096),           // file range wraps
		ann(8, rd, 1<<20, 0, 4096, 1, 0, 0),                         // empty region
	} {
		if err, broken := qp.mapGrant(c, dup(m.FD)); err == nil || broken != nil {
			t.Errorf("announcement of key %d: err %v, broken %v; want a refusal", c.key, err, broken)
		}
	}
	if err, broken := qp.mapGrant(ann(9, rd, 1<<20, 0, 4096, 2, 0, 1<<16), -1); err == nil || broken != nil {
		t.Errorf("a grant on a region never exposed: err %v, broken %v; want a refusal", err, broken)
	}
	unsealed := memfdMemory(t, 1<<16, 0)
	if err, _ := qp.mapGrant(ann(10, rd, 1<<20, 0, 4096, 3, 0, 1<<16), dup(unsealed.FD)); err == nil || !strings.Contains(err.Error(), "F_SEAL_SHRINK") {
		t.Errorf("a grant on an unsealed memfd: %v, want a refusal naming F_SEAL_SHRINK", err)
	}
	if regions, maps, _ := grantState(qp); regions != 0 || maps != 0 {
		t.Fatalf("refusals left %d regions, %d mappings", regions, maps)
	}

	copy(m.Bytes[5000:], "granted bytes")
	if err, broken := qp.mapGrant(ann(11, rd, 1<<20, 5000, 100, 4, 0, 1<<16), dup(m.FD)); err != nil || broken != nil {
		t.Fatalf("a good grant: %v, %v", err, broken)
	}
	if _, broken := qp.mapGrant(ann(12, rd, 1<<20, 0, 100, 4, 0, 1<<16), dup(m.FD)); broken == nil {
		t.Error("exposing region 4 again was accepted")
	}
	if _, broken := qp.mapGrant(ann(13, rd, 1<<20, 0, 100, 4, 4096, 1<<15), -1); broken == nil {
		t.Error("a grant naming region 4 with another range was accepted")
	}
	// Unasked announcements: only fd-less windows on an exposed region.
	push := func(msg message) message { msg.typ = msgGrant; return msg }
	if err := qp.onGrant(push(ann(14, rd, 1<<20, 0, 100, 5, 0, 1<<16))); err != nil {
		t.Errorf("an announcement on a region never exposed: %v, want it ignored", err)
	}
	bad := push(ann(15, rd, 1<<20, 0, 100, 4, 0, 1<<16))
	bad.flags = flagFound
	if err := qp.onGrant(bad); err == nil {
		t.Error("an announcement without flagRegion was accepted")
	}
	if err := qp.onGrant(push(ann(16, rd, 1<<20, 0, 100, 4, 0, 1<<16))); err != nil {
		t.Errorf("a good announcement: %v", err)
	}
	qp.remoteMu.RLock()
	rr := qp.remote[11]
	_, cached14 := qp.remote[14]
	_, cached15 := qp.remote[15]
	_, cached16 := qp.remote[16]
	qp.remoteMu.RUnlock()
	if cached14 || cached15 || !cached16 {
		t.Errorf("announcements cached: 14 %v, 15 %v, 16 %v; want only 16", cached14, cached15, cached16)
	}
	if got, err := rr.span(1<<20, 13, rd); err != nil || string(got) != "granted bytes" {
		t.Fatalf("span = %q, %v", got, err)
	}
	for _, c := range []struct {
		addr uint64
		n    int
		acc  verbs.Access
	}{{1<<20 - 1, 1, rd}, {1<<20 + 1, 100, rd}, {1 << 20, 1, wr}} {
		if _, err := rr.span(c.addr, c.n, c.acc); err == nil {
			t.Errorf("span(%#x, %d, %v) of a 100-byte read grant allowed", c.addr, c.n, c.acc)
		}
	}
}
