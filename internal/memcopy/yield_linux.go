package memcopy

import "syscall"

// osYield gives the CPU to another thread that wants it, if any: a
// sched_yield, which unlike runtime.Gosched wakes no idle thread of ours.
func osYield() { syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }
