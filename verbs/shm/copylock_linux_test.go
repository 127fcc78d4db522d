package shm

import (
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// readOf is a Read of n bytes at from's offset src into to's offset dst.
func readOf(id uint64, to *end, dst int, from *end, src, n int) verbs.SendRequest {
	return verbs.SendRequest{ID: id, Op: verbs.OpRead,
		Local:  verbs.Local{Region: to.mr, Offset: dst, Length: n},
		Remote: verbs.Remote{Addr: from.mr.Addr() + uint64(src), Key: from.mr.RemoteKey()}}
}

// TestCopyHoldsNoCacheLock: while a copy runs on a peer region, the
// receiver can change the mapping cache (it takes its lock for every
// grant the peer makes or revokes), and the peer's Deregister, which
// unmaps the region here, waits for the copy before it unmaps.
func TestCopyHoldsNoCacheLock(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 64 << 10
	a, b, closeAll := connected(t, size)
	defer closeAll()
	pattern(b.mr.Bytes(), 5)
	post(t, a, readOf(1, a, 0, b, 0, 64)) // maps b's region at a
	inside, release := make(chan struct{}), make(chan struct{})
	copied := make(chan byte, 1)
	go func() {
		a.qp.withRemote(b.mr.RemoteKey(), false, func(rr *remoteRegion) error {
			close(inside)
			<-release
			copied <- rr.data[size-1] // faults if the region was unmapped under us
			return nil
		})
	}()
	<-inside
	if !a.qp.remoteMu.TryLock() {
		close(release)
		<-copied
		t.Fatal("the mapping cache's lock is held while a copy runs")
	}
	a.qp.remoteMu.Unlock()
	deregistered := make(chan error, 1)
	go func() { deregistered <- b.mr.Deregister() }()
	// Give the unmap time to reach a's receiver, which must wait for the
	// copy; a slow machine only makes the wait untested.
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-deregistered:
		t.Fatalf("Deregister returned (%v) while a copy from the region ran at the peer", err)
	default:
	}
	close(release)
	if got, want := <-copied, b.mr.Bytes()[size-1]; got != want {
		t.Fatalf("copy read %#x, want %#x", got, want)
	}
	if err := <-deregistered; err != nil {
		t.Fatal(err)
	}
	a.qp.remoteMu.RLock()
	mapped := len(a.qp.remote)
	a.qp.remoteMu.RUnlock()
	if mapped != 0 {
		t.Fatalf("initiator still holds %d mappings after the target deregistered", mapped)
	}
}
