// Package peerwatch finds the processes of a launched job that died
// without a word. Each such process holds a session with a server of the
// job, named after it; the session ends when the process does, as the
// kernel closes its connections, so a process whose session stays gone
// while the job still needs it has died (killed, crashed) or lost the
// server. A host cut off from the network, whose connections are not
// closed, is not found this way.
package peerwatch

import (
	"context"
	"time"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// Grace is how long a peer's session may be gone before Watch reports it:
// a Client opens a new session on its next call when one ends.
const Grace = 2 * time.Second

// Peers says whom Watch looks for.
type Peers struct {
	// IDs are the peers to look for now.
	IDs func() []int
	// Name is the client name of peer id's session (rpc.WithName).
	Name func(id int) string
	// Needed reports whether peer id's absence counts: it joined and the
	// job still needs it. Watch asks only about a peer whose session has
	// been gone for Grace.
	Needed func(id int) bool
}

// Watch looks at srv's sessions every every until ctx ends. When a peer
// has had no session for Grace and is still needed, it calls left with
// the peer and how long its session has been gone, and returns.
func Watch(ctx context.Context, srv *rpc.Server, every time.Duration, p Peers, left func(id int, gone time.Duration)) {
	goneSince := map[int]time.Time{}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		live := map[string]bool{}
		for _, si := range srv.Sessions() {
			live[si.Client] = true
		}
		now := time.Now()
		for _, id := range p.IDs() {
			if live[p.Name(id)] {
				delete(goneSince, id)
				continue
			}
			since, ok := goneSince[id]
			if !ok {
				goneSince[id] = now
				continue
			}
			if gone := now.Sub(since); gone >= Grace && p.Needed(id) {
				left(id, gone.Round(time.Millisecond))
				return
			}
		}
	}
}
