package gpudirect

import (
	"runtime"
	"time"
)

// Go's sleeps are not shorter than about a millisecond when the process
// has nothing else to do: the runtime's netpoller waits in whole
// milliseconds (a 50 µs time.Sleep takes about 1.07 ms on the 2-core VM).
// So what waits for a copy that ends within a millisecond or two looks
// again after yielding rather than sleeping, and sleeps only in whole
// milliseconds, where a millisecond more costs little.
const (
	// spinWait is how long a waiter looks again after yielding before it
	// sleeps.
	spinWait = 2 * time.Millisecond
	// sleepStep is how long it then sleeps between looks.
	sleepStep = time.Millisecond
)

// yield lets other goroutines run and, every 16th call (n counts them),
// other threads of the host (the peer's, on a machine with few cores).
func yield(n int) {
	if n%16 == 15 {
		osYield()
	} else {
		runtime.Gosched()
	}
}

// sleepUntil returns at deadline, give or take a few microseconds: it
// sleeps while more than spinWait is left, then yields until it is time.
func sleepUntil(deadline time.Time) {
	if left := time.Until(deadline) - spinWait; left > 0 {
		time.Sleep(left)
	}
	for i := 0; time.Now().Before(deadline); i++ {
		yield(i)
	}
}
