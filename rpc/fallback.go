package rpc

import (
	"context"
	"errors"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// The plain-gRPC fallback's chunk streams live in rpc/internal/fallback;
// what is here adapts them to the service methods and the client's calls
// (interceptors, admission, Tensor and Message).

// recvTensors receives the bytes of the tensors metas describes into new
// pool tensors (fallback.RecvBuffers). On error every tensor made so far
// is released.
//
// compressed is the stream header's (ChunkHeader.compressed); accept says
// whether this side takes compressed streams (its mode is not off, and
// for a client, its session agreed): one it did not ask for fails the
// stream with InvalidArgument.
func recvTensors(ctx context.Context, r fallback.MsgReceiver, pool *mempool.Pool, metas []*pb.TensorMeta, limit int64, c *counters, compressed, accept bool) ([]*Tensor, error) {
	if compressed && !accept {
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: a compressed stream to a side that does not take compression (WithCompression off, or not agreed in the session's handshake)")
	}
	bufs, err := fallback.RecvBuffers(ctx, r, metas, fallback.Receiver{
		Check:      func(m *pb.TensorMeta) error { return checkMeta(m, limit) },
		Alloc:      func(ctx context.Context, n int) (*mempool.Buffer, error) { return allocBuffer(ctx, pool, n) },
		Verify:     verifySum,
		Counters:   c,
		Compressed: compressed,
		Packed: func(codec zchunk.Codec, wire int64) {
			explainCompression(ctx, engine.ReadReport{Bytes: int(metaBytes(metas)), Wire: wire, Packed: verbs.CodecNamed(codec.String())})
		},
	})
	if err != nil {
		return nil, err
	}
	if n := metaBytes(metas); !compressed && accept && n >= engine.MinCompressed {
		explainCompression(ctx, engine.ReadReport{Bytes: int(n), Wire: n})
	}
	out := make([]*Tensor, 0, len(bufs))
	for i, buf := range bufs {
		dtype, shape := shapeOf(metas[i])
		t, err := newPoolTensor(dtype, shape, buf)
		if err != nil {
			for _, t := range out {
				t.Release()
			}
			releaseAll(bufs[i+1:])
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		out = append(out, t)
	}
	return out, nil
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
		e, err := s.fetch(ctx, req.Key, req.Wait)
		if err != nil {
			return err
		}
		if req.Rows != nil {
			if e, err = s.gatherRows(ctx, ss, req.Key, e, req.Rows); err != nil {
				return err
			}
		}
		defer e.Buf.Release()
		// An unread reply holds gRPC's buffers (and the tensor) until sent.
		n := int64(len(e.Tensor.Bytes()))
		refund, err := s.chargeBytes(peer, n)
		if err != nil {
			return err
		}
		defer refund()
		var c counters
		defer s.count(ss, func(sc *counters) { sc.merge(&c) })
		c.transfers.Add(1)
		info.setResponse(n)
		bufs := []*mempool.Buffer{e.Buf}
		var z *engine.Compression
		if ss != nil {
			z = ss.streamZ
		}
		ctx, err = serverCodec(ctx)
		if err != nil {
			return err
		}
		codec := streamCodec(ctx, z, bufs)
		return sendMeasured(z, bufs, codec, &c, func() error {
			return sendChunks(ctx, chunkcodec.ServerStream(stream), &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf(req.Key, e.Tensor, s.opts.checksums)}}, bufs, &c, codec)
		})
	})
}

// sendChunks sends header and the tensors in bufs down a stream
// (fallback.SendChunks), and takes back what the stream still holds of
// them before it returns.
func sendChunks(ctx context.Context, out fallback.MsgSender, header *pb.ChunkHeader, bufs []*mempool.Buffer, c *counters, codec zchunk.Codec) error {
	refs := fallback.NewChunkRefs()
	defer refs.Settle(ctx)
	return fallback.SendChunks(out, header, bufs, c, refs, codec)
}

// SendStream implements the SendStream method.
func (s service) SendStream(stream grpc.ClientStreamingServer[pb.Chunk, pb.SendResponse]) error {
	return s.clientStream(stream, OpSend, func(h *pb.ChunkHeader) (string, error) {
		if len(h.Tensors) != 1 {
			return "", status.Errorf(codes.InvalidArgument, "tensorrpc: SendStream carries one tensor, header has %d", len(h.Tensors))
		}
		return h.Tensors[0].GetKey(), nil
	}, func(ctx context.Context, in *streamRequest, _ *CallInfo) error {
		ts, err := in.receive(ctx)
		if err != nil {
			return err
		}
		if rows := in.header.Rows; rows != nil {
			err := s.writeRows(ctx, nil, nil, &pb.SendRequest{Meta: in.header.Tensors[0], Rows: rows, InlineData: ts[0].Bytes()})
			ts[0].Release()
			if err != nil {
				return err
			}
			return stream.SendAndClose(&pb.SendResponse{})
		}
		if err := s.send(in.header.Tensors[0].Key, ts[0], 0); err != nil {
			return err
		}
		return stream.SendAndClose(&pb.SendResponse{})
	})
}

