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

// OpenTwo is an Env.Open that opens device nameA and then device nameB
// of p, failing the test (with nothing left open) when either fails.
func OpenTwo(p verbs.Provider, nameA, nameB string) func(t testing.TB) (a, b verbs.ProtectionDomain) {
	return func(t testing.TB) (a, b verbs.ProtectionDomain) {
		t.Helper()
		a, err := p.Open(nameA)
		if err != nil {
			t.Fatalf("%s: open %q: %v", p.Name(), nameA, err)
		}
		if b, err = p.Open(nameB); err != nil {
			a.Close()
			t.Fatalf("%s: open %q: %v", p.Name(), nameB, err)
		}
		return a, b
	}
}
