package chunkcodec

import (
	"context"
	"errors"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"

	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// baseContentType is gRPC's content-type; a content-subtype follows it
// after a '+' (or, as grpc-go also accepts, a ';').
const baseContentType = "application/grpc"

// Incoming reports whether the server stream whose context is ctx uses this
// codec: whether its client sent the content-subtype Name, as a client
// using CallOptions does. A client built from tensorrpc.proto alone sends
// "application/grpc" or "application/grpc+proto" and gets gRPC's proto
// codec, which cannot marshal *OutChunk or unmarshal into *InChunk.
//
// How: grpc-go (v1.85.0) puts the request's "content-type" header into the
// stream's incoming metadata, on both of its server transports
// (internal/transport: http2Server.operateHeaders and, for ServeHTTP,
// NewServerHandlerTransport), and picks the stream's codec by the
// content-subtype parsed from that same header (grpcutil.ContentSubtype,
// then Server.getCodec, an exact, case-sensitive registry lookup; with
// several headers the last valid one wins). Incoming parses it the same
// way. It cannot see grpc.ForceServerCodecV2: a server forced to another
// codec than a Codec cannot serve our clients' OutChunks, and one forced
// to a Codec works with ServerStream for every client.
func Incoming(ctx context.Context) bool {
	vs := metadata.ValueFromIncomingContext(ctx, "content-type")
	if len(vs) == 0 {
		return false
	}
	return contentSubtype(vs[len(vs)-1]) == Name
}

// contentSubtype returns the content-subtype of a gRPC content-type, as
// grpc-go's grpcutil.ContentSubtype does ("" for none or not gRPC).
func contentSubtype(contentType string) string {
	rest, ok := strings.CutPrefix(contentType, baseContentType)
	if !ok || rest == "" || (rest[0] != '+' && rest[0] != ';') {
		return ""
	}
	return rest[1:]
}

// ServerStream returns a stream on which a handler sends *OutChunk and
// receives into *InChunk whatever codec the client uses. When the client
// uses this codec (Incoming), that is ss itself: zero copies. Otherwise
// (a client with only the .proto) it is ss wrapped so that SendMsg turns an
// *OutChunk or *InChunk into a *tensorrpcpb.Chunk and RecvMsg receives a
// *tensorrpcpb.Chunk into an *InChunk; every other message, and every
// other method, goes to ss unchanged.
//
// The wrapped stream makes the copies the proto codec makes for any
// Chunk, and no more: on send, Data (when it is one buffer, as the chunks
// of package rpc are) becomes the Chunk's data field as a view, and
// proto.Marshal copies it once into the message's encoding while SendMsg
// runs; gRPC keeps no reference to the OutChunk's buffers, so they can be
// freed as soon as SendMsg returns. Data of several buffers is first joined
// into one (a second copy). On receive the proto codec joins the frames and
// copies the data field out; InChunk.Data is then one mem.SliceBuffer over
// that new slice, which Free merely drops (the garbage collector owns it).
func ServerStream(ss grpc.ServerStream) grpc.ServerStream {
	if Incoming(ss.Context()) {
		return ss
	}
	return protoStream{ss}
}

// protoStream is ServerStream's translation for clients of the proto codec.
type protoStream struct{ grpc.ServerStream }

func (s protoStream) SendMsg(m any) error {
	switch c := m.(type) {
	case *OutChunk:
		if c == nil {
			return errors.New("chunkcodec: SendMsg of a nil *OutChunk")
		}
		return s.ServerStream.SendMsg(protoChunk(c.Header, c.Data))
	case *InChunk:
		if c == nil {
			return errors.New("chunkcodec: SendMsg of a nil *InChunk")
		}
		return s.ServerStream.SendMsg(protoChunk(c.Header, c.Data))
	}
	return s.ServerStream.SendMsg(m)
}

// protoChunk is a Chunk whose data field views data when it is one buffer
// (the proto codec copies it while marshalling; see ServerStream).
func protoChunk(header *tensorrpcpb.ChunkHeader, data mem.BufferSlice) *tensorrpcpb.Chunk {
	c := &tensorrpcpb.Chunk{Header: header}
	switch len(data) {
	case 0:
	case 1:
		c.Data = data[0].ReadOnlyData()
	default:
		c.Data = data.Materialize()
	}
	return c
}

func (s protoStream) RecvMsg(m any) error {
	switch c := m.(type) {
	case *InChunk:
		if c == nil {
			return errors.New("chunkcodec: RecvMsg into a nil *InChunk")
		}
		var pc tensorrpcpb.Chunk
		if err := s.ServerStream.RecvMsg(&pc); err != nil {
			return err
		}
		// As Unmarshal: Header and Data are overwritten, an earlier Data
		// is not freed, and Data is nil for a chunk without data.
		c.Header, c.Data = pc.Header, nil
		if len(pc.Data) > 0 {
			c.Data = mem.BufferSlice{mem.SliceBuffer(pc.Data)}
		}
		return nil
	case *OutChunk:
		return errors.New("chunkcodec: cannot RecvMsg into *OutChunk; receive into *InChunk")
	}
	return s.ServerStream.RecvMsg(m)
}
