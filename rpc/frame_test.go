package rpc_test

import (
	"bytes"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// TestFetchFrames: a data-plane session fetches small (inline) and large
// (read) tensors, leased and waited for, as frames: the server's gRPC
// interceptors (WithGRPCServerOptions) see no call but Session.
func TestFetchFrames(t *testing.T) {
	for _, tr := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		for _, lanes := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/lanes=%d", tr, lanes), func(t *testing.T) {
				var u rpctest.ServerCalls
				s, c := pair(t, tr, []rpc.ServerOption{rpc.WithGRPCServerOptions(u.Options()...), rpc.WithLanes(lanes)}, []rpc.DialOption{rpc.WithLanes(lanes)})
				if !rpc.SessionHasFrames(c) {
					t.Fatal("no frames")
				}
				ctx := ctxT(t)
				small := publishBytes(t, s, "small", 4<<10, 1)
				large := publishBytes(t, s, "large", 1<<20, 2)
				fetches := 0
				for i := range 50 {
					for _, k := range []struct {
						key  string
						want []byte
						opts []rpc.FetchOption
					}{{"small", small, nil}, {"large", large, nil}, {"large", large, []rpc.FetchOption{rpc.Lease()}}} {
						got, err := c.Fetch(ctx, k.key, k.opts...)
						if err != nil {
							t.Fatalf("fetch %d of %q: %v", i, k.key, err)
						}
						if !bytes.Equal(got.Bytes(), k.want) {
							t.Fatalf("fetch %d of %q: wrong bytes", i, k.key)
						}
						got.Release()
						fetches++
					}
				}
				_, err := c.Fetch(ctx, "missing")
				if status.Code(err) != codes.NotFound || !bytes.Contains([]byte(err.Error()), []byte(`"missing"`)) {
					t.Fatalf("fetch of a missing key: %v, want NotFound naming it", err)
				}
				fetches++
				// Sends share the server's slots with Fetches.
				for i := range 3 * engine.FrameSlots {
					w := wrapped(t, 64<<10, byte(i))
					want := append([]byte(nil), w.Bytes()...)
					if err := c.Send(ctx, "sent", w); err != nil {
						t.Fatalf("send %d: %v", i, err)
					}
					w.Release()
					got, err := c.Fetch(ctx, "sent")
					if err != nil {
						t.Fatalf("fetch after send %d: %v", i, err)
					}
					if !bytes.Equal(got.Bytes(), want) {
						t.Fatalf("fetch after send %d: stale bytes", i)
					}
					got.Release()
					fetches++
				}
				u.None(t)
				if got := int(s.Stats().Transfers); got < fetches {
					t.Errorf("server counted %d transfers, want at least %d", got, fetches)
				}
				if st := s.Stats(); st.Transfers == 0 || st.DataPlaneBytes == 0 || st.InlineBytes == 0 {
					t.Errorf("server stats not counted: %+v", st)
				}
			})
		}
	}
}
