package mempool

import "fmt"

const (
	// Granularity is the smallest unit the allocator hands out: every
	// allocation's size is rounded up to a multiple of it (or of the pool's
	// alignment, when that is larger), and every buffer starts at an
	// address that is a multiple of it.
	Granularity = 256

	// DefaultArenaSize is the size of a pool's first arena when WithArenaSize
	// is not given. Later arenas double in size.
	DefaultArenaSize = 4 << 20

	// DefaultLimit is the most memory a pool reserves when WithLimit is not
	// given. Arenas are mapped lazily, so only the pages that are touched (or
	// pinned) cost physical memory.
	DefaultLimit = 1 << 30

	// DefaultName names the memfds of a pool or arena when WithName is not
	// given; it shows in /proc/<pid>/maps as "/memfd:<name>".
	DefaultName = "tensorrpc-mempool"
)

// options holds every knob of a Pool or a standalone Arena. The defaults
// live in defaultOptions and nowhere else.
type options struct {
	backing      Backing
	arenaSize    int
	limit        int64
	alignment    int
	releaseEmpty bool
	name         string
	pin          bool
	hooks        []Hook
}

func defaultOptions() options {
	return options{
		backing:   BackingAnonymous,
		arenaSize: DefaultArenaSize,
		limit:     DefaultLimit,
		alignment: Granularity,
		name:      DefaultName,
		pin:       true,
	}
}

// Option configures NewPool, NewArena and OpenMemfd. Options that make no
// sense for a standalone arena (the limit, hooks, ...) are ignored there.
type Option func(*options)

// WithBacking chooses what a pool's arenas are made of. The default is
// BackingAnonymous.
func WithBacking(b Backing) Option { return func(o *options) { o.backing = b } }

// WithArenaSize sets the size of a pool's first arena (default
// DefaultArenaSize). Each later arena is twice the size of the one before,
// and always at least large enough for the allocation that needs it; none
// takes the pool past its limit.
func WithArenaSize(initial int) Option { return func(o *options) { o.arenaSize = initial } }

// WithLimit caps the bytes a pool reserves across all its arenas. Zero means
// DefaultLimit. When the pool is at its limit, Alloc waits for memory to be
// released instead of growing.
func WithLimit(maxReservedBytes int64) Option {
	return func(o *options) {
		if maxReservedBytes == 0 {
			maxReservedBytes = DefaultLimit
		}
		o.limit = maxReservedBytes
	}
}

// WithAlignment makes every buffer start at an address that is a multiple
// of align, a power of two no smaller than Granularity. Sizes are rounded
// up to a multiple of align too, so a large alignment wastes memory on
// small buffers.
func WithAlignment(align int) Option { return func(o *options) { o.alignment = align } }

// WithReleaseEmptyArenas makes a pool unmap an arena as soon as its last
// buffer is released, except the pool's last arena, which is kept so that
// a steady alloc/free cycle does not map and unmap memory on every call.
// Regardless of this option, empty arenas are released when the pool needs
// room under its limit for a larger arena, and by Trim.
func WithReleaseEmptyArenas(release bool) Option {
	return func(o *options) { o.releaseEmpty = release }
}

// WithName names memfd arenas (see DefaultName).
func WithName(name string) Option { return func(o *options) { o.name = name } }

// WithPinning says whether arenas try to lock their pages in memory
// (mlock). The default is true. Pinning that fails is recorded in the arena
// (Pinned, PinError) and never fails the arena.
func WithPinning(pin bool) Option { return func(o *options) { o.pin = pin } }

// WithHook adds a registration hook to a pool, as AddHook would before the
// first arena exists.
func WithHook(h Hook) Option { return func(o *options) { o.hooks = append(o.hooks, h) } }

func (o *options) validate() error {
	switch {
	case o.backing < BackingAnonymous || o.backing > BackingHugepages:
		return fmt.Errorf("mempool: unknown backing %d", int(o.backing))
	case o.arenaSize <= 0:
		return fmt.Errorf("mempool: arena size %d is not positive", o.arenaSize)
	case o.limit < 0 || o.limit > 1<<48:
		return fmt.Errorf("mempool: limit %d is not in [0, 256 TiB]", o.limit)
	case o.alignment < Granularity || o.alignment&(o.alignment-1) != 0:
		return fmt.Errorf("mempool: alignment %d is not a power of two >= %d", o.alignment, Granularity)
	case o.alignment > 1<<30:
		return fmt.Errorf("mempool: alignment %d is larger than 1 GiB", o.alignment)
	}
	for _, h := range o.hooks {
		if h == nil {
			return fmt.Errorf("mempool: nil hook")
		}
	}
	return nil
}
