package callhint

import (
	"context"
	"testing"
)

func TestLocked(t *testing.T) {
	ctx := context.Background()
	if IsLocked(ctx) {
		t.Fatal("a bare context is marked locked")
	}
	locked := Locked(ctx)
	if !IsLocked(locked) {
		t.Fatal("Locked's context is not marked")
	}
	child, cancel := context.WithCancel(locked)
	defer cancel()
	if !IsLocked(child) {
		t.Fatal("a child of a locked context lost the mark")
	}
}
