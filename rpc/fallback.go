package rpc

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/chunkcodec"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// The plain-gRPC fallback streams tensors as Chunk messages: a header, then
// the tensors' bytes back to back in chunks of streamChunkSize. Sending
// makes no copy of our own: the chunks view pool memory (chunkcodec), and
// gRPC's transport copies them into its frames. Receiving copies each chunk
// once, out of gRPC's receive buffers into the destination pool buffer.
//
// The chunkcodec codec is used per call, never installed as gRPC's "proto"
// codec: our client asks for it on each fallback stream
// (chunkcodec.CallOptions), and the server handlers wrap their stream with
// chunkcodec.ServerStream, which is the stream itself for our clients and
// translates to *pb.Chunk for clients with only the .proto (gRPC's proto
// codec then copies each chunk once on send, as it does for any Chunk).

// streamChunkSize is the payload of one data Chunk; well under gRPC's
// default 4 MiB message limit.
const streamChunkSize = 1 << 20

// msgSender and msgReceiver are the halves of gRPC streams we use.
type msgSender interface{ SendMsg(m any) error }
type msgReceiver interface{ RecvMsg(m any) error }

// sendChunks sends header, then the bytes of bufs back to back. The chunks
// hold their own references to bufs until gRPC has written them; the
// caller keeps its references. With refs, the references are also counted
// there, so that the stream's owner can take back those gRPC never frees
// (see chunkRefs.settle).
func sendChunks(s msgSender, header *pb.ChunkHeader, bufs []*mempool.Buffer, c *counters, refs *chunkRefs) error {
	if err := s.SendMsg(&chunkcodec.OutChunk{Header: header}); err != nil {
		return err
	}
	for _, buf := range bufs {
		b := buf.Bytes()
		for off := 0; off < len(b); off += streamChunkSize {
			piece := b[off:min(off+streamChunkSize, len(b))]
			buf.Retain()
			release := func() { buf.Release() }
			if refs != nil {
				release = refs.add(buf)
			}
			out := &chunkcodec.OutChunk{Data: mem.BufferSlice{chunkcodec.Wrap(piece, release)}}
			err := s.SendMsg(out)
			out.Free()
			if err != nil {
				return err
			}
			c.streamBytes.Add(int64(len(piece)))
		}
	}
	return nil
}

// recvHeader receives the header chunk of a stream.
func recvHeader(r msgReceiver) (*pb.ChunkHeader, error) {
	var in chunkcodec.InChunk
	if err := r.RecvMsg(&in); err != nil {
		return nil, err
	}
	defer in.Free()
	if in.Header == nil || in.Len() != 0 {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: a stream starts with a header chunk and no data")
	}
	return in.Header, nil
}

// recvTensors receives the bytes of the tensors metas describes into new
// pool tensors. A chunk may span tensors. On error every tensor made so far
// is released.
func recvTensors(ctx context.Context, r msgReceiver, pool *mempool.Pool, metas []*pb.TensorMeta, limit int64, c *counters) (_ []*Tensor, err error) {
	out := make([]*Tensor, 0, len(metas))
	defer func() {
		if err != nil {
			for _, t := range out {
				t.Release()
			}
		}
	}()
	for _, m := range metas {
		if err := checkMeta(m, limit); err != nil {
			return nil, err
		}
		if m.Location != nil {
			return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: streamed tensor %q has a location", m.Key)
		}
	}
	var in chunkcodec.InChunk
	defer in.Free()
	pending := mem.BufferSlice(nil) // bytes received but not yet placed
	for _, m := range metas {
		buf, err := allocBuffer(ctx, pool, int(m.ByteLength))
		if err != nil {
			return nil, err
		}
		dtype, shape := shapeOf(m)
		t, err := newPoolTensor(dtype, shape, buf)
		if err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		out = append(out, t)
		dst := buf.Bytes()
		for len(dst) > 0 {
			if pending.Len() == 0 {
				in.Free()
				if err := r.RecvMsg(&in); err != nil {
					if errors.Is(err, io.EOF) {
						return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: stream ended %d bytes short", len(dst))
					}
					return nil, err
				}
				if in.Header != nil {
					return nil, status.Error(codes.InvalidArgument, "tensorrpc: a second header chunk in a stream")
				}
				pending = in.Data
				c.streamBytes.Add(int64(pending.Len()))
			}
			dst = dst[copyFrom(dst, &pending):]
		}
		if err := verifySum(m, buf.Bytes()); err != nil {
			return nil, err
		}
		if m.ByteLength > 0 {
			c.copied(int(m.ByteLength)) // out of gRPC's receive buffers, chunk by chunk
		}
		c.transfers.Add(1)
	}
	if pending.Len() != 0 {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: %d bytes past the last tensor", pending.Len())
	}
	return out, nil
}

