package engine

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Calls that arrived as frames run each in its own goroutine of the
// session (Session.Run), named by their client_ref so that a release of
// the ref cancels one; the session bounds how many run at once and how
// many refused ones wait to answer.

// Run runs call in its own goroutine of the session as the frame call
// named ref, arrived on l; cancel ends the call's context, and runs when
// the call returns, when the client releases ref (CancelCall; at once if
// it already has: a release on another lane overtook the request) or the
// session ends. call's refusal, when not nil, is the error it must answer
// with without doing its work: the session is draining (FinishCalls) or
// has MaxFrameCalls calls running. A refused call's answer may wait for a
// credit, so refusals under way are bounded too: a client that keeps
// sending requests without taking their answers has l failed, and call
// does not run; nor does it when the session has closed.
//
// The call is under way (FinishCalls waits for it, MaxFrameCalls counts
// it) until call returns, or, when call returns handedOver, until it runs
// over, which it handed to the Send of its answer (Link.PostFrame), so
// that a graceful stop ends the session only after the answers left.
//
// mode says where call runs: RunGoroutine as above; RunInline in the
// calling goroutine (a handler registered to run where frames are read),
// and call must then never wait for what the link's completions bring;
// RunRescued in the calling goroutine too, where it can be (Link.runHere)
// and otherwise in its own, and call may wait: if it takes long, the
// link's receiving moves on to a new goroutine and leaves it behind.
// pace, when not nil, hears how a RunRescued call run where its frame was
// read went. RunLater registers the call and returns start, which the
// caller must call exactly once, when the call is to run: with here, as
// RunRescued; without, in a goroutine of its own (start is nil when the
// session has closed: call never runs).
func (s *Session) Run(l *Link, ref uint64, cancel context.CancelFunc, mode RunMode, pace Pacer, call func(refusal error, over func()) (handedOver bool)) (start func(here bool)) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		cancel()
		return nil
	}
	// A call of its own, so that the call's end unregisters only itself,
	// not a later call of the same ref.
	fc := &frameCall{cancel: cancel}
	s.calls[ref] = fc
	if s.released[ref] {
		cancel()
	}
	var refusal error
	switch {
	case (s.draining || s.inFlight >= MaxFrameCalls) && s.refusing >= MaxFrameCalls:
		delete(s.calls, ref)
		s.mu.Unlock()
		cancel()
		l.Fail(status.Errorf(codes.ResourceExhausted, "tensorrpc: the client sent %d requests past the %d calls a session may have under way without taking their answers; the session is ended", MaxFrameCalls, MaxFrameCalls))
		return
	case s.draining:
		refusal = status.Error(codes.Unavailable, "tensorrpc: server stopping")
	case s.inFlight >= MaxFrameCalls:
		refusal = status.Errorf(codes.ResourceExhausted, "tensorrpc: %d calls of this session under way, the most a session may have", MaxFrameCalls)
	default:
		// Counted in running before draining could be set: FinishCalls
		// waits for it.
		s.running.Add(1)
		s.inFlight++
	}
	if refusal != nil {
		s.refusing++
	}
	s.handlers.Add(1)
	s.mu.Unlock()
	over := func() {
		s.mu.Lock()
		if refusal == nil {
			s.inFlight--
		} else {
			s.refusing--
		}
		s.mu.Unlock()
		if refusal == nil {
			s.running.Done()
		}
	}
	run := func() {
		defer s.handlers.Done()
		handedOver := false
		defer func() {
			if !handedOver {
				over()
			}
		}()
		defer func() {
			s.mu.Lock()
			if s.calls[ref] == fc {
				delete(s.calls, ref)
			}
			s.mu.Unlock()
			cancel()
		}()
		handedOver = call(refusal, over)
	}
	switch {
	case mode == RunLater:
		return func(here bool) {
			if !here || !l.runHere(run, pace) {
				go run()
			}
		}
	case mode == RunInline:
		run()
	case mode == RunRescued && l.runHere(run, pace):
	default:
		go run()
	}
	return nil
}

// RunMode is where Session.Run runs a call.
type RunMode uint8

const (
	RunGoroutine RunMode = iota // in a goroutine of its own
	RunInline                   // where its frame was read; it never waits
	RunRescued                  // where its frame was read, left behind if it takes long
	RunLater                    // registered now, run when the caller starts it (Run's start)
)

// frameCall is a call that arrived as a frame and is running.
type frameCall struct{ cancel context.CancelFunc }

// CancelCall cancels the running frame call named ref, if any.
func (s *Session) CancelCall(ref uint64) {
	s.mu.Lock()
	fc := s.calls[ref]
	s.mu.Unlock()
	if fc != nil {
		fc.cancel()
	}
}

// Running reports whether a frame call named ref is registered (for
// tests).
func (s *Session) Running(ref uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[ref] != nil
}

// Accepts reports whether a frame call named ref could be answered at
// once, in the polling goroutine: the session is open, not draining, and
// the client has not released ref.
func (s *Session) Accepts(ref uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.draining && !s.closed && !s.released[ref]
}

// FinishCalls refuses new frame calls and waits until those under way
// have answered, at most timeout or until ctx ends (a server's graceful
// stop: calls that arrived as frames finish as gRPC's GracefulStop lets
// unary calls finish).
func (s *Session) FinishCalls(ctx context.Context, timeout time.Duration) {
	s.mu.Lock()
	s.draining = true
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		s.running.Wait()
		close(done)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-ctx.Done():
	}
}
