package rpc

// This file exposes to the black-box tests (package rpc_test) the little
// of the package's insides they observe. Keep it short: a test that needs
// more belongs in a *_internal_test.go file.

// SessionGone reports whether c's latest session has ended.
func SessionGone(c *Client) bool {
	c.mu.Lock()
	s := c.sess
	c.mu.Unlock()
	return s == nil || s.err() != nil
}
