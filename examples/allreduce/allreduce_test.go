package main

import (
	"bytes"
	"context"
	"math"
	"os"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestMain lets the test binary play a rank when allreduce re-executes it.
func TestMain(m *testing.M) {
	if childproc.Role() == rankRole {
		os.Exit(rankMain(os.Args[1:]))
	}
	os.Exit(m.Run())
}

func TestRing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		elements int
	}{
		// Chunks of about 40 KB travel inline in control messages; chunks
		// of about 130 KB over the data plane. Neither n divides by 3.
		{"inline", 30001},
		{"dataplane", 100003},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			cfg := config{Ranks: 3, Elements: tc.elements, Iters: 2, Transports: []string{"ibv", "shm", "tcp", "grpc"}}
			if err := cfg.check(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
			defer cancel()
			var out bytes.Buffer
			sum, err := run(ctx, &cfg, &out)
			t.Log("\n" + out.String())
			if err != nil {
				t.Fatal(err)
			}
			if !sum.Exact {
				t.Error("result not exact")
			}
			for r, sent := range sum.Sent {
				if d := math.Abs(float64(sent)-sum.Expected) / sum.Expected; d > 0.05 {
					t.Errorf("rank %d sent %d bytes, %.1f%% off 2(p−1)/p·n = %.0f", r, sent, 100*d, sum.Expected)
				}
				if sum.Received[r] != sum.Sent[(r+cfg.Ranks-1)%cfg.Ranks] {
					t.Errorf("rank %d received %d bytes, its left neighbour sent %d", r, sum.Received[r], sum.Sent[(r+cfg.Ranks-1)%cfg.Ranks])
				}
			}
			if sum.AlgBW <= 0 || math.Abs(sum.BusBW/sum.AlgBW-4.0/3) > 1e-9 {
				t.Errorf("algbw %v, busbw %v", sum.AlgBW, sum.BusBW)
			}
		})
	}
}

// TestChunksCoverVector checks that the chunks partition the vector.
func TestChunksCoverVector(t *testing.T) {
	for _, c := range []config{{Ranks: 3, Elements: 10}, {Ranks: 4, Elements: 4}, {Ranks: 7, Elements: 100003}} {
		next := 0
		for k := range c.Ranks {
			lo, hi := chunkRange(&c, k)
			if lo != next || hi < lo {
				t.Fatalf("%+v: chunk %d is [%d, %d), want it to start at %d", c, k, lo, hi, next)
			}
			next = hi
		}
		if next != c.Elements {
			t.Fatalf("%+v: chunks end at %d", c, next)
		}
	}
}

func TestValuesSumExactly(t *testing.T) {
	for i := range 1000 {
		for r := range 8 {
			if v := value(r, i, 3); v != float32(int(v)) || math.Abs(float64(v)) > maxValue {
				t.Fatalf("value(%d, %d) = %v", r, i, v)
			}
		}
	}
}
