//go:build race

package rpctest

// Race reports whether the race detector is on.
const Race = true
