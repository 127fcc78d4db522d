package softrc

import (
	"cmp"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// This file is the contract's checks and errors that do not depend on how
// a provider keeps its queues or its memory, so that tcp, shm and ibv
// refuse the same things with the same errors: each names the provider
// and, for a queue pair, its id; a queue pair in ERR gives its cause.

// QPErrorf is an error of queue pair id of provider ("tcp"):
// "tcp: queue pair 7: " and the formatted text, which may wrap with %w.
func QPErrorf(provider string, id uint64, format string, args ...any) error {
	return fmt.Errorf("%s: queue pair %d: %w", provider, id, fmt.Errorf(format, args...))
}

// ClosedError is the error of verb op ("new queue pair") on a closed
// domain of provider.
func ClosedError(provider, op string) error {
	return fmt.Errorf("%s: %s: domain: %w", provider, op, verbs.ErrClosed)
}

// PostError is why nothing can be posted to a queue pair now, or nil:
// closed (ErrClosed), in ERR (ErrQPError, with the cause) or, for the send
// queue, not yet connected (ErrNotConnected). Receives may be posted
// before Connect.
func PostError(closed bool, state verbs.QPState, cause error, send bool) error {
	switch {
	case closed:
		return verbs.ErrClosed
	case state == verbs.QPError:
		if cause != nil {
			return fmt.Errorf("%w: %v", verbs.ErrQPError, cause)
		}
		return verbs.ErrQPError
	case send && state != verbs.QPReadyToSend:
		return fmt.Errorf("queue pair in %v: %w", state, verbs.ErrNotConnected)
	}
	return nil
}

// RequestError is the error of request i (with id) of one post ("PostSend",
// "PostRecv"): nothing of that post was posted.
func RequestError(post string, i int, id uint64, err error) error {
	return fmt.Errorf("%s request %d (id %d): %w", post, i, id, err)
}

// QueueFull is the error of a post of n requests to a queue of max
// requests that has outstanding ones.
func QueueFull(n, outstanding, max int) error {
	return fmt.Errorf("%d requests with %d of %d outstanding: %w", n, outstanding, max, verbs.ErrQueueFull)
}

// QueueSizes checks a queue pair config's MaxSend and MaxRecv against the
// device's depth and applies the defaults. Sizes beyond depth wrap
// verbs.ErrTooLarge.
func QueueSizes(cfg verbs.QueuePairConfig, depth int) (maxSend, maxRecv int, err error) {
	if cfg.MaxSend < 0 || cfg.MaxRecv < 0 || cfg.MaxInline < 0 {
		return 0, 0, fmt.Errorf("negative queue sizes (MaxSend %d, MaxRecv %d, MaxInline %d)", cfg.MaxSend, cfg.MaxRecv, cfg.MaxInline)
	}
	maxSend, maxRecv = cmp.Or(cfg.MaxSend, DefaultQueueDepth), cmp.Or(cfg.MaxRecv, DefaultQueueDepth)
	if maxSend > depth || maxRecv > depth {
		return 0, 0, fmt.Errorf("MaxSend %d or MaxRecv %d exceeds the device's MaxQueueDepth %d: %w", maxSend, maxRecv, depth, verbs.ErrTooLarge)
	}
	return maxSend, maxRecv, nil
}

// CheckOpcode checks the opcode of a send queue request (else
// verbs.ErrUnsupported) and returns the right its local memory needs: a
// Read's destination needs local write.
func CheckOpcode(op verbs.Opcode) (verbs.Access, error) {
	switch op {
	case verbs.OpSend, verbs.OpWrite, verbs.OpWriteImm:
		return 0, nil
	case verbs.OpRead:
		return verbs.AccessLocalWrite, nil
	}
	return 0, fmt.Errorf("opcode %v cannot be posted to a send queue: %w", op, verbs.ErrUnsupported)
}

// CheckSegments checks the number of local segments of a request against
// the device's MaxSegments (else verbs.ErrTooLarge).
func CheckSegments(n, max int) error {
	if n > max {
		return fmt.Errorf("%d segments exceed the device's MaxSegments %d: %w", n, max, verbs.ErrTooLarge)
	}
	return nil
}

// CheckLength checks the total length of a request against the device's
// MaxMessageBytes (else verbs.ErrTooLarge).
func CheckLength(n, max int64) error {
	if n > max {
		return fmt.Errorf("%d bytes exceed the device's MaxMessageBytes %d: %w", n, max, verbs.ErrTooLarge)
	}
	return nil
}
