package shm

import (
	"errors"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

var _ verbs.RemoteMapper = (*queuePair)(nil)

// MapRemote returns length bytes of the peer's region at remote, straight
// from our mapping of it: no copy. It checks the key, the bounds and the
// remote-read right as a Read would, and uses the same mapping cache,
// asking the peer for the region on first use. A refusal is an error; it
// does not move the queue pair to the error state. A zero length returns an
// empty slice and, like a zero-length Read, checks no key.
//
// The bytes are the peer's memory: they change when the peer writes them
// and must not be written. They stay valid Go memory until the queue pair
// is closed. If the peer deregisters the region first, the views of it are
// not unmapped: the peer's pages behind them are replaced by read-only zero
// pages (see dropRemoteLocked), so they read zeros from then on, and the
// peer's memory is out of our reach as its Deregister promises.
func (qp *queuePair) MapRemote(remote verbs.Remote, length int) ([]byte, error) {
	qp.mu.Lock()
	state, closed := qp.state, qp.closed
	qp.mu.Unlock()
	switch {
	case closed:
		return nil, verbs.ErrClosed
	case state == verbs.QPError:
		return nil, verbs.ErrQPError
	case state != verbs.QPReadyToSend:
		return nil, verbs.ErrNotConnected
	case length < 0:
		return nil, fmt.Errorf("shm: MapRemote of a negative length %d", length)
	case length == 0:
		return []byte{}, nil
	}
	for asked := false; ; asked = true {
		qp.remoteMu.RLock()
		if rr := qp.remote[remote.Key]; rr != nil {
			b, err := rr.span(remote.Addr, length, verbs.AccessRemoteRead)
			if err == nil {
				// Under the read lock: dropRemoteLocked, which holds the
				// write lock, sees it.
				rr.viewed.Store(true)
			}
			qp.remoteMu.RUnlock()
			if err != nil {
				return nil, fmt.Errorf("shm: MapRemote refused: %w", err)
			}
			return b, nil
		}
		qp.remoteMu.RUnlock()
		if asked {
			return nil, fmt.Errorf("shm: MapRemote refused: remote key %#x was deregistered by the peer", remote.Key)
		}
		st, err := qp.ensureRemote(remote.Key)
		switch {
		case st == verbs.StatusSuccess:
		case st == verbs.StatusRemoteAccess:
			return nil, fmt.Errorf("shm: MapRemote refused: %w", err)
		default:
			// The queue pair failed or closed while we asked.
			qp.mu.Lock()
			closed = qp.closed
			qp.mu.Unlock()
			if closed {
				return nil, verbs.ErrClosed
			}
			if err == nil {
				err = errors.New("shm: the queue pair failed")
			}
			return nil, fmt.Errorf("%w: %w", verbs.ErrQPError, err)
		}
	}
}
