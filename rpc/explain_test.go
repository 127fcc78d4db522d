package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

type explained struct {
	moved         string
	lanes, copies int
}

type explainCase struct {
	what string
	do   func(ctx context.Context, c *rpc.Client) error
	want explained
}

func explainFetch(n int, opts ...rpc.FetchOption) func(context.Context, *rpc.Client) error {
	return func(ctx context.Context, c *rpc.Client) error {
		t, err := c.Fetch(ctx, fmt.Sprint("explain/", n), opts...)
		if err == nil {
			t.Release()
		}
		return err
	}
}

func explainSend(n int) func(context.Context, *rpc.Client) error {
	return func(ctx context.Context, c *rpc.Client) error {
		zt, err := zerocopy.New(zerocopy.Uint8, []int64{int64(n)}, make([]byte, n))
		if err != nil {
			return err
		}
		return c.Send(ctx, "explain/sent", rpc.WrapTensor(zt))
	}
}

// TestExplainPaths: a client's CallInfo says how each call's bytes moved,
// over how many lanes and with how many copies, on every plane.
func TestExplainPaths(t *testing.T) {
	const small, large, striped = 4 << 10, 1 << 20, 12 << 20
	both := []explainCase{
		{"fetch 4 KiB", explainFetch(small), explained{rpc.MovedInline, 0, 1}},
		{"fetch 1 MiB", explainFetch(large), explained{rpc.MovedPulled, 1, 0}},
		{"fetch 12 MiB (striped)", explainFetch(striped), explained{rpc.MovedPulled, 2, 0}},
		{"send 4 KiB", explainSend(small), explained{rpc.MovedInline, 0, 1}},
	}
	cases := map[string][]explainCase{
		rpc.TransportTCP: append(slices.Clone(both), explainCase{"send 1 MiB of caller memory", explainSend(large), explained{rpc.MovedInPlace, 1, 0}}),
		rpc.TransportSHM: append(slices.Clone(both), explainCase{"lease 1 MiB", explainFetch(large, rpc.Lease()), explained{rpc.MovedLeased, 0, 0}}),
		rpc.TransportGRPC: {
			{"fetch 1 MiB", explainFetch(large), explained{rpc.MovedStream, 0, 1}},
			{"fetch 1 MiB into caller memory", func(ctx context.Context, c *rpc.Client) error {
				dst := wrapped(t, large, 0)
				_, err := c.Fetch(ctx, fmt.Sprint("explain/", large), rpc.Into(dst))
				return err
			}, explained{rpc.MovedStream, 0, 2}},
		},
	}
	for tr, cs := range cases {
		t.Run(tr, func(t *testing.T) {
			var mu sync.Mutex
			var last rpc.CallInfo
			record := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
				err := next(ctx)
				mu.Lock()
				last = *info
				mu.Unlock()
				return err
			}
			s, addr, _ := serveOn(t, "127.0.0.1:0")
			for _, n := range []int{small, large, striped} {
				publishBytes(t, s, fmt.Sprint("explain/", n), n, 7)
			}
			ctx := ctxT(t)
			c, err := rpc.Dial(ctx, addr, insecureCreds(), rpc.WithTransports(tr), rpc.WithLanes(2), rpc.WithInterceptors(record))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			for _, tc := range cs {
				if err := tc.do(ctx, c); err != nil {
					t.Fatalf("%s: %v", tc.what, err)
				}
				mu.Lock()
				got := explained{last.Moved, last.Lanes, last.Copies}
				mu.Unlock()
				if got != tc.want {
					t.Errorf("%s over %s: %+v, want %+v", tc.what, tr, got, tc.want)
				}
			}
		})
	}
}

// TestExplainLog: at debug level every call is logged with how it moved.
func TestExplainLog(t *testing.T) {
	var mu sync.Mutex
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logged}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s, addr, _ := serveOn(t, "127.0.0.1:0", rpc.WithLogger(log))
	publishBytes(t, s, "w", 1<<20, 1)
	ctx := ctxT(t)
	c, err := rpc.Dial(ctx, addr, insecureCreds(), rpc.WithTransports(rpc.TransportTCP), rpc.WithLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tt, err := c.Fetch(ctx, "w")
	if err != nil {
		t.Fatal(err)
	}
	tt.Release()
	mu.Lock()
	out := logged.String()
	mu.Unlock()
	for _, want := range []string{`msg="tensorrpc: call" side=client op=Fetch name=w plane=tcp path=frame`, "moved=pulled lanes=1 copies=0", "side=server op=Fetch name=w plane=tcp"} {
		if !strings.Contains(out, want) {
			t.Errorf("debug log lacks %q:\n%s", want, out)
		}
	}
}
