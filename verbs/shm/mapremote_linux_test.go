package shm

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// isMapped reports whether addr lies in a mapping of this process.
func isMapped(t testing.TB, addr uintptr) bool {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		var lo, hi uintptr
		if _, err := fmt.Sscanf(s.Text(), "%x-%x", &lo, &hi); err == nil && lo <= addr && addr < hi {
			return true
		}
	}
	return false
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func remoteMappings(qp *queuePair) (cached, retired int) {
	qp.remoteMu.RLock()
	defer qp.remoteMu.RUnlock()
	return len(qp.remote), 0
}

// mappingPerms returns the permissions ("r--s") of the mapping of this
// process that holds addr, or "" when none does.
func mappingPerms(t testing.TB, addr uintptr) string {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		var lo, hi uintptr
		var perms string
		if _, err := fmt.Sscanf(s.Text(), "%x-%x %s", &lo, &hi, &perms); err == nil && lo <= addr && addr < hi {
			return perms
		}
	}
	return ""
}

// TestMapRemote maps part of the peer's region: the view is the peer's
// memory, so it sees the peer's later writes, and the mapping is the one
// Read and Write use.
func TestMapRemote(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	pattern(b.mr.Bytes(), 9)
	remote := verbs.Remote{Addr: b.mr.Addr() + 100, Key: b.mr.RemoteKey()}
	vm, err := a.qp.MapRemote(remote, 300)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Release()
	view := vm.Bytes()
	if p := mappingPerms(t, addrOf(view)); len(p) < 2 || p[0] != 'r' || p[1] != '-' {
		t.Fatalf("the mapping's permissions are %q, want read-only", p)
	}
	if len(view) != 300 || cap(view) != 300 {
		t.Fatalf("view has len %d cap %d, want 300", len(view), cap(view))
	}
	if string(view) != string(b.mr.Bytes()[100:400]) {
		t.Fatal("the view differs from the peer's memory")
	}
	copy(b.mr.Bytes()[100:], "written by the peer afterwards")
	if !strings.HasPrefix(string(view), "written by the peer afterwards") {
		t.Fatalf("the view does not see the peer's write: %q", view[:30])
	}
	if addrOf(view) == addrOf(b.mr.Bytes()[100:]) {
		t.Fatal("the view is the peer's own mapping, not ours")
	}
	// The whole region, and a second view of the same mapping.
	wm, err := a.qp.MapRemote(verbs.Remote{Addr: b.mr.Addr(), Key: b.mr.RemoteKey()}, b.mr.Len())
	if err != nil {
		t.Fatal(err)
	}
	defer wm.Release()
	if addrOf(wm.Bytes())+100 != addrOf(view) {
		t.Fatal("two views of one region come from different mappings")
	}
	if cached, _ := remoteMappings(a.qp); cached != 1 {
		t.Fatalf("%d mappings cached, want 1", cached)
	}
	// Read uses the same mapping and sees the same bytes.
	if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpRead, Local: verbs.Local{Region: a.mr, Length: 30}, Remote: remote}); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess || string(a.mr.Bytes()[:30]) != "written by the peer afterwards" {
		t.Fatalf("read: %v %q", verbs.CompletionError(c), a.mr.Bytes()[:30])
	}
	if cached, _ := remoteMappings(a.qp); cached != 1 {
		t.Fatalf("%d mappings cached after a Read, want 1", cached)
	}
	// Zero length works, like a zero-length Read, whatever the key.
	for _, r := range []verbs.Remote{remote, {Addr: 1, Key: 12345}} {
		if v, err := a.qp.MapRemote(r, 0); err != nil || v == nil || len(v.Bytes()) != 0 || v.Release() != nil {
			t.Fatalf("MapRemote(%+v, 0) = %v (nil %v), %v", r, v, v == nil, err)
		}
	}
	if st := a.qp.State(); st != verbs.QPReadyToSend {
		t.Fatalf("queue pair is %v, want RTS", st)
	}
}

