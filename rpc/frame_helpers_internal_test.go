// White-box: helpers that build raw frames with the engine's codec.

package rpc

import (
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
)

// hdr is a frame: its header, for n bytes after it, then payload.
func hdr(typ uint8, flags uint16, credits uint32, ref uint64, n int, payload []byte) []byte {
	b := make([]byte, wire.FrameHeaderLen, wire.FrameHeaderLen+len(payload))
	engine.PutFrameHeader(b, wire.FrameHeader{Type: typ, Flags: flags, Credits: credits, Ref: ref}, n)
	return append(b, payload...)
}

// okBody is a response body with an OK status and m.
func okBody(m proto.Message) []byte {
	b := engine.AppendStatus(nil, nil, 1<<20)
	enc, _ := proto.Marshal(m)
	return append(b, enc...)
}
