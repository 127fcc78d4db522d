package softrc

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Reservation is the completion queue room a new queue pair holds: MaxSend
// entries of SendCQ and MaxRecv of RecvCQ.
type Reservation struct {
	SendCQ, RecvCQ   *CQ
	MaxSend, MaxRecv int
}

// Release gives the room back.
func (r Reservation) Release() {
	r.SendCQ.Unreserve(r.MaxSend)
	r.RecvCQ.Unreserve(r.MaxRecv)
}

// Reserve makes the checks of NewQueuePair in the contract's order and
// reserves the queue pair's room in its completion queues. provider
// ("tcp") begins every error. closed says whether the domain owner is
// closed (ErrClosed); the completion queues must be owner's; the sizes are
// those of QueueSizes. check, if not nil, runs after those checks and
// before anything is reserved; its error is returned as it is.
func Reserve(provider string, owner any, closed bool, cfg verbs.QueuePairConfig, check func() error) (Reservation, error) {
	if closed {
		return Reservation{}, ClosedError(provider, "new queue pair")
	}
	sendCQ, ok1 := cfg.SendCQ.(*CQ)
	recvCQ, ok2 := cfg.RecvCQ.(*CQ)
	if !ok1 || !ok2 || sendCQ == nil || recvCQ == nil || sendCQ.Owner() != owner || recvCQ.Owner() != owner {
		return Reservation{}, fmt.Errorf("%s: new queue pair: SendCQ and RecvCQ must be completion queues of this domain", provider)
	}
	maxSend, maxRecv, err := QueueSizes(cfg, MaxQueueDepth)
	if err != nil {
		return Reservation{}, fmt.Errorf("%s: new queue pair: %w", provider, err)
	}
	if check != nil {
		if err := check(); err != nil {
			return Reservation{}, err
		}
	}
	if err := sendCQ.Reserve(maxSend); err != nil {
		return Reservation{}, fmt.Errorf("%s: new queue pair: send queue of %d: %w", provider, maxSend, err)
	}
	if err := recvCQ.Reserve(maxRecv); err != nil {
		sendCQ.Unreserve(maxSend)
		return Reservation{}, fmt.Errorf("%s: new queue pair: receive queue of %d: %w", provider, maxRecv, err)
	}
	return Reservation{SendCQ: sendCQ, RecvCQ: recvCQ, MaxSend: maxSend, MaxRecv: maxRecv}, nil
}

// CheckSends checks every request of one PostSend (see CheckSend) before
// any of them is posted and returns them as ws, a W each, filled by keep.
// into(w), if not nil, gives the storage that the vector of w's request
// appends to. The first failure is returned as "PostSend request i (id n):
// ...", and nothing after it is checked.
func CheckSends[W any](owner any, lim Limits, wrs []verbs.SendRequest, into func(w *W) Vec, keep func(w *W, wr *verbs.SendRequest, vec Vec)) (ws []W, err error) {
	return checkEach("PostSend", wrs, into, keep, func(wr *verbs.SendRequest, to Vec) (uint64, Vec, error) {
		vec, err := CheckSend(owner, lim, wr, to)
		return wr.ID, vec, err
	})
}

// CheckRecvs is CheckSends for one PostRecv (see CheckRecv).
func CheckRecvs[W any](owner any, lim Limits, wrs []verbs.RecvRequest, into func(w *W) Vec, keep func(w *W, wr *verbs.RecvRequest, vec Vec)) (ws []W, err error) {
	return checkEach("PostRecv", wrs, into, keep, func(wr *verbs.RecvRequest, to Vec) (uint64, Vec, error) {
		vec, err := CheckRecv(owner, lim, wr, to)
		return wr.ID, vec, err
	})
}

func checkEach[W, R any](post string, wrs []R, into func(*W) Vec, keep func(*W, *R, Vec), check func(*R, Vec) (uint64, Vec, error)) ([]W, error) {
	ws := make([]W, len(wrs))
	for i := range wrs {
		var to Vec
		if into != nil {
			to = into(&ws[i])
		}
		id, vec, err := check(&wrs[i], to)
		if err != nil {
			return nil, RequestError(post, i, id, err)
		}
		keep(&ws[i], &wrs[i], vec)
	}
	return ws, nil
}
