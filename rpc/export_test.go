package rpc

// This file exposes to the black-box tests (package rpc_test) the little
// of the package's insides they observe. Keep it short: a test that needs
// more belongs in a *_internal_test.go file.

import "github.com/tensorrpc/tensorrpc/gpudirect"

// SessionGone reports whether c's latest session has ended.
func SessionGone(c *Client) bool {
	c.mu.Lock()
	s := c.sess
	c.mu.Unlock()
	return s == nil || s.err() != nil
}

// SessionLanes is the number of lanes of c's latest session.
func SessionLanes(c *Client) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last == nil {
		return 0
	}
	return len(c.last.lanes)
}

// ServerSessionLanes is the number of lanes of each of s's live sessions.
func ServerSessionLanes(s *Server) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n []int
	for _, ss := range s.sessions {
		n = append(n, len(ss.lanes))
	}
	return n
}

// SessionHasFrames reports whether c's latest session calls in frames
// over its data plane.
func SessionHasFrames(c *Client) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last != nil && c.last.link != nil && c.last.link.Frames != nil
}

// SetDevicePlan makes plan decide c's device transfers instead of the
// PCI topology: no public option makes a data plane that moves bytes with
// the CPU take the direct path.
func SetDevicePlan(c *Client, plan func(gpudirect.DeviceBuffer) gpudirect.Decision) {
	c.planFor = plan
}

// ServeWithoutReservations makes a server behave as one from before
// reserved Sends: its handshake does not announce them, and it takes a
// reserve as a Send of a tensor without its bytes.
func ServeWithoutReservations() ServerOption {
	return serverOption(func(o *options) { o.noReservations = true })
}
