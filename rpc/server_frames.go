package rpc

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// frameCall is a call that arrived as a frame and is running.
type frameCall struct{ cancel context.CancelFunc }

// cancelCall cancels the running frame call named ref, if any.
func (ss *serverSession) cancelCall(ref uint64) {
	ss.mu.Lock()
	fc := ss.calls[ref]
	ss.mu.Unlock()
	if fc != nil {
		fc.cancel()
	}
}

// serveFetchFrame runs a FETCH_REQ that arrived on the session's link l,
// in its own goroutine (the polling goroutine that calls it must never
// block): the same as the Fetch method, answered with a FETCH_RESP.
func (s *Server) serveFetchFrame(ss *serverSession, l *link, h frameHeader, key string) {
	ctx, cancel := context.WithCancel(ss.ctx)
	fc := &frameCall{cancel: cancel}
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		cancel()
		return
	}
	ss.calls[h.ref] = fc
	ss.handlers.Add(1)
	ss.mu.Unlock()
	go func() {
		defer ss.handlers.Done()
		defer func() {
			ss.mu.Lock()
			if ss.calls[h.ref] == fc {
				delete(ss.calls, h.ref)
			}
			ss.mu.Unlock()
			cancel()
		}()
		resp, err := s.fetchForFrame(ctx, ss, l, h, key)
		var code uint32
		var msg string
		if err != nil {
			st := status.Convert(err)
			code, msg, resp = uint32(st.Code()), st.Message(), nil
			if room := l.fr.slotSize - frameHeaderLen - 8; len(msg) > room {
				msg = msg[:room]
			}
		}
		var flags uint16
		payload, err := appendFetchResp(make([]byte, 0, 256), code, msg, resp)
		if err != nil || frameHeaderLen+len(payload) > l.fr.slotSize {
			// The answer does not fit a slot (a long key or shape): the
			// client asks again with the Fetch method.
			if resp != nil && resp.TransferId != 0 {
				s.releaseTransfers(ss, []uint64{resp.TransferId})
				resp.TransferId = 0
			}
			payload, _ = appendFetchResp(payload[:0], 0, "", nil)
			flags = frameFallback
		}
		if err := l.sendFrame(ss.ctx, frameFetchResp, flags, h.ref, payload); err != nil && resp != nil && resp.TransferId != 0 {
			s.releaseTransfers(ss, []uint64{resp.TransferId})
		}
	}()
}

// fetchForFrame is the Fetch method's work for a FETCH_REQ that arrived
// on l.
func (s *Server) fetchForFrame(ctx context.Context, ss *serverSession, l *link, h frameHeader, key string) (*pb.FetchResponse, error) {
	// The session is open on l once open (Session) has set ss.link under
	// s.mu; a client that sends before it heard so is refused.
	s.mu.Lock()
	opened := ss.link == l
	s.mu.Unlock()
	if !opened {
		return nil, status.Error(codes.FailedPrecondition, "tensorrpc: a call before the session opened")
	}
	e, err := s.rv.fetch(ctx, key, false, h.flags&frameWait != 0)
	if err != nil {
		return nil, rendezvousError(key, err)
	}
	resp := &pb.FetchResponse{}
	resp.Meta, resp.InlineData, resp.TransferId, err = s.offer(ctx, ss, h.ref, key, e.tensor, e.buf, frameInline(s.opts.eagerThreshold))
	if err != nil {
		return nil, err
	}
	return resp, nil
}
