package ibv

import (
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// This file is pure Go so that it is tested on every build.

// slot remembers one outstanding work request. Failed completions carry
// only wr_id and status, so the slot supplies the caller's ID, the opcode
// and the length; the number of free slots enforces MaxSend and MaxRecv.
type slot struct {
	id     uint64
	op     verbs.Opcode
	length int
	// unsignaled: posted without IBV_SEND_SIGNALED; it completes only on
	// failure, and otherwise leaves the queue when a later request does.
	unsignaled bool
	// wait is set for a provider-internal request (a window bind or a
	// local invalidate): its completion goes to wait, not to the caller.
	wait *internalOp
}

// internalOp is how Grant and Revoke learn the outcome of the work request
// they posted: the completion queue's poll path fills it and closes done.
//
// A waiter that gives up (abandon) hands over a cleanup, which finish runs
// when the completion comes after all: a window bound late is then
// deallocated instead of leaked.
type internalOp struct {
	done chan struct{}

	mu        sync.Mutex
	finished  bool
	status    verbs.Status
	err       error
	abandoned func()
}

func newInternalOp() *internalOp { return &internalOp{done: make(chan struct{})} }

// finish records the outcome; only the first call counts.
func (o *internalOp) finish(status verbs.Status, err error) {
	o.mu.Lock()
	if o.finished {
		o.mu.Unlock()
		return
	}
	o.finished = true
	o.status, o.err = status, err
	cleanup := o.abandoned
	close(o.done)
	o.mu.Unlock()
	if cleanup != nil {
		cleanup()
	}
}

// result returns the outcome once done is closed.
func (o *internalOp) result() (verbs.Status, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.status, o.err
}

// abandon makes finish run cleanup. It returns false, and does nothing,
// when the op has already finished.
func (o *internalOp) abandon(cleanup func()) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.finished {
		return false
	}
	o.abandoned = cleanup
	return true
}

// slots is a fixed table of outstanding work requests with a free list.
type slots struct {
	table []slot
	used  []bool // guards against a wr_id completing twice
	free  []uint32
}

func newSlots(n int) slots {
	s := slots{table: make([]slot, n), used: make([]bool, n), free: make([]uint32, n)}
	for i := range s.free {
		s.free[i] = uint32(n - 1 - i)
	}
	return s
}

func (s *slots) take(sl slot) (uint32, bool) {
	if len(s.free) == 0 {
		return 0, false
	}
	i := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	s.table[i], s.used[i] = sl, true
	return i, true
}

func (s *slots) put(i uint32) (slot, bool) {
	if int(i) >= len(s.table) || !s.used[i] {
		return slot{}, false
	}
	sl := s.table[i]
	s.table[i] = slot{}
	s.used[i] = false
	s.free = append(s.free, i)
	return sl, true
}

func (s *slots) outstanding() int { return len(s.table) - len(s.free) }

func (s *slots) room() int { return len(s.free) }

// sendSlots are the slots of a send queue, which also remember the order
// requests were posted in. An RC send queue completes in order, so the
// completion of a request means every request posted before it has
// completed too: the unsignaled ones among them, which produce no
// completion on success, leave the queue then.
type sendSlots struct {
	slots
	order []uint32 // ring of slot indices in posting order
	head  int
	n     int
}

func newSendSlots(n int) sendSlots {
	return sendSlots{slots: newSlots(n), order: make([]uint32, n)}
}

func (s *sendSlots) take(sl slot) (uint32, bool) {
	i, ok := s.slots.take(sl)
	if !ok {
		return 0, false
	}
	s.order[(s.head+s.n)%len(s.order)] = i
	s.n++
	return i, true
}

// unwindLast returns the k most recently taken slots, newest first: the
// requests of a post that the device refused.
func (s *sendSlots) unwindLast(k int) {
	for ; k > 0 && s.n > 0; k-- {
		s.n--
		s.slots.put(s.order[(s.head+s.n)%len(s.order)])
	}
}

// complete frees slot i and, before it, every request posted earlier,
// which has completed as well. retired counts those earlier requests;
// skippedSignaled counts the signaled ones among them, which should have
// completed first and did not (zero on a device that keeps the order).
func (s *sendSlots) complete(i uint32) (sl slot, retired, skippedSignaled int, ok bool) {
	if int(i) >= len(s.table) || !s.used[i] {
		return slot{}, 0, 0, false
	}
	for s.n > 0 {
		j := s.order[s.head]
		s.head = (s.head + 1) % len(s.order)
		s.n--
		if j == i {
			break
		}
		earlier, _ := s.slots.put(j)
		retired++
		if !earlier.unsignaled {
			skippedSignaled++
		}
		if earlier.wait != nil {
			earlier.wait.finish(verbs.StatusSuccess, nil)
		}
	}
	sl, _ = s.slots.put(i)
	return sl, retired, skippedSignaled, true
}

// finishWaiters finishes every outstanding internal request with status
// and err: its completion will not come (the queue pair is destroyed).
func (s *slots) finishWaiters(status verbs.Status, err error) {
	for i := range s.table {
		if s.used[i] && s.table[i].wait != nil {
			w := s.table[i].wait
			s.table[i].wait = nil
			w.finish(status, err)
		}
	}
}