// copyFrom copies from the front of *src into dst and drops what it
// copied from *src (which views buffers that InChunk.Free releases).
func copyFrom(dst []byte, src *mem.BufferSlice) int {
	n := 0
	for n < len(dst) && len(*src) > 0 {
		b := (*src)[0].ReadOnlyData()
		k := copy(dst[n:], b)
		n += k
		if k == len(b) {
			*src = (*src)[1:]
		} else {
			(*src)[0] = mem.SliceBuffer(b[k:])
		}
	}
	return n
}

// expectEnd checks that the peer sent nothing more.
func expectEnd(r msgReceiver) error {
	var in chunkcodec.InChunk
	err := r.RecvMsg(&in)
	in.Free()
	if err == nil {
		return status.Error(codes.InvalidArgument, "tensorrpc: data past the end of the stream")
	}
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// recvRequest receives a client stream's tensors and then its end: bytes
// past the last tensor, in a further Chunk too, fail InvalidArgument.
func (s *Server) recvRequest(ctx context.Context, r msgReceiver, metas []*pb.TensorMeta, c *counters) ([]*Tensor, error) {
	ts, err := recvTensors(ctx, r, s.pool, metas, s.opts.maxTensorBytes, c)
	if err != nil {
		return nil, err
	}
	if err := expectEnd(r); err != nil {
		for _, t := range ts {
			t.Release()
		}
		return nil, err
	}
	return ts, nil
}

// FetchStream implements the FetchStream method.
func (s service) FetchStream(req *pb.FetchRequest, stream grpc.ServerStreamingServer[pb.Chunk]) error {
	s.streams.Add(1)
	defer s.streams.Done()
	ctx := stream.Context()
	ss, err := s.session(ctx, req.SessionId)
	if err != nil {
		return err
	}
	peer, done, err := s.admitStream(ctx)
	if err != nil {
		return err
	}
	defer done()
	return s.intercept(ctx, ss, OpFetch, req.Key, PathStream, 0, func(ctx context.Context, info *CallInfo) error {
		return s.fetchStream(ctx, ss, peer, req, stream, info)
	})
}

func (s *Server) fetchStream(ctx context.Context, ss *serverSession, peer string, req *pb.FetchRequest, stream grpc.ServerStreamingServer[pb.Chunk], info *CallInfo) error {
	e, err := s.rv.Fetch(ctx, req.Key, false, req.Wait)
	if err != nil {
		return rendezvousError(req.Key, err)
	}
	defer e.Buf.Release()
	// An unread reply holds gRPC's buffers (and the tensor) until sent.
	refund, err := s.chargeBytes(peer, int64(len(e.Tensor.Bytes())))
	if err != nil {
		return err
	}
	defer refund()
	var c counters
	defer s.count(ss, func(sc *counters) { sc.merge(&c) })
	c.transfers.Add(1)
	info.ResponseBytes = int64(len(e.Tensor.Bytes()))
	refs := newChunkRefs()
	defer refs.settle(ctx)
	return sendChunks(chunkcodec.ServerStream(stream), &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf(req.Key, e.Tensor, s.opts.checksums)}}, []*mempool.Buffer{e.Buf}, &c, refs)
}

// SendStream implements the SendStream method.
func (s service) SendStream(stream grpc.ClientStreamingServer[pb.Chunk, pb.SendResponse]) error {
	s.streams.Add(1)
	defer s.streams.Done()
	ctx := stream.Context()
	peer, cs, h, done, err := s.openStream(stream)
	if err != nil {
		return err
	}
	defer done()
	if len(h.Tensors) != 1 {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: SendStream carries one tensor, header has %d", len(h.Tensors))
	}
	return s.intercept(ctx, nil, OpSend, h.Tensors[0].GetKey(), PathStream, metaBytes(h.Tensors), func(ctx context.Context, _ *CallInfo) error {
		return s.sendStream(ctx, peer, h, cs, stream)
	})
}

