// Package testenv decides what a test does when the machine lacks what it
// needs (a tool, root, a kernel feature): outside CI it skips, naming what
// is missing and how to get it; under CI=true it fails, so that a CI image
// lacking it cannot pass by skipping.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// CI reports whether CI=true.
func CI() bool { return os.Getenv("CI") == "true" }

// Need skips t with the message, or fails it under CI=true.
func Need(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if CI() {
		t.Fatalf("CI=true, so not skipping: %s", msg)
	}
	t.Skipf("skipping: %s (with CI=true this fails)", msg)
}

// NeedNetns checks what making network namespaces needs: root and
// iproute2's ip command.
func NeedNetns(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Need(t, "two-host tests need root to create network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		Need(t, "two-host tests need the ip command (iproute2)")
	}
}
