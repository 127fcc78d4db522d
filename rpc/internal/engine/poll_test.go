package engine

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// fakePoller is a verbs.Poller; located adds verbs.PeerLocator.
type fakePoller struct{}

func (fakePoller) BeginPoll() bool { return true }
func (fakePoller) Poll() bool      { return false }
func (fakePoller) EndPoll()        {}

type located struct {
	fakePoller
	inProcess bool
}

func (l located) PeerInProcess() bool { return l.inProcess }

// TestPollsFor: on few Ps a goroutine caller polls only a peer in this
// process; a caller locked to its thread, and any caller on more Ps,
// polls whatever the peer.
func TestPollsFor(t *testing.T) {
	for _, c := range []struct {
		name   string
		p      verbs.Poller
		locked bool
		procs  int
		want   bool
	}{
		{"peer in another process, 2 Ps", located{inProcess: false}, false, 2, false},
		{"peer in another process, 1 P", located{inProcess: false}, false, 1, false},
		{"peer not located, 2 Ps", fakePoller{}, false, 2, false},
		{"peer in this process, 2 Ps", located{inProcess: true}, false, 2, true},
		{"peer in another process, 2 Ps, locked caller", located{inProcess: false}, true, 2, true},
		{"peer in another process, 3 Ps", located{inProcess: false}, false, 3, true},
		{"peer not located, 16 Ps", fakePoller{}, false, 16, true},
	} {
		if got := pollsFor(c.p, c.locked, c.procs); got != c.want {
			t.Errorf("%s: pollsFor %v, want %v", c.name, got, c.want)
		}
	}
}
