package shm

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc/granttest"
)

func TestGrants(t *testing.T) { granttest.Run(t, testEnv()) }
