// Package fallback is the plain-gRPC path for peers that share no data
// plane: it streams tensors as tensorrpc.v1.Chunk messages, a header, then
// the tensors' bytes back to back in chunks of ChunkSize. Sending makes no
// copy of our own: the chunks view pool memory (package chunkcodec), and
// gRPC's transport copies them into its frames. Receiving copies each chunk
// once, out of gRPC's receive buffers into the destination pool buffer.
//
// It holds the chunk machinery (SendChunks, RecvHeader, RecvBuffers,
// ExpectEnd), the accounting of the buffer references handed to gRPC
// (ChunkRefs) and the server's idle watch on a client's stream
// (ReceiveIdle). It deals in pool buffers and tensor descriptions, never in
// rpc.Tensor; the gRPC service methods, interceptors and admission stay in
// rpc, which calls into it.
//
// The chunkcodec codec is used per call, never installed as gRPC's "proto"
// codec: rpc's client asks for it on each fallback stream
// (chunkcodec.CallOptions), and the server handlers wrap their stream with
// chunkcodec.ServerStream, which is the stream itself for our clients and
// translates to *pb.Chunk for clients with only the .proto (gRPC's proto
// codec then copies each chunk once on send, as it does for any Chunk).
package fallback

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
)

// ChunkSize is the payload of one data Chunk; well under gRPC's default
// 4 MiB message limit.
const ChunkSize = 1 << 20

// MsgSender and MsgReceiver are the halves of gRPC streams we use.
type MsgSender interface{ SendMsg(m any) error }
type MsgReceiver interface{ RecvMsg(m any) error }

// Counters are the statistics a stream adds to.
type Counters interface {
	// AddStreamBytes counts n bytes of tensor data sent or received in
	// chunks.
	AddStreamBytes(n int64)
	// AddCopied counts one copy of n bytes.
	AddCopied(n int)
	// AddTransfer counts one tensor received.
	AddTransfer()
	// AddCompressed counts the tensors of a compressed stream: raw bytes
	// that crossed as wire bytes.
	AddCompressed(raw, wire int64)
}

// SendChunks sends header, then the bytes of bufs back to back. The chunks
// hold their own references to bufs until gRPC has written them; the
// caller keeps its references. With refs, the references are also counted
// there, so that the stream's owner can take back those gRPC never frees
// (see ChunkRefs.Settle).
//
// With codec other than zchunk.Stored the header says compressed and each
// data chunk is one zchunk chunk of at most ChunkSize raw bytes of one
// tensor, made here (so no reference to bufs goes to gRPC).
func SendChunks(s MsgSender, header *pb.ChunkHeader, bufs []*mempool.Buffer, c Counters, refs *ChunkRefs, codec zchunk.Codec) error {
	header.Compressed = codec != zchunk.Stored
	if err := s.SendMsg(&chunkcodec.OutChunk{Header: header}); err != nil {
		return err
	}
	if header.Compressed {
		return sendPacked(s, bufs, c, codec)
	}
	for _, buf := range bufs {
		b := buf.Bytes()
		for off := 0; off < len(b); off += ChunkSize {
			piece := b[off:min(off+ChunkSize, len(b))]
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
			c.AddStreamBytes(int64(len(piece)))
		}
	}
	return nil
}

// sendPacked sends bufs as zchunk chunks compressed with codec.
func sendPacked(s MsgSender, bufs []*mempool.Buffer, c Counters, codec zchunk.Codec) error {
	for _, buf := range bufs {
		b := buf.Bytes()
		for off := 0; off < len(b); off += ChunkSize {
			z := zchunk.AppendChunk(nil, codec, b[off:min(off+ChunkSize, len(b))])
			out := &chunkcodec.OutChunk{Data: mem.BufferSlice{chunkcodec.Wrap(z, func() {})}}
			err := s.SendMsg(out)
			out.Free()
			if err != nil {
				return err
			}
			c.AddStreamBytes(int64(len(z)))
		}
	}
	return nil
}

