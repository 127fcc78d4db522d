package tcp_test

import (
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
)

// testEnv is the conformance environment of the tcp provider: two domains
// of one provider on loopback, and plain Go memory.
func testEnv(opts ...tcp.Option) verbstest.Env {
	p := tcp.New(append([]tcp.Option{tcp.WithLingerTimeout(time.Second)}, opts...)...)
	return verbstest.Env{
		Name: "tcp",
		Open: verbstest.OpenTwo(p, "", "tcp"),
		NewMemory: func(t testing.TB, size int) verbs.Memory {
			return verbs.Memory{Bytes: make([]byte, size)}
		},
	}
}

func TestConformance(t *testing.T) {
	verbstest.Run(t, testEnv())
}
