package shm

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
)

func testEnv(opts ...Option) verbstest.Env {
	return verbstest.Env{
		Name: "shm",
		Open: func(t testing.TB) (a, b verbs.ProtectionDomain) {
			p := New(opts...)
			a, err := p.Open("shm")
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			b, err = p.Open("")
			if err != nil {
				a.Close()
				t.Fatalf("Open: %v", err)
			}
			return a, b
		},
		NewMemory: sealedMemory,
	}
}

func TestConformance(t *testing.T) {
	verbstest.Run(t, testEnv())
}
