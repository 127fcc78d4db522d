package engine

import (
	"context"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/callhint"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// PollSpin is how long a caller waiting for an answer on a link whose
// queue pair can be polled (verbs.Poller: shm) polls it before it parks
// (AwaitAnswer). A round trip on shm is a few microseconds of work when
// both sides are awake; polling for it in the caller's goroutine saves the
// receiver's wake-up and its hand-off of the answer to the caller, which
// on a many-core machine are most of a small call's time.
const PollSpin = 50 * time.Microsecond

// fewProcs is the most Ps at which a polling caller yields to its
// process's goroutines (runtime.Gosched) after handling what was not its
// answer, even with no other call in flight: on so few, a goroutine the
// handling made ready may have no other P to run on.
const fewProcs = 4

// soloProcs is the most Ps at which a goroutine caller polls only a
// queue pair whose peer is in this process (verbs.PeerLocator), and waits
// for the receiver to hand its answer over from one in another process.
// There, the two processes' spinning threads (this caller, the peer's
// receiver, each side's other goroutines) outnumber the cores, and the
// kernel cannot tell which one has the work: 4 KiB shm Fetches between
// two Go processes on the 2-core VM, 3000 sequential calls a run,
// medians of 6-8 runs, polling against handing over: p50 14.3, 14.9,
// 10.2 -> 12.1, 9.4, 9.9 µs; p99 824, 593, 645 -> 319, 105, 171 µs;
// mean 59, 42, 35 -> 25, 16, 18 µs (calls slower than 300 µs: 166, 98,
// 95 -> 30, 10, 18); 1 MiB: p50 77, 74 -> 64, 69 µs, mean 180, 154 ->
// 95, 106 µs. Within one process the Go scheduler shares the Ps between
// the poller and the rest, and polling stays ahead (BenchmarkFetch
// shm/4KiB 10.2 against 11.9 µs). A caller locked to its thread (the C
// ABI's) polls anyway: handing over to it is an OS-level wake-up, several
// times slower (75-109 µs at 4 KiB).
const soloProcs = 2

// lockedPollFactor is how many times its spin a caller locked to its
// thread polls (unless TENSORRPC_POLL_US sets the spin): past it, the
// answer is handed over to its thread, an OS-level wake-up (75-109 µs at
// 4 KiB between two processes on the 2-core VM), after the peer's wake-up
// message to our sleeping receiver, so a short poll that an answer
// delayed by the scheduler outlasts costs several times what it saves.
// Python's fetches on shm between two processes there, two interleaved
// pairs of runs, 50 against 200 µs (TENSORRPC_POLL_US): 4 KiB p50 18.8,
// 20.7 -> 16.4, 16.7 µs, p99 829, 195 -> 145, 114 µs (the C caller 19.4,
// 46.7 -> 14.4, 9.7 µs); 1 MiB 88, 91 -> 98, 70 µs; the library built
// each way, two more pairs: 4 KiB 14.4, 22.2 -> 19.0, 18.1 µs (p99 314,
// 176 -> 304, 274), 1 MiB 138, 89 -> 63, 78 µs (p99 2371, 1943 -> 305,
// 955; C 107, 324 -> 78, 89 µs).
const lockedPollFactor = 4

// pollsFor reports whether a caller (locked to its thread or not, in a
// process of procs Ps) polls p for its answer.
func pollsFor(p verbs.Poller, locked bool, procs int) bool {
	if locked || procs > soloProcs {
		return true
	}
	l, ok := p.(verbs.PeerLocator)
	return ok && l.PeerInProcess()
}

// maxWatchFactor bounds how long a caller locked to its thread watches
// for its answer on tcp (awaitBell): at most this many times its spin.
const maxWatchFactor = 8

// watchFor is how long a locked caller watches for its answer, given its
// spin and how long such callers waited lately: twice that, at least the
// spin and at most maxWatchFactor times it (no spin: no watch).
func watchFor(spin, lately time.Duration) time.Duration {
	return min(max(spin, 2*lately), maxWatchFactor*spin)
}

// AwaitAnswer waits up to spin for pc's answer while polling the link's
// queue pair, so that the answer is handled in this goroutine and nothing
// needs to wake it. It reports false, with no answer, when the spin ran
// out, the queue pair cannot be polled, pollsFor says not to (a
// goroutine caller on few Ps whose peer is another process; always
// overrides it: TENSORRPC_POLL_US was set), another caller polls it (one
// spinning caller per lane takes every answer as it arrives, and hands
// the others over), or other requests of the link await their answers
// too: the caller then waits for pc.Ch as before. With calls in flight
// side by side the receiver is busy anyway, and a caller spinning beside
// it kept the callers whose answers it handled off its P: on 2 CPUs, 4
// streams of 4 KiB shm Fetches had a p50 of 172-188 µs polling so and
// 69-75 µs without; only polling alone, 71 µs. Between fruitless
// looks it lets other threads of the host run (the peer's, on a machine
// with few cores), without waking an idle one.
func (l *Link) AwaitAnswer(ctx context.Context, pc *PendingCall, spin time.Duration, always bool) (FrameReply, bool) {
	p, ok := l.QP.(verbs.Poller)
	if !ok {
		return l.awaitBell(ctx, pc, spin)
	}
	locked := callhint.IsLocked(ctx)
	if spin <= 0 || l.Frames.InFlight() > 1 || !(always || pollsFor(p, locked, runtime.GOMAXPROCS(0))) || !p.BeginPoll() {
		return FrameReply{}, false // the receiver, or the lane's poller, hands our answer over
	}
	defer p.EndPoll()
	if locked && !always {
		spin *= lockedPollFactor
	}
	var start time.Time
	for i := 0; ; i++ {
		// Two one-case selects, not one of two cases: a receive that
		// would not block returns without taking the channel's lock
		// when it finds nothing, where a select of several cases locks
		// them all on every look (a tenth of the CPU of a 4 KiB shm
		// Fetch, in runtime.lock2 and unlock2, on 2 CPUs).
		select {
		case <-pc.Ch:
			r := pc.Reply()
			return r, true
		default:
		}
		if isDone(l.Dead) {
			return FrameReply{}, false
		}
		if p.Poll() {
			select {
			case <-pc.Ch:
				r := pc.Reply()
				return r, true
			default:
			}
			// What we handled was for other goroutines (the answers of
			// callers waiting on their channels): they were made ready on
			// this P, and with few Ps spinning here would keep them off it.
			// With many Ps and no other call of the link in flight, what
			// we handled readied nobody (an ack, a credit, a request our
			// server ran where it read it), and Gosched would start an
			// idle P for nothing (Go's wakep): only the thread yields, as
			// does a caller locked to its thread, whose Gosched would park
			// the thread and make another wake it up again (stoplockedm,
			// startlockedm), two OS-level switches.
			if locked || (l.Frames.InFlight() <= 1 && runtime.GOMAXPROCS(0) > fewProcs) {
				osYield()
			} else {
				runtime.Gosched()
			}
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

// awaitBell waits for pc's answer on the link's bell, for a queue pair
// whose receiving runs in a goroutine of its own (tcp). The receiver puts
// the answer in pc.Ch, which readies nobody, and rings the bell; when the
// receiver then waits for its socket again, its own thread finds the bell
// in the netpoller and runs this caller, as it would a goroutine reading
// a socket. A channel hand-off would instead start an idle thread (Go's
// wakep), which on a many-core machine costs more than the call's work.
// One caller per link waits so; it reports false, with no answer, for
// the others, when there is no bell, when the link fails, or when ctx
// ends: the caller then waits for pc.Ch as before.
//
// A caller locked to its thread (callhint.Locked: a call from a foreign
// thread through the C ABI) first watches pc.Ch for up to watch, or
// twice as long as such callers on the link waited lately, up to
// maxWatchFactor times watch: waking it is an OS-level wake-up of its
// thread, which is awake now. Past the watch it blocks in read(2) on the
// link's thread bell (threadBell), which the receiver then rings: the
// kernel wakes its thread, as a socket would, where parked in the
// netpoller it took a P hand-over to a thread that had to be woken and a
// second thread put to sleep. (A fixed
// 50 µs ran out before half the answers of 4 KiB tcp Fetches between two
// processes on the 2-core VM, whose median took 46-55 µs: Python's p50
// was 1.7-1.9× Go's with it, 1.3-1.5× watching 200 µs.)
func (l *Link) awaitBell(ctx context.Context, pc *PendingCall, watch time.Duration) (FrameReply, bool) {
	if l.bell == nil || !l.belled.CompareAndSwap(false, true) {
		return FrameReply{}, false
	}
	defer l.belled.Store(false)
	// A locked caller watches, and blocks on the thread bell, only while
	// the process has a P to spare for the receivers beside every such
	// caller: a watch holds its P, and so does a read(2) until the
	// runtime's monitor takes it back (20 µs to 10 ms later), so that
	// with GOMAXPROCS=1 the receiver could not run to answer either (a
	// 4 KiB tcp fetch from Python took 470-590 µs watching and 183 µs on
	// the thread bell, against 80 parked in the netpoller).
	locked := false
	if l.tbell != nil && callhint.IsLocked(ctx) {
		n := lockedWaiters.Add(1)
		defer lockedWaiters.Add(-1)
		locked = int(n) < runtime.GOMAXPROCS(0)
	}
	if ctx.Done() != nil {
		ring := l.bell.ring
		if locked {
			ring = l.tbell.ring
		}
		stop := context.AfterFunc(ctx, ring)
		defer stop()
	}
	var start, watchUntil time.Time
	if watch > 0 && locked && l.Frames.InFlight() == 1 {
		start = time.Now()
		watchUntil = start.Add(watchFor(watch, time.Duration(l.answerWait.Load())))
	}
	if !start.IsZero() {
		defer func() {
			// The moving average of the waits, 1/4 the newest.
			took := int64(time.Since(start))
			old := l.answerWait.Load()
			l.answerWait.Store(old + (took-old)/4)
		}()
	}
	if !locked {
		pc.bell.Store(l.bell)
	}
	done := ctx.Done()
	for i := 1; ; i++ {
		// One-case selects, as in AwaitAnswer: the watch below looks
		// many times, and a select of several cases locks them all.
		select {
		case <-pc.Ch:
			r := pc.Reply()
			return r, true
		default:
		}
		if isDone(l.Dead) || done != nil && isDone(done) {
			return FrameReply{}, false
		}
		if !watchUntil.IsZero() {
			if i%32 != 0 {
				continue
			}
			if time.Now().Before(watchUntil) {
				osYield()
				continue
			}
			watchUntil = time.Time{}
		}
		if locked {
			// Set only now, so that an answer the watch saw cost its
			// receiver no ring; the wait looks at pc.Ch before it
			// blocks, after this store, and the receiver looks for a
			// bell after it filled pc.Ch.
			pc.tbell.Store(l.tbell)
			if l.tbell.waitAnswer(pc, ctx, l.Dead) != nil {
				return FrameReply{}, false
			}
			continue
		}
		if l.bell.waitAnswer(pc, ctx, l.Dead) != nil {
			return FrameReply{}, false
		}
	}
}

// lockedWaiters counts the callers locked to their threads that wait in
// awaitBell, in the whole process (see there).
var lockedWaiters atomic.Int32

// isDone reports whether ch is closed.
func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
