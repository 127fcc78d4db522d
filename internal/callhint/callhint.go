// Package callhint carries, in a call's context, what the layer that
// makes the call knows about its caller and the engine below wants to
// know: whether the calling goroutine is locked to a thread of its own.
package callhint

import "context"

type lockedKey struct{}

// Locked marks ctx as the context of calls made by a goroutine locked to
// its OS thread (a call into the library from a foreign thread, through
// the C ABI): a goroutine such a call wakes can only run on that thread,
// so waking it is an OS-level wake-up of the thread, and a bounded spin
// on the thread, which is awake already, is cheaper.
func Locked(ctx context.Context) context.Context {
	return context.WithValue(ctx, lockedKey{}, true)
}

// IsLocked reports whether ctx was marked by Locked.
func IsLocked(ctx context.Context) bool {
	v, _ := ctx.Value(lockedKey{}).(bool)
	return v
}
