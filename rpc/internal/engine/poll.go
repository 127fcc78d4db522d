package engine

import (
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// PollSpin is how long a caller waiting for an answer on a link whose
// queue pair can be polled (verbs.Poller: shm) polls it before it parks
// (AwaitAnswer). A round trip on shm is a few microseconds of work when
// both sides are awake; polling for it in the caller's goroutine saves the
// receiver's wake-up and its hand-off of the answer to the caller, which
// on a many-core machine are most of a small call's time.
const PollSpin = 50 * time.Microsecond

// AwaitAnswer waits up to spin for pc's answer while polling the link's
// queue pair, so that the answer is handled in this goroutine and nothing
// needs to wake it. It reports false, with no answer, when the spin ran
// out, the queue pair cannot be polled, or another caller polls it (one
// spinning caller per lane takes every answer as it arrives, and hands
// the others over): the caller then waits for pc.Ch as before. Between fruitless
// looks it lets other threads of the host run (the peer's, on a machine
// with few cores), without waking an idle one.
func (l *Link) AwaitAnswer(pc *PendingCall, spin time.Duration) (FrameReply, bool) {
	p, ok := l.QP.(verbs.Poller)
	if !ok || spin <= 0 || !p.BeginPoll() {
		return FrameReply{}, false // another caller polls the lane: it hands our answer over
	}
	defer p.EndPoll()
	var start time.Time
	for i := 0; ; i++ {
		select {
		case r := <-pc.Ch:
			return r, true
		case <-l.Dead:
			return FrameReply{}, false
		default:
		}
		if p.Poll() {
			continue
		}
		if i%32 == 0 {
			if start.IsZero() {
				start = time.Now()
			} else if time.Since(start) >= spin {
				return FrameReply{}, false
			}
			osYield()
		}
	}
}
