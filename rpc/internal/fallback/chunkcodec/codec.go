package chunkcodec

import (
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto" // registers grpc-go's stock "proto" CodecV2
	"google.golang.org/grpc/mem"
)

// Name is the codec's name and the gRPC content-subtype it answers to: a
// call made with CallOptions carries the content-type
// "application/grpc+tensorrpc-chunk", and a grpc.Server picks this codec
// for it from gRPC's codec registry. The wire format is plain protobuf all
// the same; the name only says that both ends are this package.
const Name = "tensorrpc-chunk"

// stockProto is grpc-go's own "proto" CodecV2, captured when this package is
// initialised (grpc's encoding/proto package, imported above, registers it
// first). It is the fallback of New(nil).
var stockProto = encoding.GetCodecV2(grpcproto.Name)

// init registers a Codec under Name, the way grpc-go's own codecs register
// themselves. Nothing else changes: gRPC's "proto" codec, which every other
// service and call in the process uses, stays grpc-go's own. A server needs
// the registration to serve our clients when it is not built with
// grpc.ForceServerCodecV2 (rpc.Server.Register registers tensorrpc on an
// application's grpc.Server, whose options are not ours to choose).
func init() { encoding.RegisterCodecV2(New(nil)) }

// Codec is an encoding.CodecV2 that moves the data of Chunk messages as
// mem.BufferSlice views: *OutChunk and *InChunk are marshalled and
// unmarshalled here, without copying tensor bytes; every other message (and
// *tensorrpcpb.Chunk) goes to the wrapped fallback codec unchanged.
//
// The zero Codec is not usable; build one with New. A Codec is safe for
// concurrent use.
type Codec struct{ fallback encoding.CodecV2 }

var _ encoding.CodecV2 = Codec{}

// New returns a Codec that delegates every message other than *OutChunk and
// *InChunk to fallback. A nil fallback means grpc-go's stock protobuf codec.
// A fallback that is itself a Codec is unwrapped, so codecs never stack.
//
// Use it with grpc.ForceServerCodecV2 and grpc.ForceCodecV2 to use the codec
// on a whole server or connection; CallOptions uses it per call.
func New(fallback encoding.CodecV2) Codec {
	if c, ok := fallback.(Codec); ok {
		fallback = c.fallback
	}
	if fallback == nil {
		fallback = stockProto
	}
	return Codec{fallback: fallback}
}

// CallOptions returns the options that make one client call use this codec:
// grpc.ForceCodecV2 with a Codec (so the call does not depend on the
// registry), and grpc.CallContentSubtype(Name), so that the server picks
// the same codec (ServerStream) even when the connection's default call
// options name another content-subtype.
func CallOptions() []grpc.CallOption {
	return []grpc.CallOption{grpc.ForceCodecV2(New(nil)), grpc.CallContentSubtype(Name)}
}

// Name returns Name, "tensorrpc-chunk".
func (c Codec) Name() string { return Name }

// Marshal encodes *OutChunk and *InChunk as a protobuf Chunk whose data
// bytes are the chunk's own buffers (each Ref'd, not copied); see OutChunk
// for who owns what. Any other message goes to the fallback codec.
func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *OutChunk:
		if m == nil {
			return nil, errors.New("chunkcodec: Marshal of a nil *OutChunk")
		}
		return marshalChunk(m.Header, m.Data)
	case *InChunk:
		if m == nil {
			return nil, errors.New("chunkcodec: Marshal of a nil *InChunk")
		}
		return marshalChunk(m.Header, m.Data)
	}
	if c.fallback == nil {
		return nil, fmt.Errorf("chunkcodec: zero Codec cannot marshal %T; build it with New", v)
	}
	return c.fallback.Marshal(v)
}

// Unmarshal decodes a protobuf Chunk into *InChunk, keeping the data as
// Ref'd views of data's buffers (see InChunk). Any other message goes to
// the fallback codec.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *InChunk:
		if m == nil {
			return errors.New("chunkcodec: Unmarshal into a nil *InChunk")
		}
		return unmarshalChunk(data, m)
	case *OutChunk:
		return errors.New("chunkcodec: cannot Unmarshal into *OutChunk; receive into *InChunk")
	}
	if c.fallback == nil {
		return fmt.Errorf("chunkcodec: zero Codec cannot unmarshal %T; build it with New", v)
	}
	return c.fallback.Unmarshal(data, v)
}