// openStream admits a client stream (SendStream, CallStream) of the
// caller's peer and reads its header; done ends the admission.
func (s *Server) openStream(stream grpc.ServerStream) (peer string, cs grpc.ServerStream, h *pb.ChunkHeader, done func(), err error) {
	peer, done, err = s.admitStream(stream.Context())
	if err != nil {
		return "", nil, nil, nil, err
	}
	cs = chunkcodec.ServerStream(stream) // OutChunk/InChunk whatever the client's codec
	if h, err = recvHeader(cs); err != nil {
		done()
		return "", nil, nil, nil, err
	}
	return peer, cs, h, done, nil
}

// receiveStream receives a client stream's tensors, charged to peer's
// stream budget until refund, counted in c.
func (s *Server) receiveStream(ctx context.Context, peer string, h *pb.ChunkHeader, cs msgReceiver, c *counters) (ts []*Tensor, refund func(), err error) {
	if refund, err = s.chargeStream(peer, h.Tensors); err != nil {
		return nil, nil, err
	}
	ts, err = s.receiveIdle(cs, func(r msgReceiver) ([]*Tensor, error) {
		return s.recvRequest(ctx, r, h.Tensors, c)
	})
	if err != nil {
		refund()
		return nil, nil, err
	}
	return ts, refund, nil
}

func (s *Server) sendStream(ctx context.Context, peer string, h *pb.ChunkHeader, cs msgReceiver, stream grpc.ClientStreamingServer[pb.Chunk, pb.SendResponse]) error {
	var c counters
	defer s.count(nil, func(sc *counters) { sc.merge(&c) })
	ts, refund, err := s.receiveStream(ctx, peer, h, cs, &c)
	if err != nil {
		return err
	}
	defer refund()
	t := ts[0]
	if err := s.publish(h.Tensors[0].Key, t.DType(), t.Shape(), t.buf, 0); err != nil {
		return err
	}
	return stream.SendAndClose(&pb.SendResponse{})
}

// CallStream implements the CallStream method.
func (s service) CallStream(stream grpc.BidiStreamingServer[pb.Chunk, pb.Chunk]) error {
	s.streams.Add(1)
	defer s.streams.Done()
	ctx := stream.Context()
	peer, cs, h, done, err := s.openStream(stream)
	if err != nil {
		return err
	}
	defer done()
	return s.intercept(ctx, nil, OpCall, h.Method, PathStream, metaBytes(h.Tensors), func(ctx context.Context, info *CallInfo) error {
		return s.callStream(ctx, peer, h, cs, info)
	})
}

func (s *Server) callStream(ctx context.Context, peer string, h *pb.ChunkHeader, cs grpc.ServerStream, info *CallInfo) error {
	handler, err := s.handler(h.Method)
	if err != nil {
		return err
	}
	var c counters
	defer s.count(nil, func(sc *counters) { sc.merge(&c) })
	ts, refund, err := s.receiveStream(ctx, peer, h, cs, &c)
	if err != nil {
		return err
	}
	defer refund()
	in := &Message{Metadata: h.Metadata, Tensors: ts}
	defer in.Release()
	out, err := s.invoke(ctx, nil, handler, in)
	if err != nil {
		return err
	}
	defer out.Release()
	bufs, metas, err := poolBuffers(ctx, s.pool, out.Tensors, &c, s.opts.checksums)
	if err != nil {
		return status.Errorf(codes.Internal, "tensorrpc: reply: %v", err)
	}
	defer releaseAll(bufs)
	info.ResponseBytes = metaBytes(metas)
	refundReply, err := s.chargeBytes(peer, info.ResponseBytes)
	if err != nil {
		return err
	}
	defer refundReply()
	refs := newChunkRefs()
	defer refs.settle(ctx)
	return sendChunks(cs, &pb.ChunkHeader{Metadata: out.Metadata, Tensors: metas}, bufs, &c, refs)
}

// poolBuffers returns pool buffer references and descriptions for ts.
func poolBuffers(ctx context.Context, pool *mempool.Pool, ts []*Tensor, c *counters, sum bool) ([]*mempool.Buffer, []*pb.TensorMeta, error) {
	var bufs []*mempool.Buffer
	var metas []*pb.TensorMeta
	for i, t := range ts {
		buf, err := poolBuffer(ctx, pool, t, c)
		if err != nil {
			releaseAll(bufs)
			st := status.Convert(err) // keep the code: a limit stays ResourceExhausted, a deadline DeadlineExceeded
			return nil, nil, status.Errorf(st.Code(), "tensor %d: %s", i, st.Message())
		}
		bufs = append(bufs, buf)
		metas = append(metas, metaOf("", t.Tensor, sum))
	}
	return bufs, metas, nil
}

