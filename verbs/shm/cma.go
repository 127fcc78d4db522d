package shm

import "errors"

// ErrCMAUnusable is wrapped by every error that says why cross-memory
// attach (process_vm_readv and process_vm_writev between the two
// processes of a connection) cannot reach a process's memory: the Yama
// ptrace_scope, different users, the kernel's refusal, a peer that does
// not take part, or a platform other than Linux.
var ErrCMAUnusable = errors.New("shm: cross-memory attach is unusable")

// CrossMemory is implemented by the shm provider's queue pairs. Memory
// registered without an fd is reached by the peer through cross-memory
// attach; whether that works is decided once per connection, in Connect,
// by a real probe each side makes of the other's memory.
type CrossMemory interface {
	// CMA reports whether the peer can read and write this process's
	// memory by cross-memory attach, that is whether the peer's Reads and
	// Writes of regions registered here without an fd (through their
	// remote rights or grants) can work. It is nil when they can, and
	// otherwise an error wrapping ErrCMAUnusable that says why (also
	// before Connect has succeeded, wrapping verbs.ErrNotConnected too).
	// A layer that registers memory without an fd to grant it should ask
	// first, and copy through memfd memory when it is not nil: a peer's
	// access then fails, and fails the connection.
	CMA() error
}
