//go:build linux

package mempool

import (
	"bytes"
	"errors"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestArenaBackings(t *testing.T) {
	for _, b := range []Backing{BackingAnonymous, BackingMemfd, BackingHugepages} {
		t.Run(b.String(), func(t *testing.T) {
			a, err := NewArena(b, 1<<20+1)
			if err != nil {
				t.Fatalf("NewArena: %v", err)
			}
			unit := unix.Getpagesize()
			if b == BackingHugepages {
				unit = hugePageSize
			}
			if a.Len() < 1<<20+1 || a.Len()%unit != 0 || a.Addr()%uintptr(unit) != 0 {
				t.Errorf("Len %d at %#x, want ≥ %d bytes in units of %d", a.Len(), a.Addr(), 1<<20+1, unit)
			}
			if a.Backing() != b || len(a.Bytes()) != a.Len() {
				t.Errorf("Backing %v, len(Bytes) %d", a.Backing(), len(a.Bytes()))
			}
			if _, ok := a.FD(); ok != (b == BackingMemfd) {
				t.Errorf("FD ok = %v for %v", ok, b)
			}
			if a.Pinned() != (a.PinError() == nil) {
				t.Errorf("Pinned %v but PinError %v", a.Pinned(), a.PinError())
			}
			t.Logf("%v; pin error: %v; hugetlb %v, huge page error %v", a, a.PinError(), a.HugeTLB(), a.HugePageError())
			mem := a.Bytes()
			mem[0], mem[len(mem)-1] = 1, 2
			flags := smapsFlags(t, a.Addr())
			if !slices.Contains(flags, "dc") {
				t.Errorf("VmFlags %v lack dc: the arena is not excluded from fork", flags)
			}
			// The kernel never swaps hugetlb pages and leaves them out of
			// mlock's accounting, so only other mappings show "lo".
			if a.Pinned() && !a.HugeTLB() && !slices.Contains(flags, "lo") {
				t.Errorf("VmFlags %v lack lo but the arena says it is pinned", flags)
			}
			if b == BackingHugepages && !a.HugeTLB() && a.HugePageError() == nil && !slices.Contains(flags, "hg") {
				t.Errorf("VmFlags %v lack hg: transparent huge pages were not asked for", flags)
			}
			if b == BackingHugepages && a.HugeTLB() && !slices.Contains(flags, "ht") {
				t.Errorf("VmFlags %v lack ht but the arena says MAP_HUGETLB", flags)
			}
			if err := a.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if err := a.Close(); !errors.Is(err, ErrClosed) {
				t.Fatalf("second Close: %v, want ErrClosed", err)
			}
		})
	}
}

func TestArenaAlignment(t *testing.T) {
	for _, b := range []Backing{BackingAnonymous, BackingMemfd, BackingHugepages} {
		for _, align := range []int{1 << 16, 1 << 22} {
			a, err := NewArena(b, 1<<20, WithAlignment(align), WithPinning(false))
			if err != nil {
				t.Fatalf("NewArena(%v, align %d): %v", b, align, err)
			}
			if a.Addr()%uintptr(align) != 0 {
				t.Errorf("%v: address %#x not aligned to %d", b, a.Addr(), align)
			}
			a.Bytes()[a.Len()-1] = 1
			if err := a.Close(); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, bad := range []int{0, 128, 300, 1 << 31} {
		if _, err := NewArena(BackingAnonymous, 4096, WithAlignment(bad)); err == nil {
			t.Errorf("alignment %d accepted", bad)
		}
	}
	if _, err := NewArena(BackingAnonymous, 0); err == nil {
		t.Error("size 0 accepted")
	}
	if _, err := NewArena(Backing(7), 4096); err == nil {
		t.Error("unknown backing accepted")
	}
}

// TestMemfdSharedAndSealed maps a memfd arena a second time, as a peer would,
// and checks that both mappings show the same bytes and that the memfd
// cannot be resized.
func TestMemfdSharedAndSealed(t *testing.T) {
	a, err := NewArena(BackingMemfd, 4<<20, WithName("mempool-test"), WithPinning(false))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	fd, ok := a.FD()
	if !ok {
		t.Fatal("memfd arena without an fd")
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&memfdSeals != memfdSeals {
		t.Fatalf("seals %#x (%v), want %#x", seals, err, memfdSeals)
	}
	peer, err := unix.Mmap(fd, 0, a.Len(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("second mapping: %v", err)
	}
	defer unix.Munmap(peer)
	copy(a.Bytes()[1000:], "written through the arena")
	if !bytes.Equal(peer[1000:1025], []byte("written through the arena")) {
		t.Errorf("peer sees %q", peer[1000:1025])
	}
	copy(peer[a.Len()-10:], "from peer!")
	if got := string(a.Bytes()[a.Len()-10:]); got != "from peer!" {
		t.Errorf("arena sees %q", got)
	}
	if err := unix.Ftruncate(fd, int64(a.Len()/2)); err == nil {
		t.Error("shrinking the sealed memfd succeeded")
	} else if !errors.Is(err, unix.EPERM) {
		t.Errorf("shrinking: %v, want EPERM", err)
	}
	if err := unix.Ftruncate(fd, int64(a.Len()*2)); err == nil {
		t.Error("growing the sealed memfd succeeded")
	}

	// A peer process would receive the fd and open it as an arena.
	dup, err := unix.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	opened, err := OpenMemfd(dup, WithPinning(false))
	if err != nil {
		t.Fatalf("OpenMemfd: %v", err)
	}
	if opened.Len() != a.Len() || !bytes.Equal(opened.Bytes()[1000:1025], a.Bytes()[1000:1025]) {
		t.Errorf("OpenMemfd: %d bytes, %q", opened.Len(), opened.Bytes()[1000:1025])
	}
	if err := opened.Close(); err != nil {
		t.Fatal(err)
	}

	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	_ = unix.Ftruncate(unsealed, 4096)
	if _, err := OpenMemfd(unsealed); !errors.Is(err, ErrNotSealed) {
		t.Errorf("OpenMemfd of an unsealed memfd: %v, want ErrNotSealed", err)
	}
}

// TestPinFailureIsReported locks more than RLIMIT_MEMLOCK on a thread that
// lacks CAP_IPC_LOCK (dropped for the test when the process has it) and
// checks that the arena works, unpinned, and says why.
func TestPinFailureIsReported(t *testing.T) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY || rl.Cur > 256<<20 {
		t.Skipf("RLIMIT_MEMLOCK is %d (%v): too large to exceed in a test", rl.Cur, err)
	}
	size := int(rl.Cur) + 4<<20
	type result struct {
		a     *Arena
		stats Stats
		err   error
	}
	done := make(chan result)
	go func() {
		// The thread is never unlocked, so it exits with the goroutine and
		// the dropped capability goes with it.
		runtime.LockOSThread()
		if err := dropIPCLock(); err != nil {
			done <- result{err: err}
			return
		}
		a, err := NewArena(BackingAnonymous, size)
		if err != nil {
			done <- result{err: err}
			return
		}
		p, err := NewPool(WithArenaSize(size), WithLimit(int64(4*size)))
		if err != nil {
			a.Close()
			done <- result{err: err}
			return
		}
		s := p.Stats()
		done <- result{a: a, stats: s, err: p.Close()}
	}()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.a.Close()
	if r.a.Pinned() {
		t.Fatalf("an arena of %d bytes was pinned under RLIMIT_MEMLOCK %d", size, rl.Cur)
	}
	var pe *PinError
	if !errors.As(r.a.PinError(), &pe) || pe.Limit != rl.Cur || pe.Size != r.a.Len() {
		t.Fatalf("PinError %#v, want a *PinError naming the limit %d", r.a.PinError(), rl.Cur)
	}
	msg := r.a.PinError().Error()
	for _, want := range []string{"mlock", "RLIMIT_MEMLOCK is", "ulimit -l", "LimitMEMLOCK="} {
		if !strings.Contains(msg, want) {
			t.Errorf("PinError %q lacks %q", msg, want)
		}
	}
	t.Logf("PinError: %v", msg)
	if r.stats.PinnedArenas != 0 || r.stats.Arenas != 1 {
		t.Errorf("pool stats: %d of %d arenas pinned, want 0 of 1", r.stats.PinnedArenas, r.stats.Arenas)
	}
}

// dropIPCLock removes CAP_IPC_LOCK from the calling thread's effective set.
func dropIPCLock() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[0].Effective &^= 1 << unix.CAP_IPC_LOCK
	return unix.Capset(&hdr, &data[0])
}

func TestPinning(t *testing.T) {
	a, err := NewArena(BackingAnonymous, 1<<20, WithPinning(false))
	if err != nil {
		t.Fatal(err)
	}
	if a.Pinned() || !errors.Is(a.PinError(), ErrPinningDisabled) {
		t.Errorf("WithPinning(false): Pinned %v, PinError %v", a.Pinned(), a.PinError())
	}
	a.Close()

	p, err := NewPool(WithArenaSize(1 << 20)) // pinning on by default
	if err != nil {
		t.Fatal(err)
	}
	a = p.Arenas()[0]
	t.Logf("pool arena: %v, pin error %v", a, a.PinError())
	if s := p.Stats(); a.Pinned() != (s.PinnedArenas == 1) || a.Pinned() != (s.PinnedBytes == int64(a.Len())) {
		t.Errorf("Stats %+v disagree with the arena (pinned %v)", s, a.Pinned())
	}
	if err := a.Close(); !errors.Is(err, ErrArenaOwned) {
		t.Errorf("closing a pool's arena: %v, want ErrArenaOwned", err)
	}
	closePool(t, p)
}

func TestBackingString(t *testing.T) {
	for b, want := range map[Backing]string{BackingAnonymous: "anonymous", BackingMemfd: "memfd", BackingHugepages: "hugepages", Backing(9): "Backing(9)"} {
		if got := b.String(); got != want {
			t.Errorf("%d: %q, want %q", int(b), got, want)
		}
	}
}
