// White-box: these tests read and break the lanes (links) of both sides' sessions.

package rpc

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestLanes: a session with several lanes spreads concurrent Fetches,
// Sends and Calls of inline and one-sided sizes over all of them, and each
// returns the right bytes.
func TestLanes(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []ServerOption{WithLanes(4)}, []DialOption{WithLanes(4)})
			s.Handle("echo", echo(s))
			ss := serverSessionOf(t, s)
			if len(c.last.lanes) != 4 || len(ss.lanes) != 4 {
				t.Fatalf("lanes: client %d, server %d, want 4", len(c.last.lanes), len(ss.lanes))
			}
			ctx := ctxT(t)
			sizes := []int{100, 64 << 10, 1 << 20}
			want := map[string][]byte{}
			for i, n := range sizes {
				key := fmt.Sprintf("pub%d", i)
				want[key] = publishBytes(t, s, key, n, byte(i+1))
			}
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for g := range 16 {
				wg.Go(func() {
					for i := range 12 {
						n := sizes[(g+i)%len(sizes)]
						key := fmt.Sprintf("pub%d", (g+i)%len(sizes))
						got, err := c.Fetch(ctx, key)
						if err != nil {
							errs <- fmt.Errorf("fetch: %w", err)
							return
						}
						same := bytes.Equal(got.Bytes(), want[key])
						got.Release()
						if !same {
							errs <- fmt.Errorf("fetch of %s: wrong bytes", key)
							return
						}
						in := wrapped(t, n, byte(g))
						own := fmt.Sprintf("g%d", g)
						if err := c.Send(ctx, own, in); err != nil {
							in.Release()
							errs <- fmt.Errorf("send: %w", err)
							return
						}
						back, err := c.Fetch(ctx, own)
						if err != nil {
							in.Release()
							errs <- fmt.Errorf("fetch after send: %w", err)
							return
						}
						same = bytes.Equal(back.Bytes(), in.Bytes())
						back.Release()
						reply, err := c.Call(ctx, "echo", &Message{Tensors: []*Tensor{in}})
						if err == nil {
							same = same && bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes())
							reply.Release()
						}
						in.Release()
						if err != nil || !same {
							errs <- fmt.Errorf("send/call of %d bytes: %v, same bytes %v", n, err, same)
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			for i, l := range ss.lanes {
				if l.Frames.Received.Load() == 0 {
					t.Errorf("server lane %d received no frame", i)
				}
			}
		})
	}
}

// TestLaneDeath: when one lane (not the first) fails, the session ends and
// the next call opens a new one.
func TestLaneDeath(t *testing.T) {
	s, c := pair(t, TransportTCP, []ServerOption{WithLanes(3)}, []DialOption{WithLanes(3)})
	publishBytes(t, s, "k", 1<<20, 1)
	first := c.SessionID()
	ss := serverSessionOf(t, s)
	ss.lanes[2].QP.Close() // the server's end of lane 2 goes away
	expectNewSession(t, c, first, "k")
}

// expectNewSession waits until c's session (first) has ended after a lane
// died, then fetches key on the new one that the next call opens.
func expectNewSession(t *testing.T, c *Client, first, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !sessionGone(c) {
		if time.Now().After(deadline) {
			t.Fatal("the session survived a dead lane")
		}
		time.Sleep(5 * time.Millisecond)
	}
	var got *Tensor
	var err error
	for time.Now().Before(deadline) {
		if got, err = c.Fetch(ctxT(t), key); status.Code(err) != codes.Unavailable {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("fetch on a new session: %v", err)
	}
	got.Release()
	if c.SessionID() == first {
		t.Fatal("the same session after a lane died")
	}
}

// TestStripes: a transfer of engine.StripeMin bytes or more on a session with
// several lanes is read in parts over every lane (Fetch: the client's
// lanes read; Send and Call: the server's), and arrives whole.
func TestStripes(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []ServerOption{WithLanes(3)}, []DialOption{WithLanes(3)})
			s.Handle("echo", echo(s))
			ss := serverSessionOf(t, s)
			ctx := ctxT(t)
			reads := func(lanes []*engine.Link) []uint64 {
				var out []uint64
				for _, l := range lanes {
					out = append(out, l.Reads.Load())
				}
				return out
			}
			allGrew := func(what string, before, after []uint64) {
				t.Helper()
				for i := range before {
					if after[i] == before[i] {
						t.Errorf("%s: lane %d posted no Read (%v -> %v)", what, i, before, after)
					}
				}
			}
			n := engine.StripeMin + 3*engine.StripePart + 12345 // parts not a multiple of the page size
			want := publishBytes(t, s, "big", n, 7)
			before := reads(c.last.lanes)
			got, err := c.Fetch(ctx, "big")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), want) {
				t.Fatal("striped fetch: wrong bytes")
			}
			got.Release()
			allGrew("fetch", before, reads(c.last.lanes))

			in := wrapped(t, n, 9)
			defer in.Release()
			before = reads(ss.lanes)
			if err := c.Send(ctx, "sent", in); err != nil {
				t.Fatal(err)
			}
			allGrew("send", before, reads(ss.lanes))
			back, err := s.Fetch(ctx, "sent")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Bytes(), in.Bytes()) {
				t.Fatal("striped send: wrong bytes")
			}
			back.Release()

			before = reads(ss.lanes)
			reply, err := c.Call(ctx, "echo", &Message{Tensors: []*Tensor{in}})
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(reply.Tensors[0].Bytes(), in.Bytes()) {
				t.Fatal("striped call: wrong reply")
			}
			reply.Release()
			allGrew("call", before, reads(ss.lanes))
		})
	}
}

// TestClientLaneDeath: when one of the client's lanes fails, the client
// ends the session (and its stream) and the next call opens a new one.
func TestClientLaneDeath(t *testing.T) {
	s, c := pair(t, TransportTCP, []ServerOption{WithLanes(3)}, []DialOption{WithLanes(3)})
	publishBytes(t, s, "k", 1<<20, 1)
	first := c.SessionID()
	c.last.lanes[1].Fail(errors.New("test: lane 1 broke"))
	expectNewSession(t, c, first, "k")
}
