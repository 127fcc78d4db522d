// Package chunkcodec is the gRPC codec of the plain-gRPC fallback: it sends
// and receives tensorrpc.v1.Chunk messages with their data as
// mem.BufferSlice views, so tensor bytes are never copied into or out of a
// protobuf []byte field. The wire format is plain protobuf: a peer that has
// only tensorrpc.proto (and any stock gRPC codec) reads and writes the same
// bytes.
//
// # Use
//
// Send an *OutChunk and receive into an *InChunk through a Codec. The
// Codec is registered with gRPC under its own name, the content-subtype
// Name ("tensorrpc-chunk"), as grpc-go's codecs register themselves; it
// never replaces gRPC's "proto" codec, so importing this package changes
// nothing for any other service or call in the process. Every other
// message, *tensorrpcpb.Chunk included, goes to grpc-go's protobuf codec
// and is encoded exactly as before.
//
// A client picks the codec per call with CallOptions (grpc.ForceCodecV2
// and grpc.CallContentSubtype), so nothing depends on connection-wide
// settings. A server finds it in the registry by the content-subtype the
// client sent, with no server option. A server handler wraps its stream
// with ServerStream, which keeps the zero-copy path for clients of this
// codec and translates to *tensorrpcpb.Chunk for clients that have only
// tensorrpc.proto (content-type application/grpc or application/grpc+proto,
// hence gRPC's proto codec); Incoming tells which a stream is.
// grpc.ForceServerCodecV2(New(nil)) and grpc.ForceCodecV2(New(nil)) still
// put the codec on a whole server or connection.
//
// # Copies of the tensor bytes
//
// Send: 0 copies in the codec. Marshal writes a small prefix (the header
// message, copied, and the data field's tag and length) and then appends the
// caller's buffers themselves, each with a new reference. grpc-go's
// transport then copies the bytes once into its HTTP/2 write buffer (one
// copy, made by gRPC; none with grpc.WithWriteBufferSize(0) /
// grpc.WriteBufferSize(0), which writes each frame straight to the socket),
// and the kernel copies them into the socket. The stock protobuf codec
// adds one more copy (proto.Marshal of the []byte field).
//
// Receive: 0 copies in the codec. gRPC's transport reads each HTTP/2 DATA
// frame (at most 16 KiB) into a pooled buffer (one copy, made by gRPC,
// after the kernel's; none with grpc.WithReadBufferSize(0) /
// grpc.ReadBufferSize(0), which reads frames straight from the socket into
// those buffers); InChunk.Data is a list of Ref'd sub-slices of those
// buffers. Only the header, a small message, is decoded into a new
// ChunkHeader (and copied first in the rare case that it straddles two
// frames). The stock protobuf codec adds two copies: it joins the frames
// into one buffer and proto.Unmarshal copies the bytes field out of it.
//
// # Buffer lifetimes
//
// Send. The codec takes its own reference on each buffer of OutChunk.Data
// and passes it to gRPC; the caller keeps its references and frees them
// (OutChunk.Free) once it no longer needs them, typically right after
// SendMsg returns. This package does not assume gRPC is done with the bytes
// when SendMsg returns, because it is not: grpc-go (v1.85) Refs the
// message and queues it for its writer goroutine (loopy), which frees its
// reference only after it has copied the last byte into the write buffer,
// or when the stream or connection is torn down; a client stream may also
// keep the message for retries until the call commits. So memory is handed
// back only through reference counting: wrap the bytes with Wrap or
// WrapSlices (mem.NewBuffer with a pool whose Put calls a release function),
// and release runs once, on some goroutine, after the caller and gRPC have
// both freed every reference. Buffers with a capacity of 1 KiB or less
// are not refcounted by grpc-go, so Wrap copies those and releases at once.
// One grpc-go v1.85.0 race can lose a reference of a message sent on a
// client stream that another goroutine reads (release would never run for
// it): call Commit right after NewStream on such streams.
//
// Receive. gRPC frees its references to the received message when
// Unmarshal returns; InChunk.Data holds the codec's own references. The
// receiver owns them and must call InChunk.Free exactly once; until then
// those receive buffers stay out of gRPC's buffer pool. Unmarshal does not
// free an InChunk's previous Data.
//
// # Parsing
//
// Unmarshal follows protobuf semantics for Chunk: a repeated header is
// merged, the last data field wins, unknown fields are skipped. It is
// stricter than protobuf-go in one respect: a header or data field with a
// wire type other than length-delimited, and groups anywhere, are errors
// (ErrMalformed) rather than unknown fields. Malformed input (truncated
// varints, lengths past the end, bad field numbers or wire types) returns an
// error and never panics; this is fuzzed (FuzzUnmarshal).
package chunkcodec