// CallStream implements the CallStream method.
func (s service) CallStream(stream grpc.BidiStreamingServer[pb.Chunk, pb.Chunk]) error {
	return s.clientStream(stream, OpCall, func(h *pb.ChunkHeader) (string, error) { return h.Method, nil }, func(ctx context.Context, in *streamRequest, info *CallInfo) error {
		return s.call(ctx, nil, in.header.Method, in.header.Metadata, in.header.Tensors, in.receive, func(out *Message) error {
			bufs, metas, err := poolBuffers(ctx, s.pool, out.Tensors, &in.counters, s.opts.checksums)
			if err != nil {
				return status.Errorf(codes.Internal, "tensorrpc: reply: %v", err)
			}
			defer releaseAll(bufs)
			replyBytes := metaBytes(metas)
			info.setResponse(replyBytes)
			refund, err := s.chargeBytes(in.peer, replyBytes)
			if err != nil {
				return err
			}
			defer refund()
			// Replies go as they are: a client stream names no session
			// whose handshake agreed on compression.
			return sendChunks(ctx, in.stream, &pb.ChunkHeader{Metadata: out.Metadata, Tensors: metas}, bufs, &in.counters, zchunk.Stored)
		})
	})
}

// streamRequest is a client stream (SendStream, CallStream) whose header
// has come: receive takes in its tensors.
type streamRequest struct {
	s        *Server
	peer     string
	stream   grpc.ServerStream // OutChunk/InChunk whatever the client's codec
	header   *pb.ChunkHeader
	counters counters // what the stream moved, merged into the server's totals at its end
	refund   func()   // gives back the stream bytes of the received tensors
}

// clientStream serves a client stream: it admits it, reads its header,
// and runs serve under the interceptors, which see op and what name says
// of the header (name's error fails the stream first).
func (s *Server) clientStream(stream grpc.ServerStream, op Operation, name func(*pb.ChunkHeader) (string, error), serve func(context.Context, *streamRequest, *CallInfo) error) error {
	s.streams.Add(1)
	defer s.streams.Done()
	ctx := stream.Context()
	peer, done, err := s.admitStream(ctx)
	if err != nil {
		return err
	}
	defer done()
	in := &streamRequest{s: s, peer: peer, stream: chunkcodec.ServerStream(stream), refund: func() {}}
	if in.header, err = fallback.RecvHeader(in.stream); err != nil {
		return err
	}
	key, err := name(in.header)
	if err != nil {
		return err
	}
	return s.intercept(ctx, nil, op, key, PathStream, metaBytes(in.header.Tensors), func(ctx context.Context, info *CallInfo) error {
		defer s.count(nil, func(sc *counters) { sc.merge(&in.counters) })
		defer func() { in.refund() }()
		return serve(ctx, in, info)
	})
}

// receive takes in the stream's tensors, charged to its peer's stream
// byte budget until the stream ends, then its end: bytes past the last
// tensor, in a further Chunk too, fail InvalidArgument.
func (in *streamRequest) receive(ctx context.Context) ([]*Tensor, error) {
	s := in.s
	refund, err := s.chargeStream(in.peer, in.header.Tensors)
	if err != nil {
		return nil, err
	}
	ts, err := s.receiveIdle(in.stream, func(r fallback.MsgReceiver) ([]*Tensor, error) {
		mode, _ := s.opts.compressionMode()
		ts, err := recvTensors(ctx, r, s.pool, in.header.Tensors, s.opts.maxTensorBytes, &in.counters, in.header.Compressed, mode != verbs.CodecNone)
		if err != nil {
			return nil, err
		}
		if err := fallback.ExpectEnd(r); err != nil {
			for _, t := range ts {
				t.Release()
			}
			return nil, err
		}
		return ts, nil
	})
	if err != nil {
		refund()
		return nil, err
	}
	in.refund = refund
	return ts, nil
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
// streamLost says in tensorrpc's words that a gRPC fallback stream failed
// because the connection to the server was lost (gRPC's own Unavailable,
// such as "error reading from server: EOF" after the server stopped).
func streamLost(err error) error {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable || strings.HasPrefix(st.Message(), "tensorrpc:") {
		return err
	}
	return status.Errorf(codes.Unavailable, "tensorrpc: connection to the server lost (it stopped, restarted or failed): %s", st.Message())
}

func (c *Client) fetchStream(ctx context.Context, s *clientSession, key string, fo fetchOptions) (_ *Tensor, err error) {
	defer func() { err = streamLost(err) }()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.FetchStream(withAddedMetadata(ctx), &pb.FetchRequest{SessionId: s.id, Key: key, Wait: fo.wait, Rows: fo.rows}, chunkcodec.CallOptions()...)
	if err != nil {
		return nil, err
	}
	h, err := fallback.RecvHeader(stream)
	if err != nil {
		return nil, err
	}
	if len(h.Tensors) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: FetchStream carries one tensor, header has %d", len(h.Tensors))
	}
	if fo.rows != nil {
		if err := checkRowsAnswer(h.Tensors[0], len(fo.rows)); err != nil {
			return nil, err
		}
	}
	if fo.into != nil {
		if err := matchInto(h.Tensors[0], fo.into); err != nil {
			return nil, err
		}
	}
	ts, err := recvTensors(ctx, stream, c.pool, h.Tensors, c.opts.maxTensorBytes, &c.stats, h.Compressed, s.streamZ != nil)
	if err != nil {
		c.stats.errors.Add(1)
		return nil, err
	}
	if err := fallback.ExpectEnd(stream); err != nil {
		ts[0].Release()
		return nil, err
	}
	// The chunks were copied out of gRPC's buffers into the pool.
	if fo.into != nil {
		n := memcopy.Copy(fo.into.Bytes(), ts[0].Bytes())
		ts[0].Release()
		if n > 0 {
			c.stats.copied(n)
		}
		explain(ctx, MovedStream, 0, 2)
		return fo.into, nil
	}
	explain(ctx, MovedStream, 0, 1)
	return ts[0], nil
}