func releaseAll(bufs []*mempool.Buffer) {
	for _, b := range bufs {
		b.Release()
	}
}

// fetchStream is Fetch over the fallback.
func (c *Client) fetchStream(ctx context.Context, s *clientSession, key string, wait bool) (*Tensor, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.FetchStream(ctx, &pb.FetchRequest{SessionId: s.id, Key: key, Wait: wait}, chunkcodec.CallOptions()...)
	if err != nil {
		return nil, err
	}
	h, err := recvHeader(stream)
	if err != nil {
		return nil, err
	}
	if len(h.Tensors) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: FetchStream carries one tensor, header has %d", len(h.Tensors))
	}
	ts, err := recvTensors(ctx, stream, c.pool, h.Tensors, c.opts.maxTensorBytes, &c.stats)
	if err != nil {
		c.stats.errors.Add(1)
		return nil, err
	}
	if err := expectEnd(stream); err != nil {
		ts[0].Release()
		return nil, err
	}
	return ts[0], nil
}

// sendStream is Send over the fallback.
func (c *Client) sendStream(ctx context.Context, key string, t *Tensor) error {
	bufs, _, err := poolBuffers(ctx, c.pool, []*Tensor{t}, &c.stats, c.opts.checksums)
	if err != nil {
		return err
	}
	defer releaseAll(bufs)
	ctx, cancel := context.WithCancel(ctx)
	refs := newChunkRefs()
	defer refs.settle(ctx) // after cancel: takes back what a dead connection never freed
	defer cancel()
	stream, err := c.api.SendStream(ctx, chunkcodec.CallOptions()...)
	if err != nil {
		return err
	}
	if err := sendChunks(stream, &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf(key, t.Tensor, c.opts.checksums)}}, bufs, &c.stats, refs); err != nil {
		if errors.Is(err, io.EOF) { // the server failed the call: its status is in CloseAndRecv
			_, err = stream.CloseAndRecv()
		}
		c.stats.errors.Add(1)
		return err
	}
	if _, err := stream.CloseAndRecv(); err != nil {
		c.stats.errors.Add(1)
		return err
	}
	c.stats.transfers.Add(1)
	return nil
}

// callStream is Call over the fallback.
func (c *Client) callStream(ctx context.Context, method string, req *Message) (*Message, error) {
	bufs, metas, err := poolBuffers(ctx, c.pool, req.Tensors, &c.stats, c.opts.checksums)
	if err != nil {
		return nil, err
	}
	defer releaseAll(bufs)
	ctx, cancel := context.WithCancel(ctx)
	refs := newChunkRefs()
	defer refs.settle(ctx) // after cancel: takes back what a dead connection never freed
	defer cancel()
	stream, err := c.api.CallStream(ctx, chunkcodec.CallOptions()...)
	if err != nil {
		return nil, err
	}
	chunkcodec.Commit(stream) // see chunkcodec.Commit: avoids a leaked chunk reference in grpc-go's retry buffer
	if err := sendChunks(stream, &pb.ChunkHeader{Method: method, Metadata: req.Metadata, Tensors: metas}, bufs, &c.stats, refs); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	if err := stream.CloseSend(); err != nil {
		return nil, err
	}
	h, err := recvHeader(stream)
	if err != nil {
		return nil, err
	}
	ts, err := recvTensors(ctx, stream, c.pool, h.Tensors, c.opts.maxTensorBytes, &c.stats)
	if err != nil {
		return nil, err
	}
	reply := &Message{Metadata: h.Metadata, Tensors: ts}
	if err := expectEnd(stream); err != nil {
		reply.Release()
		return nil, err
	}
	return reply, nil
}

// chunkRefs counts the buffer references a stream handed to gRPC inside
// zero-copy chunks. gRPC frees a chunk once it has written it; but when a
// connection is torn down with frames queued or half written, grpc-go
// frees only some of them, and the rest would pin pool memory for good.
// The stream's owner (a server handler, or a client call) therefore owns
// the references: settle waits for gRPC to free them and takes back those
// it never will.
type chunkRefs struct {
	mu    sync.Mutex
	live  map[*chunkRef]struct{}
	empty chan struct{} // closed when live becomes empty, replaced on add
}

