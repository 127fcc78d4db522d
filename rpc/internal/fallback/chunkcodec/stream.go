package chunkcodec

import "google.golang.org/grpc"

// Commit commits a client stream's retry attempt, so grpc-go stops keeping
// sent messages for a retry. Call it right after NewStream on every client
// stream that sends OutChunks while another goroutine may receive, commit
// or call Header on the same stream (any bidi stream read concurrently).
//
// Why: in grpc-go v1.85.0, clientStream.SendMsg hands an extra reference of
// the message to its retry buffer after the transport took the message. If
// another goroutine commits the attempt in between (RecvMsg and Header do,
// on success), bufferForRetryLocked returns without freeing that
// reference, so the buffers of that one message never reach a reference
// count of zero and their release function never runs. The stock protobuf
// codec leaks a pooled buffer to the garbage collector the same way; with
// Wrap it would leak the caller's memory. Committing first takes SendMsg's
// path that frees the reference itself. TestCommit shows both behaviours.
//
// It gives up gRPC's transparent retry of the stream, which a multi-MiB
// tensor stream cannot use anyway: the retry buffer holds 256 KiB by
// default and commits as soon as a stream sends more.
func Commit(s grpc.ClientStream) {
	_ = s.Context() // clientStream.Context commits the attempt
}
