//go:build linux

package mempool

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

func TestAllocBasics(t *testing.T) {
	p := newTestPool(t, WithArenaSize(1<<20), WithLimit(4<<20))
	b := mustAlloc(t, p, 1000)
	if len(b.Bytes()) != 1000 || cap(b.Bytes()) != 1000 || b.Len() != 1000 {
		t.Fatalf("len %d cap %d Len %d, want 1000", len(b.Bytes()), cap(b.Bytes()), b.Len())
	}
	a, off, ok := p.Locate(b.Addr() + 999)
	if !ok || a != b.Arena() || off != b.Offset()+999 {
		t.Errorf("Locate: %v %d %v, want %v %d", a, off, ok, b.Arena(), b.Offset()+999)
	}
	if &b.Arena().Bytes()[b.Offset()] != &b.Bytes()[0] {
		t.Error("Offset does not point at Bytes()[0]")
	}
	s := p.Stats()
	if s.InUse != 1024 || s.Requested != 1000 || s.Allocs != 1 || s.TotalAllocs != 1 || s.Reserved != 1<<20 || s.Arenas != 1 {
		t.Errorf("Stats %+v", s)
	}
	if s.LargestFree != 1<<20-1024 || s.Fragmentation != 0 || s.FreeBlocks != 1 {
		t.Errorf("free space: %+v", s)
	}
	b.Retain()
	mustRelease(t, b)
	if p.Stats().InUse != 1024 || b.Bytes() == nil {
		t.Fatal("the memory went away while a reference remained")
	}
	mustRelease(t, b)
	if b.Bytes() != nil {
		t.Error("Bytes after the last Release is not nil")
	}
	expectDoubleRelease(t, b)
	func() {
		defer func() {
			if recover() == nil {
				t.Error("Retain of a released buffer did not panic")
			}
		}()
		b.Retain()
	}()
	if s := p.Stats(); s.Peak != 1024 || s.InUse != 0 || s.TotalAllocs != 1 {
		t.Errorf("after release: %+v", s)
	}
	closePool(t, p)
}

func TestAllocSizes(t *testing.T) {
	p := newTestPool(t, WithArenaSize(1<<20), WithLimit(8<<20))
	empty, err := p.Alloc(context.Background(), 0)
	if err != nil || empty.Len() != 0 || len(empty.Bytes()) != 0 || empty.Arena() != nil || empty.Addr() != 0 {
		t.Fatalf("Alloc(0): %v, %v", empty, err)
	}
	if s := p.Stats(); s.Allocs != 0 || s.InUse != 0 {
		t.Errorf("an empty buffer is counted: %+v", s)
	}
	mustRelease(t, empty)
	expectDoubleRelease(t, empty)
	if _, err := p.Alloc(context.Background(), -1); !errors.Is(err, ErrNegativeSize) {
		t.Errorf("Alloc(-1): %v", err)
	}
	for _, n := range []int{8<<20 + 1, 1 << 40, int(^uint(0) >> 1)} {
		if _, err := p.Alloc(context.Background(), n); !errors.Is(err, ErrTooLarge) {
			t.Errorf("Alloc(%d): %v, want ErrTooLarge", n, err)
		}
	}
	// Exactly the limit fits once the pool makes room for it.
	b, err := p.Alloc(context.Background(), 8<<20)
	if err != nil {
		t.Fatalf("Alloc(limit): %v", err)
	}
	if s := p.Stats(); s.Arenas != 1 || s.Reserved != 8<<20 {
		t.Errorf("after Alloc(limit): %+v", s)
	}
	mustRelease(t, b)
	closePool(t, p)
}

func TestGrowthDoubles(t *testing.T) {
	p := newTestPool(t, WithArenaSize(1<<20), WithLimit(12<<20))
	var bufs []*Buffer
	for range 12 {
		bufs = append(bufs, mustAlloc(t, p, 1<<20))
	}
	var sizes []int
	for _, a := range p.Arenas() {
		sizes = append(sizes, a.Len()>>20)
	}
	// 1, 2, 4 MiB, then the 8 MiB arena is cut to the 5 MiB left under the
	// limit. Arenas() is in address order, so compare as a multiset.
	if got := fmt.Sprint(sortedInts(sizes)); got != "[1 2 4 5]" {
		t.Errorf("arena sizes %s MiB, want [1 2 4 5]", got)
	}
	if _, err := p.TryAlloc(1); !errors.Is(err, ErrExhausted) {
		t.Errorf("TryAlloc at the limit: %v", err)
	}
	for _, b := range bufs {
		mustRelease(t, b)
	}
	// A request larger than any arena fits once empty arenas make room.
	b := mustAlloc(t, p, 10<<20)
	if s := p.Stats(); s.Reserved > 12<<20 {
		t.Errorf("reserved %d past the limit", s.Reserved)
	}
	mustRelease(t, b)
	closePool(t, p)
}

