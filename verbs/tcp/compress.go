package tcp

import (
	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// packFor decides how a Read response of payload goes: with the codec the
// request named, or for CodecAuto the one zchunk.Choose picks from a
// sample of payload and the requester's goodput (one core compressing on
// each side: each lane's response is compressed by its own writer);
// zchunk.Stored for as it is.
func packFor(c verbs.Compression, payload []byte) zchunk.Plan {
	if z, ok := zchunk.Named(c.Codec.String()); ok {
		return zchunk.Plan{Codec: z}
	}
	if c.Codec == verbs.CodecAuto {
		return zchunk.Choose(zchunk.Segments{payload}, len(payload), c.Goodput)
	}
	return zchunk.Plan{Codec: zchunk.Stored}
}

// answerImm is the imm of the answer to a Read that asked for
// compression: the codec it came with in the low 8 bits (0: as it is)
// and, above them, the ratio auto's sample showed of the best codec, in
// hundredths (0: no sample).
func answerImm(p zchunk.Plan) uint32 {
	return uint32(p.Codec) | uint32(min(p.Sampled*100, 0xffff))<<8
}
