package engine

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// RescueAfter is how long a call run where its frame was read
// (RunRescued) may keep the link's completions waiting before the
// provider's receiving moves on to a new goroutine without it. A watchdog
// looks at the calls running so: every RescueAfter after a call of at
// least a quarter of it was seen running (or after it woke), and less
// often (doubling, up to dogEvery) while every call it sees is shorter:
// a call is left behind between RescueAfter and dogEvery after it began,
// between one and two RescueAfter once calls that long run.
//
// A timer per call would be more precise, and costs more than it saves:
// arming one wakes a sleeping thread to reschedule its sleep (measured:
// 0.3 more idle-P starts per 4 KiB tcp Call on 2 CPUs, 0.6 with 16 Ps).
// So does a watchdog that looks every RescueAfter while short calls run:
// on 2 CPUs, 0.04-0.05 of a 4 KiB tcp Call's 3.1 hand-offs were its
// wake-ups.
const RescueAfter = time.Millisecond

// dogEvery is the longest the watchdog waits between looks while calls
// run where their frames were read.
const dogEvery = 8 * time.Millisecond

// rescue runs one call at a time where the link's completions are handled
// (runHere), watched by the watchdog, which detaches the delivery
// (verbs.Detacher) if the call runs past RescueAfter: a handler that
// blocks, on anything, even on what this lane must bring (a nested call's
// answer, pool memory a release frees), no longer holds up the lane, and
// the call goes on where it is, as a call of its own goroutine would.
// Running the call there saves the goroutine a call would start, and the
// wake-up of an idle thread to run it, which on a machine with many cores
// costs more than a small call's work.
type rescue struct {
	det verbs.Detacher
	// state: rescueIdle, rescueArming (tok being set), rescueRunning (a
	// call runs, watched), rescueDetached (left behind: the call runs on).
	state    atomic.Int32
	tok      atomic.Uint64
	armed    atomic.Int64 // when the running call began (UnixNano)
	detaches atomic.Int64 // for tests
	seen     int64        // armed at the watchdog's previous look (under dog.mu)
}

const (
	rescueIdle = iota
	rescueArming
	rescueRunning
	rescueDetached
)

// newRescue is the link's rescue, nil where its deliveries cannot be
// detached (det nil: a CompletionRunner that is not a verbs.Detacher); the
// watchdog watches it until Link.Close (drop).
func newRescue(det verbs.Detacher) *rescue {
	if det == nil {
		return nil
	}
	r := &rescue{det: det}
	dog.add(r)
	return r
}

// runHere runs fn in the calling goroutine, which handles the link's
// completions, watched; it reports false, without running fn, where it
// cannot: the queue cannot detach this delivery (it is not a provider's
// receiver delivering), fn's completion is not the last of its batch (the
// rest would wait for fn, and a detached goroutine would go on with them
// out of turn), or another call runs so already (left behind).
//
// pace, when not nil, hears whether fn was left behind once fn returns.
func (l *Link) runHere(fn func(), pace Pacer) bool {
	r := l.rescue
	if r == nil || !l.lastOfBatch.Load() {
		return false
	}
	tok := r.det.DeliveryToken()
	if tok == 0 || !r.state.CompareAndSwap(rescueIdle, rescueArming) {
		return false
	}
	r.tok.Store(tok)
	t0 := time.Now()
	r.armed.Store(t0.UnixNano())
	r.state.Store(rescueRunning)
	dog.watch()
	fn()
	behind := !r.state.CompareAndSwap(rescueRunning, rescueIdle)
	if behind {
		r.state.Store(rescueIdle) // detached: fn ran on in this goroutine, which the provider leaves
	}
	if pace != nil {
		pace.Ran(time.Since(t0), behind)
	}
	return true
}

// Pacer hears, for each call run where its frame was read (RunRescued),
// how long it took and whether it was left behind: it ran past
// RescueAfter, and the link's receiving moved on without it.
type Pacer interface {
	Ran(took time.Duration, leftBehind bool)
}

// LongCall is how long a call run where its frame was read may take
// before its kind is better run on goroutines (Pacer): a call saves a
// goroutine's hand-off there (5-20 µs), and holds up the calls behind it
// on its lane, which goroutines would have run side by side, for as long
// as it takes.
const LongCall = 200 * time.Microsecond