func sortedInts(s []int) []int {
	out := append([]int(nil), s...)
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

func TestAlignment(t *testing.T) {
	for _, backing := range []Backing{BackingAnonymous, BackingMemfd, BackingHugepages} {
		p := newTestPool(t, WithBacking(backing), WithAlignment(64<<10), WithArenaSize(4<<20))
		var bufs []*Buffer
		for _, n := range []int{1, 100, 64 << 10, 64<<10 + 1, 300 << 10} {
			b := mustAlloc(t, p, n)
			if b.Addr()%(64<<10) != 0 {
				t.Errorf("%v: buffer of %d bytes at %#x, not 64 KiB-aligned", backing, n, b.Addr())
			}
			bufs = append(bufs, b)
		}
		for _, b := range bufs {
			mustRelease(t, b)
		}
		closePool(t, p)
	}
	if _, err := NewPool(WithAlignment(1000)); err == nil {
		t.Error("alignment 1000 accepted")
	}
	if _, err := NewPool(WithArenaSize(1<<20), WithLimit(1<<10)); err == nil {
		t.Error("an arena larger than the limit accepted")
	}
}

func TestLocate(t *testing.T) {
	p := newTestPool(t, WithArenaSize(64<<10), WithLimit(64<<20))
	var bufs []*Buffer
	for i := range 200 {
		bufs = append(bufs, mustAlloc(t, p, 1+i*997))
	}
	for _, b := range bufs {
		for _, d := range []int{0, b.Len() / 2, b.Len() - 1} {
			a, off, ok := p.Locate(b.Addr() + uintptr(d))
			if !ok || a != b.Arena() || off != b.Offset()+d {
				t.Fatalf("Locate(%v + %d) = %v %d %v", b, d, a, off, ok)
			}
		}
	}
	for _, a := range p.Arenas() {
		if x, _, ok := p.Locate(a.Addr() - 1); ok && x == a {
			t.Errorf("Locate before %v found it", a)
		}
		if x, _, ok := p.Locate(a.Addr() + uintptr(a.Len())); ok && x == a {
			t.Errorf("Locate past the end of %v found it", a)
		}
	}
	if _, _, ok := p.Locate(0); ok {
		t.Error("Locate(0) found an arena")
	}
	for _, b := range bufs {
		mustRelease(t, b)
	}
	closePool(t, p)
}

// hookLog records hook calls and checks that each arena is added once and
// removed once, in that order.
type hookLog struct {
	mu      sync.Mutex
	t       *testing.T
	name    string
	live    map[uint32]bool
	calls   []string
	failOn  int // fail the failOn-th ArenaAdded (1-based); 0 never
	added   int
	removed int
}

func newHookLog(t *testing.T, name string) *hookLog {
	return &hookLog{t: t, name: name, live: map[uint32]bool{}}
}

func (h *hookLog) ArenaAdded(a *Arena) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.added++
	if h.added == h.failOn {
		h.calls = append(h.calls, "refuse")
		return errors.New(h.name + " refuses")
	}
	if h.live[a.ID()] {
		h.t.Errorf("%s: %v added twice", h.name, a)
	}
	h.live[a.ID()] = true
	h.calls = append(h.calls, fmt.Sprintf("add %d", a.Len()>>10))
	return nil
}

func (h *hookLog) ArenaRemoved(a *Arena) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.live[a.ID()] {
		h.t.Errorf("%s: %v removed but not added", h.name, a)
	}
	if len(a.Bytes()) != a.Len() || a.closed.Load() {
		h.t.Errorf("%s: %v already unmapped when removed", h.name, a)
	}
	delete(h.live, a.ID())
	h.removed++
	h.calls = append(h.calls, fmt.Sprintf("remove %d", a.Len()>>10))
}

func (h *hookLog) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return strings.Join(h.calls, ", ")
}

func TestHooks(t *testing.T) {
	first := newHookLog(t, "first")
	p := newTestPool(t, WithArenaSize(64<<10), WithLimit(1<<20), WithHook(first))
	b1 := mustAlloc(t, p, 64<<10)
	b2 := mustAlloc(t, p, 64<<10) // grows: 128 KiB
	second := newHookLog(t, "second")
	remove, err := p.AddHook(second)
	if err != nil {
		t.Fatal(err)
	}
	if got := second.String(); got != "add 64, add 128" {
		t.Errorf("second hook on AddHook: %s", got)
	}
	b3 := mustAlloc(t, p, 200<<10) // grows: 256 KiB, seen by both
	remove()
	remove() // a no-op
	if got := second.String(); got != "add 64, add 128, add 256, remove 64, remove 128, remove 256" {
		t.Errorf("second hook after remove: %s", got)
	}
	if second.removed != 3 || len(second.live) != 0 {
		t.Errorf("second hook: %d removed, %d live", second.removed, len(second.live))
	}
	for _, b := range []*Buffer{b1, b2, b3} {
		mustRelease(t, b)
	}
	closePool(t, p)
	// Close removes arenas in address order, which mmap chooses.
	if got := first.String(); !strings.HasPrefix(got, "add 64, add 128, add 256, remove") || first.removed != 3 {
		t.Errorf("first hook: %s", got)
	}
	if len(first.live) != 0 {
		t.Errorf("first hook: %d arenas never removed", len(first.live))
	}
}

