//go:build !linux

package engine

// osYield does nothing where sched_yield is not at hand: the spin is
// short.
func osYield() {}