// chunksOut is what a client stream of the fallback (SendStream,
// CallStream) sends: its tensors' pool buffers and descriptions, and the
// references to the chunks gRPC holds of them.
type chunksOut struct {
	bufs  []*mempool.Buffer
	metas []*pb.TensorMeta
	refs  *fallback.ChunkRefs
}

// chunksOut readies ts to be sent down a stream made under the returned
// child of ctx. done cancels that context, then takes back what a dead
// connection never freed of the chunks and releases the buffers.
func (c *Client) chunksOut(ctx context.Context, ts []*Tensor) (_ context.Context, _ *chunksOut, done func(), _ error) {
	bufs, metas, err := poolBuffers(ctx, c.pool, ts, &c.stats, c.opts.checksums)
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	out := &chunksOut{bufs: bufs, metas: metas, refs: fallback.NewChunkRefs()}
	return ctx, out, func() {
		cancel()
		out.refs.Settle(ctx)
		releaseAll(bufs)
	}, nil
}

// sendStream is Send over the fallback.
func (c *Client) sendStream(ctx context.Context, s *clientSession, key string, t *Tensor, rows []int64) (err error) {
	defer func() { err = streamLost(err) }()
	ctx, out, done, err := c.chunksOut(ctx, []*Tensor{t})
	if err != nil {
		return err
	}
	defer done()
	stream, err := c.api.SendStream(withAddedMetadata(ctx), chunkcodec.CallOptions()...)
	if err != nil {
		return err
	}
	codec := streamCodec(ctx, s.streamZ, out.bufs)
	if err := sendMeasured(s.streamZ, out.bufs, codec, &c.stats, func() error {
		return fallback.SendChunks(stream, &pb.ChunkHeader{Tensors: []*pb.TensorMeta{metaOf(key, t.Tensor, c.opts.checksums)}, Rows: rows}, out.bufs, &c.stats, out.refs, codec)
	}); err != nil {
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
	copies := 0
	if !c.ownPoolMemory(t) {
		copies = 1 // into the pool, which the chunks point into
	}
	explain(ctx, MovedStream, 0, copies)
	return nil
}

// callStream is Call over the fallback.
func (c *Client) callStream(ctx context.Context, s *clientSession, method string, req *Message) (_ *Message, err error) {
	defer func() { err = streamLost(err) }()
	ctx, out, done, err := c.chunksOut(ctx, req.Tensors)
	if err != nil {
		return nil, err
	}
	defer done()
	stream, err := c.api.CallStream(withAddedMetadata(ctx), chunkcodec.CallOptions()...)
	if err != nil {
		return nil, err
	}
	chunkcodec.Commit(stream) // see chunkcodec.Commit: avoids a leaked chunk reference in grpc-go's retry buffer
	codec := streamCodec(ctx, s.streamZ, out.bufs)
	if err := sendMeasured(s.streamZ, out.bufs, codec, &c.stats, func() error {
		return fallback.SendChunks(stream, &pb.ChunkHeader{Method: method, Metadata: req.Metadata, Tensors: out.metas}, out.bufs, &c.stats, out.refs, codec)
	}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	if err := stream.CloseSend(); err != nil {
		return nil, err
	}
	h, err := fallback.RecvHeader(stream)
	if err != nil {
		return nil, err
	}
	ts, err := recvTensors(ctx, stream, c.pool, h.Tensors, c.opts.maxTensorBytes, &c.stats, h.Compressed, false)
	if err != nil {
		return nil, err
	}
	reply := &Message{Metadata: h.Metadata, Tensors: ts}
	if err := fallback.ExpectEnd(stream); err != nil {
		reply.Release()
		return nil, err
	}
	return reply, nil
}

// receiveIdle runs receive under the server's WithStreamIdleTimeout
// (fallback.ReceiveIdle); tensors of a receive that finished after the
// stream was given up are released.
func (s *Server) receiveIdle(r fallback.MsgReceiver, receive func(fallback.MsgReceiver) ([]*Tensor, error)) ([]*Tensor, error) {
	return fallback.ReceiveIdle(r, s.opts.streamIdle, receive, func(ts []*Tensor) {
		for _, t := range ts {
			t.Release()
		}
	})
}