func TestHookFailureKeepsArenaOut(t *testing.T) {
	ok := newHookLog(t, "ok")
	bad := newHookLog(t, "bad")
	bad.failOn = 2
	p := newTestPool(t, WithArenaSize(64<<10), WithLimit(1<<20), WithHook(ok), WithHook(bad))
	b1 := mustAlloc(t, p, 64<<10)
	before := p.Stats()
	_, err := p.Alloc(context.Background(), 64<<10)
	if err == nil || !strings.Contains(err.Error(), "bad refuses") {
		t.Fatalf("Alloc with a refusing hook: %v", err)
	}
	if s := p.Stats(); s.Arenas != before.Arenas || s.Reserved != before.Reserved {
		t.Errorf("the refused arena is in the pool: %+v", s)
	}
	if got := ok.String(); got != "add 64, add 128, remove 128" {
		t.Errorf("the accepting hook: %s", got)
	}
	// The next growth is accepted.
	b2 := mustAlloc(t, p, 64<<10)
	mustRelease(t, b1)
	mustRelease(t, b2)

	failing := newHookLog(t, "late")
	failing.failOn = 2
	if _, err := p.AddHook(failing); err == nil {
		t.Fatal("AddHook with a refusing hook succeeded")
	}
	if failing.added != 2 || failing.removed != 1 || len(failing.live) != 0 {
		t.Errorf("AddHook rollback: %s", failing)
	}
	closePool(t, p)
	if len(ok.live) != 0 || len(bad.live) != 0 {
		t.Errorf("arenas left registered: %d, %d", len(ok.live), len(bad.live))
	}
}

func TestReleaseEmptyArenas(t *testing.T) {
	log := newHookLog(t, "log")
	p := newTestPool(t, WithArenaSize(64<<10), WithLimit(1<<20), WithReleaseEmptyArenas(true), WithHook(log))
	var bufs []*Buffer
	for range 7 { // 64 + 128 + 256 KiB of arenas
		bufs = append(bufs, mustAlloc(t, p, 64<<10))
	}
	if n := p.Stats().Arenas; n != 3 {
		t.Fatalf("%d arenas, want 3", n)
	}
	for _, b := range bufs {
		mustRelease(t, b)
	}
	if s := p.Stats(); s.Arenas != 1 || log.removed != 2 {
		t.Errorf("after freeing everything: %d arenas, %d removed; want the last one kept", s.Arenas, log.removed)
	}
	if n := p.Trim(); n == 0 || p.Stats().Arenas != 0 || log.removed != 3 {
		t.Errorf("Trim released %d bytes, %d arenas left", n, p.Stats().Arenas)
	}
	if _, _, ok := p.Locate(bufs[0].Addr()); ok {
		t.Error("Locate finds a released arena")
	}
	b := mustAlloc(t, p, 100) // grows again
	mustRelease(t, b)
	closePool(t, p)
	if len(log.live) != 0 {
		t.Errorf("%d arenas never removed", len(log.live))
	}
}

// TestBackpressure fills the pool and checks that Alloc waits for a
// release, and that a waiting Alloc gives up when its context ends.
func TestBackpressure(t *testing.T) {
	defer leakcheck.Check(t)
	p := newTestPool(t, WithArenaSize(1<<20), WithLimit(1<<20))
	full := mustAlloc(t, p, 1<<20)
	if _, err := p.TryAlloc(1); !errors.Is(err, ErrExhausted) {
		t.Fatalf("TryAlloc on a full pool: %v", err)
	}

	got := make(chan *Buffer)
	go func() {
		b, err := p.Alloc(context.Background(), 512<<10)
		if err != nil {
			t.Errorf("waiting Alloc: %v", err)
		}
		got <- b
	}()
	waitForWaiters(t, p, 1)
	select {
	case <-got:
		t.Fatal("Alloc returned while the pool was full")
	default:
	}
	mustRelease(t, full)
	b := <-got
	if b == nil || b.Len() != 512<<10 {
		t.Fatalf("after the release: %v", b)
	}

	// Context cancelled while waiting.
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error)
	go func() {
		_, err := p.Alloc(ctx, 1<<20)
		errc <- err
	}()
	waitForWaiters(t, p, 1)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Alloc: %v, want context.Canceled", err)
	}
	// Deadline.
	ctx, cancel = context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := p.Alloc(ctx, 1<<20); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Alloc past its deadline: %v", err)
	}
	if s := p.Stats(); s.Waiting != 0 || s.Allocs != 1 {
		t.Errorf("after the waits: %+v", s)
	}
	mustRelease(t, b)
	closePool(t, p)
}

