package gpudirect

import "syscall"

// osYield gives the thread's CPU to another thread of the host, if one
// waits for it (sched_yield), without a Go scheduler hand-off.
func osYield() { syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }
