// White-box: these tests read a session's links and frame counters to check what travels as frames.

package rpc

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
)

func publishBytes(t *testing.T, s *Server, key string, n int, seed byte) []byte {
	t.Helper()
	w := wrapped(t, n, seed)
	defer w.Release()
	if err := s.Publish(ctxT(t), key, w); err != nil {
		t.Fatal(err)
	}
	return append([]byte(nil), w.Bytes()...)
}

// TestFetchFramesWaitForKey: a frame Fetch waits for its key; a cancelled
// one frees everything (the pair's cleanup checks buffers and goroutines)
// and the server's waiting call ends.
func TestFetchFramesWaitForKey(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			if c.last.link.Frames == nil {
				t.Fatal("no frames")
			}
			ctx := ctxT(t)
			done := make(chan error, 1)
			want := wrapped(t, 100<<10, 7)
			defer want.Release()
			go func() {
				got, err := c.Fetch(ctx, "later", WaitForKey())
				if err == nil {
					if !bytes.Equal(got.Bytes(), want.Bytes()) {
						err = status.Error(codes.Internal, "wrong bytes")
					}
					got.Release()
				}
				done <- err
			}()
			time.Sleep(50 * time.Millisecond)
			publishBytes(t, s, "later", 100<<10, 7)
			if err := <-done; err != nil {
				t.Fatal(err)
			}

			// Cancelled while waiting.
			cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			if _, err := c.Fetch(cctx, "never", WaitForKey()); status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("cancelled wait: %v, want DeadlineExceeded", err)
			}
			ss := serverSessionOf(t, s)
			deadline := time.Now().Add(5 * time.Second)
			for {
				n := ss.Holding().Calls
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d frame calls still running on the server", n)
				}
				time.Sleep(5 * time.Millisecond)
			}
			// The server's call ends once its answer is posted; the
			// client forgets the pending fetch when the answer arrives.
			f := c.last.link.Frames
			for {
				f.Mu.Lock()
				n := len(f.Pending)
				f.Mu.Unlock()
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d pending frame fetches on the client", n)
				}
				time.Sleep(5 * time.Millisecond)
			}

			// The server stopping ends a waiting Fetch with Unavailable.
			go func() {
				_, err := c.Fetch(ctx, "never", WaitForKey())
				done <- err
			}()
			time.Sleep(50 * time.Millisecond)
			s.GracefulStop()
			if err := <-done; status.Code(err) != codes.Unavailable {
				t.Fatalf("fetch waiting through GracefulStop: %v, want Unavailable", err)
			}
		})
	}
}

func serverSessionOf(t *testing.T, s *Server) *serverSession {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ss := range s.sessions {
		return ss
	}
	t.Fatal("no session")
	return nil
}

// TestFramesHostile: a frame the peer breaks ends the session; nothing is
// leaked and the next call opens a new session.
func TestFramesHostile(t *testing.T) {
	bad := map[string][]byte{
		"short":          {wire.FrameMagic, wire.FrameFetchReq},
		"magic":          append([]byte{0x00}, make([]byte, wire.FrameHeaderLen-1)...),
		"length":         hdr(wire.FrameFetchReq, 0, 0, 1, 100, nil),
		"type":           hdr(99, 0, 0, 1, 0, nil),
		"credits":        hdr(wire.FrameCredit, 0, 1000, 0, 0, nil),
		"resp-to-server": hdr(wire.FrameFetchResp, 0, 0, 1, 8, make([]byte, 8)),
	}
	for _, tr := range []string{TransportTCP, TransportSHM} {
		for name, frame := range bad {
			t.Run(tr+"/"+name, func(t *testing.T) {
				s, c := pair(t, tr, nil, nil)
				publishBytes(t, s, "k", 1<<20, 3)
				l := c.last.link
				buf, err := l.CtlPool.Alloc(ctxT(t), len(frame))
				if err != nil {
					t.Fatal(err)
				}
				defer buf.Release()
				copy(buf.Bytes(), frame)
				local, _ := l.Domain.Ctl.Local(buf)
				local.Length = len(frame)
				l.Post(ctxT(t), verbs.SendRequest{Op: verbs.OpSend, Local: local}, nil) // may fail: the server ends the plane
				deadline := time.Now().Add(10 * time.Second)
				for !sessionGone(c) {
					if time.Now().After(deadline) {
						t.Fatal("the session survived a broken frame")
					}
					time.Sleep(10 * time.Millisecond)
				}
				got, err := c.Fetch(ctxT(t), "k")
				if err != nil {
					t.Fatalf("fetch on a new session: %v", err)
				}
				got.Release()
			})
		}
	}
}

// TestFetchFramesConcurrent runs more waiting Fetches than there are
// receive slots, then small and large Fetches and Sends side by side: the
// credits must keep every frame flowing without a receiver-not-ready.
func TestFetchFramesConcurrent(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			const waiters = 3 * engine.FrameSlots
			errs := make(chan error, 4*waiters)
			for range waiters {
				go func() {
					got, err := c.Fetch(ctx, "late", WaitForKey())
					if err == nil {
						got.Release()
					}
					errs <- err
				}()
			}
			time.Sleep(100 * time.Millisecond)
			publishBytes(t, s, "late", 1<<10, 1)
			publishBytes(t, s, "big", 256<<10, 2)
			for i := range waiters {
				go func() {
					key := "late"
					if i%2 == 0 {
						key = "big"
					}
					got, err := c.Fetch(ctx, key)
					if err == nil {
						got.Release()
					}
					errs <- err
				}()
				go func() {
					w := wrapped(t, 32<<10, byte(i))
					defer w.Release()
					errs <- c.Send(ctx, "sent", w)
				}()
			}
			for range 3 * waiters {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
			l := c.last.link
			l.Mu.Lock()
			failure := l.Failure
			l.Mu.Unlock()
			if failure != nil || sessionGone(c) {
				t.Fatalf("the session ended: %v", failure)
			}
		})
	}
}
