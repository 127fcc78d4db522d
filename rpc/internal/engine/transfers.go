package engine

import (
	"context"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// A session's transfer table: the buffers the server holds for the
// client to read, by id and by the client_ref of the call that made
// them, until the client releases them (by id or by ref) or the session
// closes.

// MaxReleasedRefs bounds how many released client_refs a session
// remembers; a release that overtakes its call by more than this many
// releases is missed, and the session's end frees the transfer.
const MaxReleasedRefs = 4096

// Transfer is a buffer the server holds for a client to read (a fetched
// tensor, a call's reply tensor, an indirect answer) until it releases it.
type Transfer struct {
	ID  uint64 // given by Session.Add
	Ref uint64 // the client's name for the call that made it, or 0
	Buf *mempool.Buffer
	// Grant is the peer's only access to Buf, to read it; revoked when the
	// transfer ends.
	Grant verbs.Grant
	// Stripes are grants of Buf on the session's other lanes, for a read
	// striped across them (see GrantLanes).
	Stripes []verbs.Grant
	// Reserved, when not nil, marks a destination the client Writes into
	// before the server publishes it (a reserved Send): what the server
	// reserved it for. Only TakeReserved takes such a transfer out to
	// publish it.
	Reserved any
	// Done, when not nil, runs once the buffer has gone back (a refund of
	// what reserving it charged), whichever way the transfer ends.
	Done func()
}

// Revoke ends the peer's access to the transfer's buffer. Call it,
// outside any lock (on shm it waits for the peer to unmap), before the
// buffer goes back to the pool or is published.
func (t *Transfer) Revoke() {
	if t.Grant != nil {
		t.Grant.Revoke()
	}
	RevokeAll(t.Stripes)
}

// Finish revokes the peer's access and releases the buffer.
func (t *Transfer) Finish() {
	t.Revoke()
	t.release()
}

func (t *Transfer) release() {
	t.Buf.Release()
	if t.Done != nil {
		t.Done()
	}
}

// finishAsync finishes t without blocking when every grant of it can be
// revoked so (verbs.AsyncRevoker): the buffer goes back once the last
// revocation is complete, which on shm is when the receiver reads the
// peer's confirmation. It reports false, having done nothing, when a
// grant cannot.
func (t *Transfer) finishAsync(done func()) bool {
	gs := make([]verbs.Grant, 0, 1+len(t.Stripes))
	for _, g := range append([]verbs.Grant{t.Grant}, t.Stripes...) {
		if g != nil {
			gs = append(gs, g)
		}
	}
	return revokeAsync(gs, func() {
		t.release()
		done()
	})
}

// revokeAsync revokes every grant of gs without blocking, when each can be
// revoked so (verbs.AsyncRevoker), and runs done once all revocations are
// complete (at once when gs is empty), in whatever goroutine completed
// the last; it reports false, having done nothing, when a grant cannot.
func revokeAsync(gs []verbs.Grant, done func()) bool {
	for _, g := range gs {
		if _, ok := g.(verbs.AsyncRevoker); !ok {
			return false
		}
	}
	if len(gs) == 0 {
		done()
		return true
	}
	var left atomic.Int32
	left.Store(int32(len(gs)))
	for _, g := range gs {
		g.(verbs.AsyncRevoker).RevokeAsync(func() {
			if left.Add(-1) == 0 {
				done()
			}
		})
	}
	return true
}

// RevokeThen revokes the grant g and the grants of extra, then runs done:
// without waiting where every grant can be revoked so (verbs.AsyncRevoker;
// done then runs once the last revocation completed, on shm when the
// receiver reads the peer's confirmation), else here, after a Revoke of
// each. For grants of a request whose answer came (or whose link
// closed): no access by the peer can be under way, so nothing the caller
// does next waits for the peer to confirm.
func RevokeThen(g verbs.Grant, extra []verbs.Grant, done func()) {
	gs := make([]verbs.Grant, 0, 1+len(extra))
	gs = append(append(gs, g), extra...)
	if revokeAsync(gs, done) {
		return
	}
	RevokeAll(gs)
	done()
}

// FinishAll finishes every transfer of ts.
func FinishAll(ts []*Transfer) {
	for _, t := range ts {
		t.Finish()
	}
}

// Add registers a transfer made by the call the client named ref (0: no
// call), giving it its ID. It fails with Unavailable when the session has
// closed, with Canceled when the client has already released ref (the
// call was cancelled), with ctx's error when ctx has ended, and with
// ResourceExhausted when the session holds its most transfers; the
// caller then still owns t.Buf.
func (s *Session) Add(ctx context.Context, t *Transfer, ref uint64) error {
	s.mu.Lock()
	over, err := s.addLocked(ctx, t, ref)
	s.mu.Unlock()
	if over && s.refused != nil {
		s.refused(err)
	}
	return err
}

// addLocked is Add under the session's lock; over reports a refusal over
// maxTransfers.
func (s *Session) addLocked(ctx context.Context, t *Transfer, ref uint64) (over bool, err error) {
	if s.closed {
		return false, status.Error(codes.Unavailable, "tensorrpc: session ended")
	}
	if s.released[ref] {
		return false, status.Error(codes.Canceled, "tensorrpc: the client released the call")
	}
	if err := ctx.Err(); err != nil {
		return false, status.FromContextError(err).Err()
	}
	if s.maxTransfers > 0 && len(s.transfers) >= s.maxTransfers {
		return true, status.Errorf(codes.ResourceExhausted, "tensorrpc: transfer refused: the session holds %d unreleased transfers, the server's TransfersPerSession budget (release fetched tensors; rpc.WithAdmission raises it)", len(s.transfers))
	}
	s.next++
	t.ID = s.next
	t.Ref = ref
	s.transfers[t.ID] = t
	if ref != 0 {
		s.byRef[ref] = append(s.byRef[ref], t.ID)
	}
	return false, nil
}

// Has reports whether the session holds the transfer id (for tests).
func (s *Session) Has(id uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.transfers[id] != nil
}

// Remove takes the transfer id out of the session, or returns nil when it
// holds none of that id; the caller owns its buffer.
func (s *Session) Remove(id uint64) *Transfer {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.removeLocked(id)
}

func (s *Session) removeLocked(id uint64) *Transfer {
	t, ok := s.transfers[id]
	if !ok {
		return nil
	}
	delete(s.transfers, id)
	if t.Ref != 0 {
		ids := s.byRef[t.Ref]
		for i, x := range ids {
			if x == id {
				ids = append(ids[:i], ids[i+1:]...)
				break
			}
		}
		if len(ids) == 0 {
			delete(s.byRef, t.Ref)
		} else {
			s.byRef[t.Ref] = ids
		}
	}
	return t
}

// TakeReserved takes the transfer id out of the session when it is a
// reserved destination (Transfer.Reserved), or returns nil, leaving any
// other transfer of that id where it is; the caller owns its buffer.
func (s *Session) TakeReserved(id uint64) *Transfer {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t := s.transfers[id]; t == nil || t.Reserved == nil {
		return nil
	}
	return s.removeLocked(id)
}

// RemoveAll takes the transfers ids out of the session (see Remove).
func (s *Session) RemoveAll(ids []uint64) []*Transfer {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*Transfer
	for _, id := range ids {
		if t := s.removeLocked(id); t != nil {
			out = append(out, t)
		}
	}
	return out
}

// ReleaseRef takes out every transfer of the call named ref, and
// remembers ref (the last MaxReleasedRefs of them) so that transfers the
// call adds later are refused; the caller owns the buffers returned.
func (s *Session) ReleaseRef(ref uint64) []*Transfer {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*Transfer
	for _, id := range append([]uint64(nil), s.byRef[ref]...) {
		if t := s.removeLocked(id); t != nil {
			out = append(out, t)
		}
	}
	if !s.released[ref] {
		s.released[ref] = true
		s.order = append(s.order, ref)
		if len(s.order) > MaxReleasedRefs {
			delete(s.released, s.order[0])
			s.order = s.order[1:]
		}
	}
	return out
}