// RecvHeader receives the header chunk of a stream.
func RecvHeader(r MsgReceiver) (*pb.ChunkHeader, error) {
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

// Receiver says where RecvBuffers puts tensors and how it checks them.
type Receiver struct {
	// Check validates a tensor description from the peer (its dtype,
	// shape, length and size limit) before anything is received.
	Check func(m *pb.TensorMeta) error
	// Alloc returns a pool buffer of n bytes for a tensor.
	Alloc func(ctx context.Context, n int) (*mempool.Buffer, error)
	// Verify checks a received tensor's bytes against its description
	// (its checksum).
	Verify func(m *pb.TensorMeta, b []byte) error
	// Counters counts the bytes, copies and tensors received.
	Counters Counters
	// Compressed says the stream's header did (ChunkHeader.compressed):
	// each data chunk is one zchunk chunk of one tensor. Packed, when not
	// nil, is told what a compressed stream came as: the codec of its
	// first chunk that was not stored (zchunk.Stored if none) and the
	// bytes it took.
	Compressed bool
	Packed     func(codec zchunk.Codec, wire int64)
}

// RecvBuffers receives the bytes of the tensors metas describes into new
// pool buffers, one per tensor. A chunk may span tensors. On error every
// buffer allocated so far is released.
func RecvBuffers(ctx context.Context, r MsgReceiver, metas []*pb.TensorMeta, rc Receiver) (_ []*mempool.Buffer, err error) {
	out := make([]*mempool.Buffer, 0, len(metas))
	defer func() {
		if err != nil {
			for _, b := range out {
				b.Release()
			}
		}
	}()
	for _, m := range metas {
		if err := rc.Check(m); err != nil {
			return nil, err
		}
		if m.Location != nil {
			return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: streamed tensor %q has a location", m.Key)
		}
	}
	var in chunkcodec.InChunk
	defer in.Free()
	if rc.Compressed {
		if out, err = recvPacked(ctx, r, metas, rc, out, &in); err != nil {
			return nil, err
		}
		return out, nil
	}
	pending := mem.BufferSlice(nil) // bytes received but not yet placed
	for _, m := range metas {
		buf, err := rc.Alloc(ctx, int(m.ByteLength))
		if err != nil {
			return nil, err
		}
		out = append(out, buf)
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
				rc.Counters.AddStreamBytes(int64(pending.Len()))
			}
			dst = dst[copyFrom(dst, &pending):]
		}
		if err := rc.Verify(m, buf.Bytes()); err != nil {
			return nil, err
		}
		if m.ByteLength > 0 {
			rc.Counters.AddCopied(int(m.ByteLength)) // out of gRPC's receive buffers, chunk by chunk
		}
		rc.Counters.AddTransfer()
	}
	if pending.Len() != 0 {
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: %d bytes past the last tensor", pending.Len())
	}
	return out, nil
}

// recvPacked is RecvBuffers of a compressed stream: each data chunk one
// zchunk chunk, decoded into its tensor's buffer.
func recvPacked(ctx context.Context, r MsgReceiver, metas []*pb.TensorMeta, rc Receiver, out []*mempool.Buffer, in *chunkcodec.InChunk) ([]*mempool.Buffer, error) {
	var wire int64
	codec := zchunk.Stored
	for _, m := range metas {
		buf, err := rc.Alloc(ctx, int(m.ByteLength))
		if err != nil {
			return out, err
		}
		out = append(out, buf)
		dst := buf.Bytes()
		for len(dst) > 0 {
			in.Free()
			if err := r.RecvMsg(in); err != nil {
				if errors.Is(err, io.EOF) {
					return out, status.Errorf(codes.InvalidArgument, "tensorrpc: stream ended %d bytes short", len(dst))
				}
				return out, err
			}
			if in.Header != nil {
				return out, status.Error(codes.InvalidArgument, "tensorrpc: a second header chunk in a stream")
			}
			z := in.Data.Materialize()
			rc.Counters.AddStreamBytes(int64(len(z)))
			wire += int64(len(z))
			if len(z) > 0 && codec == zchunk.Stored {
				codec = zchunk.Codec(z[0])
			}
			n, err := zchunk.DecodeChunk(dst, z)
			switch {
			case errors.Is(err, zchunk.ErrCorrupt):
				return out, status.Errorf(codes.DataLoss, "tensorrpc: streamed tensor %q: %v", m.Key, err)
			case err != nil:
				return out, status.Errorf(codes.InvalidArgument, "tensorrpc: streamed tensor %q: %v", m.Key, err)
			}
			dst = dst[n:]
		}
		if err := rc.Verify(m, buf.Bytes()); err != nil {
			return out, err
		}
		if m.ByteLength > 0 {
			rc.Counters.AddCopied(int(m.ByteLength)) // decoded out of gRPC's receive buffers
		}
		rc.Counters.AddTransfer()
	}
	rc.Counters.AddCompressed(metaBytes(metas), wire)
	if rc.Packed != nil {
		rc.Packed(codec, wire)
	}
	return out, nil
}

func metaBytes(metas []*pb.TensorMeta) int64 {
	var n int64
	for _, m := range metas {
		n += int64(m.ByteLength)
	}
	return n
}

// copyFrom copies from the front of *src into dst and drops what it
// copied from *src (which views buffers that InChunk.Free releases).
func copyFrom(dst []byte, src *mem.BufferSlice) int {
	n := 0
	for n < len(dst) && len(*src) > 0 {
		b := (*src)[0].ReadOnlyData()
		k := memcopy.Copy(dst[n:], b)
		n += k
		if k == len(b) {
			*src = (*src)[1:]
		} else {
			(*src)[0] = mem.SliceBuffer(b[k:])
		}
	}
	return n
}

// ExpectEnd checks that the peer sent nothing more.
func ExpectEnd(r MsgReceiver) error {
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
