//go:build !(linux && cgo && rdma)

package main

import (
	"io"
	"testing"
)

// TestIBVHint: a binary without the ibv provider says how to build one.
func TestIBVHint(t *testing.T) {
	err := run([]string{"-provider", "ibv"}, io.Discard, io.Discard)
	want := `provider "ibv" is not in this binary: build with -tags rdma (needs libibverbs-dev)`
	if err == nil || err.Error() != want {
		t.Errorf("-provider ibv: %v; want %q", err, want)
	}
}
