package softrc

import (
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

func errorf(format string, args ...any) error { return fmt.Errorf(format, args...) }

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