// TestMapRemoteRefusals checks the key, bounds and rights; a refusal
// leaves the queue pair usable.
func TestMapRemoteRefusals(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 8192)
	defer closeAll()
	writeOnly, err := b.pd.RegisterMemory(sealedMemory(t, 4096), verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	localOnly, err := b.pd.RegisterMemory(sealedMemory(t, 4096), verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	key := b.mr.RemoteKey()
	base := b.mr.Addr()
	for _, tc := range []struct {
		name   string
		remote verbs.Remote
		length int
		want   string
	}{
		{"unknown key", verbs.Remote{Addr: base, Key: key + 1000}, 8, "not registered for remote access"},
		{"no remote rights", verbs.Remote{Addr: localOnly.Addr(), Key: localOnly.RemoteKey()}, 8, "not registered for remote access"},
		{"no remote read", verbs.Remote{Addr: writeOnly.Addr(), Key: writeOnly.RemoteKey()}, 8, "remote-read"},
		{"before the region", verbs.Remote{Addr: base - 1, Key: key}, 8, "outside region"},
		{"past its end", verbs.Remote{Addr: base + 8190, Key: key}, 3, "outside region"},
		{"longer than it", verbs.Remote{Addr: base, Key: key}, 8193, "outside region"},
		{"address wraps", verbs.Remote{Addr: ^uint64(0) - 2, Key: key}, 8, "outside region"},
		{"negative length", verbs.Remote{Addr: base, Key: key}, -1, "negative"},
	} {
		v, err := a.qp.MapRemote(tc.remote, tc.length)
		if err == nil || v != nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: MapRemote = %v, %v; want a refusal naming %q", tc.name, v, err, tc.want)
		}
		if st := a.qp.State(); st != verbs.QPReadyToSend {
			t.Fatalf("%s: the refusal moved the queue pair to %v", tc.name, st)
		}
	}
	// Still usable: a Write and a good MapRemote.
	copy(a.mr.Bytes(), "still fine")
	if err := a.qp.PostSend(verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 10}, Remote: verbs.Remote{Addr: base, Key: key}}); err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess {
		t.Fatal(verbs.CompletionError(c))
	}
	if v, err := a.qp.MapRemote(verbs.Remote{Addr: base, Key: key}, 10); err != nil || string(v.Bytes()) != "still fine" {
		t.Fatalf("MapRemote after refusals: %v, %v", v, err)
	} else {
		v.Release()
	}

	// Not connected, and closed.
	cq, _ := a.pd.NewCompletionQueue(4)
	qp, err := a.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 2, MaxRecv: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := qp.(verbs.RemoteMapper).MapRemote(verbs.Remote{Addr: base, Key: key}, 8); !errors.Is(err, verbs.ErrNotConnected) {
		t.Fatalf("MapRemote on an unconnected queue pair: %v", err)
	}
	qp.Close()
	a.qp.Close()
	if _, err := a.qp.MapRemote(verbs.Remote{Addr: base, Key: key}, 8); !errors.Is(err, verbs.ErrClosed) {
		t.Fatalf("MapRemote on a closed queue pair: %v", err)
	}
}

// TestMapRemoteOutlivesPeer: a Mapping stays readable, with the peer's
// last bytes, after the peer deregisters the region, after our queue pair
// closes and after the peer's domain is gone; the last Release unmaps it.
func TestMapRemoteOutlivesPeer(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 1<<16)
	defer closeAll()
	pattern(b.mr.Bytes(), 5)
	want := string(b.mr.Bytes()[4096:])
	remote := verbs.Remote{Addr: b.mr.Addr() + 4096, Key: b.mr.RemoteKey()}
	m1, err := a.qp.MapRemote(remote, len(want))
	if err != nil {
		t.Fatal(err)
	}
	m2, err := a.qp.MapRemote(remote, 100)
	if err != nil {
		t.Fatal(err)
	}
	view := m1.Bytes()
	if err := b.mr.Deregister(); err != nil {
		t.Fatal(err)
	}
	if _, err := a.qp.MapRemote(remote, 8); err == nil {
		t.Fatal("MapRemote of a deregistered region succeeded")
	}
	if err := a.qp.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.pd.Close(); err != nil {
		t.Fatal(err)
	}
	if string(view) != want {
		t.Fatal("the mapping changed after the peer and the queue pair went away")
	}
	if err := m2.Release(); err != nil {
		t.Fatal(err)
	}
	if !isMapped(t, addrOf(view)) || string(view) != want {
		t.Fatal("releasing one Mapping unmapped the pages another still uses")
	}
	if err := m1.Release(); err != nil || m1.Release() != nil {
		t.Fatal("Release is not idempotent")
	}
	if isMapped(t, addrOf(view)) {
		t.Fatal("the pages are still mapped after the last Release")
	}
}

// TestMapRemoteConcurrent maps fresh regions from several goroutines while
// the sender fetches others for Writes: one request to the peer at a time,
// every answer reaching its asker.
func TestMapRemoteConcurrent(t *testing.T) {
	defer leakcheck.Check(t)
	a, b, closeAll := connected(t, 4096)
	defer closeAll()
	const n = 16
	mrs := make([]verbs.MemoryRegion, n)
	for i := range mrs {
		m := sealedMemory(t, 4096)
		copy(m.Bytes, fmt.Sprintf("region %2d", i))
		mr, err := b.pd.RegisterMemory(m, allRemote)
		if err != nil {
			t.Fatal(err)
		}
		mrs[i] = mr
	}
	copy(a.mr.Bytes(), "W")
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := a.qp.MapRemote(verbs.Remote{Addr: mrs[i].Addr(), Key: mrs[i].RemoteKey()}, 9)
			if err == nil {
				v := m.Bytes()
				if string(v) != fmt.Sprintf("region %2d", i) && string(v) != fmt.Sprintf("Wegion %2d", i) {
					err = fmt.Errorf("view of region %d holds %q", i, v)
				}
				m.Release()
			}
			errs <- err
		}()
	}
	for i := range n {
		wr := verbs.SendRequest{ID: uint64(i), Op: verbs.OpWrite, Local: verbs.Local{Region: a.mr, Length: 1}, Remote: verbs.Remote{Addr: mrs[n-1-i].Addr(), Key: mrs[n-1-i].RemoteKey()}}
		if err := a.qp.PostSend(wr); err != nil {
			t.Fatal(err)
		}
	}
	for range n {
		if c := waitOne(t, a.cq); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if cached, _ := remoteMappings(a.qp); cached != n {
		t.Fatalf("%d mappings cached for %d regions", cached, n)
	}
}
