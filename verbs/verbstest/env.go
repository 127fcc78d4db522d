// Package verbstest is the conformance suite every verbs provider passes.
//
// A provider's tests describe how to open two connected ends and how to make
// registrable memory, then hand that to Run:
//
//	func TestConformance(t *testing.T) {
//		verbstest.Run(t, verbstest.Env{Name: "tcp", Open: ..., NewMemory: ...})
//	}
package verbstest

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Env is what the suite needs from a provider.
type Env struct {
	// Name names the provider in failure messages.
	Name string
	// Open returns two protection domains, the two ends of every test. The
	// suite creates queue pairs on each and connects them to each other by
	// exchanging LocalInfo. The suite closes both domains when the test ends.
	Open func(t testing.TB) (a, b verbs.ProtectionDomain)
	// NewMemory returns size bytes of memory the provider can register
	// (memfd-backed and sealed for shm). It frees the memory through
	// t.Cleanup.
	NewMemory func(t testing.TB, size int) verbs.Memory
}
