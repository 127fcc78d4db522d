package rpc_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestOneGiB fetches and sends a 1 GiB tensor over every data plane.
func TestOneGiB(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: skipping the 1 GiB transfers")
	}
	const size = 1 << 30
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			if rpctest.Race {
				// Under the race detector tcp reads payloads through its
				// annotated path: 21-36 s alone, 61 s in a loaded CI run,
				// past ctxT's 60 s.
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
			}
			big, err := s.NewTensor(ctx, zerocopy.Float32, []int64{size / 4})
			if err != nil {
				t.Fatal(err)
			}
			fill(big.Bytes(), 11)
			s.Publish(context.Background(), "big", big)
			got, err := c.Fetch(ctx, "big")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), big.Bytes()) {
				t.Fatal("fetched 1 GiB differs")
			}
			s.Unpublish("big")
			if err := c.Send(ctx, "back", got); err != nil {
				t.Fatal(err)
			}
			got.Release()
			back, err := s.Take(ctx, "back")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Bytes(), big.Bytes()) {
				t.Fatal("sent 1 GiB differs")
			}
			back.Release()
			big.Release()
		})
	}
}