type chunkRef struct {
	once sync.Once
	buf  *mempool.Buffer
}

// settleGrace is how long settle waits, once the stream is dead, for gRPC
// to finish a frame it may be writing before it takes the references back.
const settleGrace = 200 * time.Millisecond

func newChunkRefs() *chunkRefs {
	e := make(chan struct{})
	close(e)
	return &chunkRefs{live: map[*chunkRef]struct{}{}, empty: e}
}

// add counts one reference to buf and returns the function that drops it,
// once, whoever calls it first: gRPC or settle.
func (r *chunkRefs) add(buf *mempool.Buffer) func() {
	ref := &chunkRef{buf: buf}
	r.mu.Lock()
	if len(r.live) == 0 {
		r.empty = make(chan struct{})
	}
	r.live[ref] = struct{}{}
	r.mu.Unlock()
	return func() { r.drop(ref) }
}

func (r *chunkRefs) drop(ref *chunkRef) {
	ref.once.Do(func() {
		r.mu.Lock()
		delete(r.live, ref)
		if len(r.live) == 0 {
			close(r.empty)
		}
		r.mu.Unlock()
		ref.buf.Release()
	})
}

// settle returns once gRPC has freed every chunk (it has written them), or
// the stream is dead (ctx done) and a grace period has passed; then it
// drops the references gRPC still holds, since a dead stream's queued
// frames are never written.
func (r *chunkRefs) settle(ctx context.Context) {
	r.mu.Lock()
	empty := r.empty
	r.mu.Unlock()
	select {
	case <-empty:
		return
	case <-ctx.Done():
	}
	select {
	case <-empty:
		return
	case <-time.After(settleGrace):
	}
	r.mu.Lock()
	left := make([]*chunkRef, 0, len(r.live))
	for ref := range r.live {
		left = append(left, ref)
	}
	r.mu.Unlock()
	for _, ref := range left {
		r.drop(ref)
	}
}

// receiveIdle runs receive, which reads a client's stream through the
// receiver it is given, and fails the stream with DeadlineExceeded when
// it makes no progress (watchedReceiver) for WithStreamIdleTimeout: a
// client that declares a tensor and goes silent, or sends a byte at a
// time, holds its memory only that long. When it gives
// up, the handler returns; the stream's end then fails receive's pending
// read, and receive frees what it allocated (or, if it finished just then,
// its tensors are released here).
func (s *Server) receiveIdle(r msgReceiver, receive func(msgReceiver) ([]*Tensor, error)) ([]*Tensor, error) {
	if s.opts.streamIdle <= 0 {
		return receive(r)
	}
	type result struct {
		ts  []*Tensor
		err error
	}
	w := &watchedReceiver{r: r}
	w.last.Store(time.Now().UnixNano())
	done := make(chan result, 1)
	go func() {
		ts, err := receive(w)
		done <- result{ts, err}
	}()
	tick := time.NewTicker(max(s.opts.streamIdle/4, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case res := <-done:
			return res.ts, res.err
		case <-tick.C:
			if time.Since(time.Unix(0, w.last.Load())) > s.opts.streamIdle {
				go func() {
					for _, t := range (<-done).ts {
						t.Release()
					}
				}()
				return nil, status.Errorf(codes.DeadlineExceeded, "tensorrpc: the stream sent nothing for %v (the server's rpc.WithStreamIdleTimeout)", s.opts.streamIdle)
			}
		}
	}
}

// watchedReceiver records when the stream last made progress: when
// streamProgress bytes of data arrived since the time before, or the
// stream ended. Messages alone are no progress, so a client that sends a
// byte at a time within the idle timeout cannot hold its tensor's memory
// for ever.
type watchedReceiver struct {
	r        msgReceiver
	last     atomic.Int64
	received int // data bytes since last
}

// streamProgress is the data a stream must deliver within each
// WithStreamIdleTimeout: 64 KiB.
const streamProgress = 64 << 10

func (w *watchedReceiver) RecvMsg(m any) error {
	err := w.r.RecvMsg(m)
	if in, ok := m.(*chunkcodec.InChunk); ok && err == nil {
		w.received += in.Len()
	}
	if err != nil || w.received >= streamProgress {
		w.received = 0
		w.last.Store(time.Now().UnixNano())
	}
	return err
}
