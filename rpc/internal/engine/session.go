package engine

import (
	"context"
	"sync"
	"time"
)

// Session is the server's data-plane state of one client session: the
// transfers it holds for the client to read (its transfer table), the
// Reads of the client's memory under way (pulls), and the calls that
// arrived as frames. The server's policy (admission, quotas, statistics,
// logs, handlers) stays with its caller. It is safe for concurrent use.
type Session struct {
	ctx    context.Context
	cancel context.CancelFunc
	// handlers counts the goroutines that work for the session: frame
	// calls, lane watchers (Watch) and work put aside (Go).
	handlers sync.WaitGroup

	// maxTransfers bounds the transfers held at once (0: no bound);
	// refused hears of each transfer refused over it.
	maxTransfers int
	refused      func(error)

	mu        sync.Mutex
	closed    bool
	transfers map[uint64]*Transfer
	next      uint64              // the last transfer id given
	byRef     map[uint64][]uint64 // client_ref → transfer ids
	released  map[uint64]bool     // client_refs released before (or after) their call
	order     []uint64            // released refs, oldest first, to bound the set

	// calls names the running frame calls by client_ref, so that a
	// release of the ref cancels one.
	calls map[uint64]*frameCall
	// running counts the frame calls under way (inFlight of them); once
	// draining is set (FinishCalls) new ones are refused.
	running  sync.WaitGroup
	inFlight int
	refusing int // refused frame calls whose answers have not gone yet
	draining bool
	// pulls are the Reads of client memory under way (Pulling), by when
	// they started: one the client never answers is stale.
	pulls map[*byte]time.Time
}

// NewSession returns a session whose context (Context) is under ctx.
// maxTransfers bounds the transfers it holds at once (0: no bound);
// refused, when not nil, is called (outside the session's lock) with the
// error of every transfer refused over that bound.
func NewSession(ctx context.Context, maxTransfers int, refused func(error)) *Session {
	s := &Session{
		maxTransfers: maxTransfers, refused: refused,
		transfers: map[uint64]*Transfer{}, byRef: map[uint64][]uint64{}, released: map[uint64]bool{},
		calls: map[uint64]*frameCall{}, pulls: map[*byte]time.Time{},
	}
	s.ctx, s.cancel = context.WithCancel(ctx)
	return s
}

// Context ends with the session (End or Close): frame calls run under it.
func (s *Session) Context() context.Context { return s.ctx }

// End cancels the session's context, and with it the calls that arrived
// as frames.
func (s *Session) End() { s.cancel() }

// Close ends the session: it cancels its context, closes lanes (so that
// nothing writes into the session's buffers any more), refuses further
// transfers, finishes those held, and waits for the session's goroutines
// (calls that arrived as frames end now: their link is closed and their
// context ended; what they still hold they free themselves).
func (s *Session) Close(lanes []*Link, reason error) {
	s.cancel()
	CloseLanes(lanes, reason)
	s.mu.Lock()
	s.closed = true
	transfers := s.transfers
	s.transfers = map[uint64]*Transfer{}
	s.mu.Unlock()
	for _, t := range transfers {
		t.Finish()
	}
	s.handlers.Wait()
}

// Watch is AnyDead for the session's lanes, its watchers counted among
// the session's goroutines (Close waits for them).
func (s *Session) Watch(lanes []*Link) (<-chan struct{}, func() error) {
	return AnyDead(lanes, &s.handlers)
}

// track counts one more of the session's goroutines (the caller calls
// handlers.Done for it), unless the session has closed.
func (s *Session) track() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.handlers.Add(1)
	return true
}

// Go runs f in its own goroutine, counted among the session's, unless
// the session has closed; it reports whether it did.
func (s *Session) Go(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.handlers.Go(f)
	return true
}

// FinishAside finishes ts without blocking the caller (the goroutine
// that handles the link's completions frees what a client releases with
// it): at once where every grant can be revoked without waiting
// (Transfer.finishAsync: tcp, shm), in a goroutine of the session for
// the rest (revoking may wait for the peer), or at once when the session
// has closed.
func (s *Session) FinishAside(ts []*Transfer) {
	var rest []*Transfer
	for _, t := range ts {
		// Counted among the session's goroutines until its grants are
		// revoked and its buffer released (a revocation may wait for an
		// access under way in a goroutine of its own), so that Close
		// returns only once it is: a Server's Stop then leaves no
		// buffer in use.
		if !s.track() {
			rest = append(rest, t)
			continue
		}
		if !t.finishAsync(s.handlers.Done) {
			s.handlers.Done()
			rest = append(rest, t)
		}
	}
	if len(rest) > 0 && !s.Go(func() { FinishAll(rest) }) {
		FinishAll(rest)
	}
}

// RemoveForLater takes the transfers ids out, as RemoveAll does, and
// returns what finishes them aside (FinishAside), counted among the
// session's goroutines until it has run, so that Close waits for it; nil
// when none of them was held. The caller runs it once.
func (s *Session) RemoveForLater(ids []uint64) (finish func()) {
	ts := s.RemoveAll(ids)
	if len(ts) == 0 {
		return nil
	}
	tracked := s.track()
	return func() {
		s.FinishAside(ts)
		if tracked {
			s.handlers.Done()
		}
	}
}

// Holding is what a session holds at one moment (Session.Holding).
type Holding struct {
	Transfers int // transfers the client has not released
	Released  int // released client_refs remembered
	Calls     int // frame calls registered, running or refused
	InFlight  int // frame calls running
	Refusing  int // refused frame calls whose answers have not gone yet
	Pulls     int // Reads of the client's memory under way
}

// Busy reports whether the session has a call under way or holds
// anything: then it is not idle, however long since its last call.
func (h Holding) Busy() bool {
	return h.Transfers > 0 || h.InFlight > 0 || h.Refusing > 0 || h.Pulls > 0
}

// Holding counts what the session holds now.
func (s *Session) Holding() Holding {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Holding{
		Transfers: len(s.transfers), Released: len(s.released), Calls: len(s.calls),
		InFlight: s.inFlight, Refusing: s.refusing, Pulls: len(s.pulls),
	}
}

// Pulling notes a Read of client memory under way; the returned func
// notes its end.
func (s *Session) Pulling() func() {
	key := new(byte)
	s.mu.Lock()
	s.pulls[key] = time.Now()
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		delete(s.pulls, key)
		s.mu.Unlock()
	}
}

// StaleReservation reports a Read of the client's memory that has stayed
// unanswered for longer than timeout.
func (s *Session) StaleReservation(timeout time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, started := range s.pulls {
		if time.Since(started) > timeout {
			return true
		}
	}
	return false
}