// check leaves the call running behind if it began at least RescueAfter
// before now. It reports whether a call began since the previous look
// (began), and for how long the one running has run (ran, 0 when none
// runs still).
func (r *rescue) check(now int64) (began bool, ran time.Duration) {
	armed := r.armed.Load()
	began = armed != r.seen
	r.seen = armed
	if r.state.Load() != rescueRunning {
		return began, 0
	}
	if now-armed < int64(RescueAfter) {
		return began, time.Duration(max(now-armed, 1)) // (or the next call's, which began after this look)
	}
	if r.state.CompareAndSwap(rescueRunning, rescueDetached) && r.det.Detach(r.tok.Load()) {
		r.detaches.Add(1)
	}
	return began, 0
}

// Detaches is how many calls run where their frames were read the link
// left behind (RescueAfter), for tests.
func (l *Link) Detaches() int64 {
	if l.rescue == nil {
		return 0
	}
	return l.rescue.detaches.Load()
}

// dog is the process's watchdog of the calls run where their frames were
// read: one goroutine while links with a rescue exist, which looks at
// them while calls run so (see RescueAfter), and naps, woken by the next
// such call, once none has begun for a while; it ends with the last link.
var dog watchdog

type watchdog struct {
	mu      sync.Mutex
	links   map[*rescue]struct{}
	running bool // the goroutine runs (under mu)
	napping atomic.Bool
	wake    chan struct{} // one slot: a call began while it napped, or a link went
}

// dogNap is how many looks in a row that found no call begun since the
// previous one, nor running, the watchdog makes before it naps. (Napping
// when no call runs at the moment of a look, a watchdog of short calls
// in a steady exchange napped and was woken by the next call every few
// milliseconds.)
const dogNap = 8

func (d *watchdog) add(r *rescue) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.links == nil {
		d.links = make(map[*rescue]struct{})
		d.wake = make(chan struct{}, 1)
	}
	d.links[r] = struct{}{}
	if !d.running {
		d.running = true
		go d.loop()
	}
}

// drop stops watching r (its link closed).
func (d *watchdog) drop(r *rescue) {
	d.mu.Lock()
	delete(d.links, r)
	empty := len(d.links) == 0
	d.mu.Unlock()
	if empty {
		d.signal() // to end
	}
}

// watch wakes the watchdog if it naps: a call began.
func (d *watchdog) watch() {
	if d.napping.Load() && d.napping.CompareAndSwap(true, false) {
		d.signal()
	}
}

func (d *watchdog) signal() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// look checks every link's call; it reports whether any call began since
// the previous look or runs (busy), and the longest any running call has
// run. It holds mu meanwhile (a look at a link is a few atomic loads:
// thousands of links cost tens of microseconds a look, while calls run),
// so that adding and dropping a link costs no copy of them all.
func (d *watchdog) look() (busy bool, longest time.Duration) {
	now := time.Now().UnixNano()
	d.mu.Lock()
	defer d.mu.Unlock()
	for r := range d.links {
		began, ran := r.check(now)
		busy = busy || began || ran > 0
		longest = max(longest, ran)
	}
	return busy, longest
}

func (d *watchdog) loop() {
	idle := 0
	every := RescueAfter
	for {
		d.mu.Lock()
		if len(d.links) == 0 {
			d.running = false
			d.mu.Unlock()
			return
		}
		d.mu.Unlock()
		busy, longest := d.look()
		switch {
		case busy:
			idle = 0
		case idle+1 < dogNap:
			idle++
		default:
			// Nap until a call begins (watch) or a link goes. Said
			// before the last look, so that a call that began after it
			// wakes us (Dekker: each side stores, then loads the other's).
			d.napping.Store(true)
			if busy, _ := d.look(); busy {
				d.napping.Store(false)
			} else {
				<-d.wake
				d.napping.Store(false)
			}
			idle, every = 0, RescueAfter
			continue
		}
		if longest >= RescueAfter/4 {
			every = RescueAfter
		}
		time.Sleep(every)
		every = min(2*every, dogEvery)
	}
}
