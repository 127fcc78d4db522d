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
func packFor(c verbs.Compression, payload []byte) zchunk.Codec {
	switch c.Codec {
	case verbs.CodecS2:
		return zchunk.S2
	case verbs.CodecZstd:
		return zchunk.Zstd
	case verbs.CodecHuff:
		return zchunk.Huff
	case verbs.CodecAuto:
		return zchunk.Choose(zchunk.Segments{payload}, len(payload), c.Goodput).Codec
	}
	return zchunk.Stored
}
