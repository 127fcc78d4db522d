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
			return verbstest.OpenTwo(New(opts...), "shm", "")(t)
		},
		NewMemory: sealedMemory,
	}
}

func TestConformance(t *testing.T) {
	verbstest.Run(t, testEnv())
}
