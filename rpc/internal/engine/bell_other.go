//go:build !linux

package engine

import "context"

// bell exists only on Linux (an eventfd); elsewhere callers wait on their
// channels.
type bell struct{}

func newBell() *bell                 { return nil }
func (*bell) ring()                  {}
func (*bell) wait(func() bool) error { return nil }

func (*bell) waitAnswer(*PendingCall, context.Context, <-chan struct{}) error { return nil }
func (*bell) close()                                                          {}

type threadBell struct{}

func newThreadBell() *threadBell { return nil }
func (*threadBell) ring()        {}
func (*threadBell) close()       {}

func (*threadBell) waitAnswer(*PendingCall, context.Context, <-chan struct{}) error { return nil }