func waitForWaiters(t *testing.T, p *Pool, n int) {
	t.Helper()
	for p.Stats().Waiting != n {
		time.Sleep(time.Millisecond)
	}
}

func TestCloseWithOutstandingBuffers(t *testing.T) {
	defer leakcheck.Check(t)
	log := newHookLog(t, "log")
	p := newTestPool(t, WithArenaSize(64<<10), WithLimit(64<<10), WithHook(log))
	b1 := mustAlloc(t, p, 32<<10)
	b2 := mustAlloc(t, p, 32<<10)
	errc := make(chan error)
	go func() {
		_, err := p.Alloc(context.Background(), 1000)
		errc <- err
	}()
	waitForWaiters(t, p, 1)
	err := p.Close()
	if !errors.Is(err, ErrOutstanding) || !strings.Contains(err.Error(), "2 buffers") {
		t.Fatalf("Close with 2 live buffers: %v", err)
	}
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Errorf("a waiting Alloc at Close: %v, want ErrClosed", err)
	}
	if _, err := p.TryAlloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("TryAlloc after Close: %v", err)
	}
	if _, err := p.AddHook(HookFuncs{}); !errors.Is(err, ErrClosed) {
		t.Errorf("AddHook after Close: %v", err)
	}
	b1.Bytes()[0] = 1 // still mapped
	mustRelease(t, b1)
	if log.removed != 0 {
		t.Error("an arena was released while a buffer lived in it")
	}
	mustRelease(t, b2)
	if log.removed != 1 || len(log.live) != 0 {
		t.Errorf("after the last release: %s", log)
	}
	if err := p.Close(); err != nil {
		t.Errorf("Close again: %v", err)
	}
}

func TestHookFuncs(t *testing.T) {
	var added, removed int
	h := HookFuncs{Added: func(*Arena) error { added++; return nil }, Removed: func(*Arena) { removed++ }}
	p := newTestPool(t, WithArenaSize(64<<10), WithHook(h), WithHook(HookFuncs{}))
	closePool(t, p)
	if added != 1 || removed != 1 {
		t.Errorf("added %d removed %d", added, removed)
	}
	if _, err := NewPool(WithHook(nil)); err == nil {
		t.Error("a nil hook accepted")
	}
}

// TestCloseDuringGrowth closes the pool while a growing Alloc is inside a
// hook: the new arena must not join the closed pool, and every hook call
// must still pair up.
func TestCloseDuringGrowth(t *testing.T) {
	defer leakcheck.Check(t)
	entered, proceed := make(chan struct{}), make(chan struct{})
	var mu sync.Mutex
	live := map[uint32]bool{}
	calls := 0
	h := HookFuncs{
		Added: func(a *Arena) error {
			mu.Lock()
			calls++
			n := calls
			live[a.ID()] = true
			mu.Unlock()
			if n == 2 { // the growth, not the first arena
				close(entered)
				<-proceed
			}
			return nil
		},
		Removed: func(a *Arena) {
			mu.Lock()
			defer mu.Unlock()
			if !live[a.ID()] {
				t.Errorf("%v removed but not added", a)
			}
			delete(live, a.ID())
		},
	}
	p := newTestPool(t, WithArenaSize(64<<10), WithHook(h))
	allocErr := make(chan error)
	go func() {
		_, err := p.Alloc(context.Background(), 100<<10) // does not fit: grows
		allocErr <- err
	}()
	<-entered
	closeErr := make(chan error)
	go func() { closeErr <- p.Close() }()
	for closed := false; !closed; time.Sleep(time.Millisecond) {
		p.mu.Lock()
		closed = p.closed
		p.mu.Unlock()
	}
	close(proceed)
	if err := <-allocErr; !errors.Is(err, ErrClosed) {
		t.Errorf("the growing Alloc: %v, want ErrClosed", err)
	}
	if err := <-closeErr; err != nil {
		t.Errorf("Close: %v", err)
	}
	if len(live) != 0 {
		t.Errorf("%d arenas never removed", len(live))
	}

	if _, err := NewPool(WithPinning(false), WithHook(HookFuncs{Added: func(*Arena) error { return errors.New("no") }})); err == nil {
		t.Error("NewPool with a hook refusing the first arena succeeded")
	}
}
