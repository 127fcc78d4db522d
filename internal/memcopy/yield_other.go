//go:build !linux

package memcopy

import "runtime"

// osYield lets other goroutines run (no sched_yield here).
func osYield() { runtime.Gosched() }
