package rpc

import (
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// The messages a small call's frames carry (a Fetch's inline answer, see
// inline_answer.go; a Send's request; a Call's request and reply) are
// encoded and decoded here without protobuf's reflection, which took
// longer than the rest of a 4 KiB call's encoding, into and from exactly
// what protobuf writes and reads. What they do not cover (a location, a
// field they do not know, an encoding they do not follow, a message field
// twice, which protobuf merges, a string that is not UTF-8) goes to
// protobuf as before: the fast paths decline and set nothing.

// field reads the first field of b, a protobuf encoding: its number, its
// varint value (VarintType) or its bytes (BytesType), and the rest of b.
// ok is false at a malformed field or one of another wire type.
func field(b []byte) (num protowire.Number, typ protowire.Type, v uint64, bs, rest []byte, ok bool) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, 0, 0, nil, nil, false
	}
	b = b[n:]
	switch typ {
	case protowire.VarintType:
		v, n = protowire.ConsumeVarint(b)
	case protowire.BytesType:
		bs, n = protowire.ConsumeBytes(b)
	default:
		return 0, 0, 0, nil, nil, false
	}
	if n < 0 {
		return 0, 0, 0, nil, nil, false
	}
	return num, typ, v, bs, b[n:], true
}

// appendUnpacked appends the packed varints bs holds to vs; ok is false
// for a malformed one.
func appendUnpacked[T int64 | uint64](vs []T, bs []byte) (_ []T, ok bool) {
	for len(bs) > 0 {
		x, k := protowire.ConsumeVarint(bs)
		if k < 0 {
			return vs, false
		}
		vs = append(vs, T(x))
		bs = bs[k:]
	}
	return vs, true
}

// fastTensorMeta decodes a TensorMeta without a location: nil for what
// it leaves to protobuf.
func fastTensorMeta(b []byte) *pb.TensorMeta {
	m := &pb.TensorMeta{}
	for len(b) > 0 {
		num, typ, v, bs, rest, ok := field(b)
		if !ok {
			return nil
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType && utf8.Valid(bs):
			m.Key = string(bs)
		case num == 3 && typ == protowire.BytesType: // packed
			if m.Shape, ok = appendUnpacked(m.Shape, bs); !ok {
				return nil
			}
		case typ != protowire.VarintType:
			return nil
		case num == 2:
			m.Dtype = pb.DType(int32(v))
		case num == 3: // unpacked
			m.Shape = append(m.Shape, int64(v))
		case num == 4:
			m.ByteLength = v
		case num == 5:
			crc := uint32(v)
			m.Crc32C = &crc
		case num == 7:
			idx := uint32(v)
			m.InlineIndex = &idx
		case num == 8:
			m.TransferId = v
		default:
			return nil
		}
	}
	return m
}

// fastMeta reports whether appendMeta encodes m: no location, no landing
// index, no unknown fields, a UTF-8 key.
func fastMeta(m *pb.TensorMeta) bool {
	return m.Location == nil && m.LandingIndex == nil && len(m.ProtoReflect().GetUnknown()) == 0 && utf8.ValidString(m.Key)
}

// bytesField is the length of a length-delimited field of field number
// below 16 holding n bytes.
func bytesField(n int) int { return 1 + protowire.SizeVarint(uint64(n)) + n }

// varintField is the length of a varint field of field number below 16.
func varintField(v uint64) int { return 1 + protowire.SizeVarint(v) }

// appendBytesField appends field num, length-delimited, holding b.
func appendBytesField(out []byte, num protowire.Number, b []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(out, num, protowire.BytesType), b)
}

// appendVarintField appends field num, a varint.
func appendVarintField(out []byte, num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(out, num, protowire.VarintType), v)
}

// metaSize is the length of m's encoding, without a location.
func metaSize(m *pb.TensorMeta) int {
	n := 0
	if m.Key != "" {
		n += bytesField(len(m.Key))
	}
	if m.Dtype != 0 {
		n += varintField(uint64(int64(m.Dtype)))
	}
	if len(m.Shape) > 0 {
		n += bytesField(packedSize(m.Shape))
	}
	if m.ByteLength != 0 {
		n += varintField(m.ByteLength)
	}
	if m.Crc32C != nil {
		n += varintField(uint64(*m.Crc32C))
	}
	if m.InlineIndex != nil {
		n += varintField(uint64(*m.InlineIndex))
	}
	if m.TransferId != 0 {
		n += varintField(m.TransferId)
	}
	return n
}

// packedSize is the length of vs as packed varints.
func packedSize[T int64 | uint64](vs []T) int {
	n := 0
	for _, v := range vs {
		n += protowire.SizeVarint(uint64(v))
	}
	return n
}

// appendPacked appends field num holding vs as packed varints.
func appendPacked[T int64 | uint64](out []byte, num protowire.Number, vs []T) []byte {
	out = protowire.AppendTag(out, num, protowire.BytesType)
	out = protowire.AppendVarint(out, uint64(packedSize(vs)))
	for _, v := range vs {
		out = protowire.AppendVarint(out, uint64(v))
	}
	return out
}

// appendMetaField appends field num holding m (fastMeta), as protobuf
// writes it: fields in order.
func appendMetaField(out []byte, num protowire.Number, m *pb.TensorMeta) []byte {
	out = protowire.AppendTag(out, num, protowire.BytesType)
	out = protowire.AppendVarint(out, uint64(metaSize(m)))
	if m.Key != "" {
		out = protowire.AppendString(protowire.AppendTag(out, 1, protowire.BytesType), m.Key)
	}
	if m.Dtype != 0 {
		out = appendVarintField(out, 2, uint64(int64(m.Dtype)))
	}
	if len(m.Shape) > 0 {
		out = appendPacked(out, 3, m.Shape)
	}
	if m.ByteLength != 0 {
		out = appendVarintField(out, 4, m.ByteLength)
	}
	if m.Crc32C != nil {
		out = appendVarintField(out, 5, uint64(*m.Crc32C))
	}
	if m.InlineIndex != nil {
		out = appendVarintField(out, 7, uint64(*m.InlineIndex))
	}
	if m.TransferId != 0 {
		out = appendVarintField(out, 8, m.TransferId)
	}
	return out
}

// fastMetas reports whether appendMetaField encodes every one of ms.
func fastMetas(ms []*pb.TensorMeta) bool {
	for _, m := range ms {
		if m == nil || !fastMeta(m) {
			return false
		}
	}
	return true
}

// tensorsSize is the length of fields holding ms and then ds, each of
// its own (repeated TensorMeta, then repeated bytes).
func tensorsSize(ms []*pb.TensorMeta, ds [][]byte) int {
	n := 0
	for _, m := range ms {
		n += bytesField(metaSize(m))
	}
	for _, d := range ds {
		n += bytesField(len(d))
	}
	return n
}

// appendTensors appends ms as field metaNum and then ds as field
// dataNum, repeated.
func appendTensors(b []byte, metaNum protowire.Number, ms []*pb.TensorMeta, dataNum protowire.Number, ds [][]byte) []byte {
	for _, m := range ms {
		b = appendMetaField(b, metaNum, m)
	}
	for _, d := range ds {
		b = appendBytesField(b, dataNum, d)
	}
	return b
}

// marshalAppend is protobuf's encoding of m appended to b, for a fast
// path that declines (on an error, b: the frame's check of its length
// against FrameSize fails the send).
func marshalAppend(b []byte, m proto.Message) []byte {
	out, err := proto.MarshalOptions{}.MarshalAppend(b, m)
	if err != nil {
		return b
	}
	return out
}

// callRequestBody is a CallRequest that encodes itself into a CALL_REQ
// frame (engine.FrameMarshaler).
type callRequestBody struct{ *pb.CallRequest }

func (r callRequestBody) fast() bool {
	return len(r.ProtoReflect().GetUnknown()) == 0 && len(r.ReplyLandings) == 0 && utf8.ValidString(r.SessionId) && utf8.ValidString(r.Method) && fastMetas(r.Tensors)
}

// FrameSize is proto.Size(r).
func (r callRequestBody) FrameSize() int {
	if !r.fast() {
		return proto.Size(r.CallRequest)
	}
	n := 0
	if r.SessionId != "" {
		n += bytesField(len(r.SessionId))
	}
	if r.Method != "" {
		n += bytesField(len(r.Method))
	}
	if len(r.Metadata) > 0 {
		n += bytesField(len(r.Metadata))
	}
	return n + tensorsSize(r.Tensors, r.InlineData)
}

// AppendFrame appends proto.Marshal(r) to b.
func (r callRequestBody) AppendFrame(b []byte) []byte {
	if !r.fast() {
		return marshalAppend(b, r.CallRequest)
	}
	if r.SessionId != "" {
		b = protowire.AppendString(protowire.AppendTag(b, 1, protowire.BytesType), r.SessionId)
	}
	if r.Method != "" {
		b = protowire.AppendString(protowire.AppendTag(b, 2, protowire.BytesType), r.Method)
	}
	if len(r.Metadata) > 0 {
		b = appendBytesField(b, 3, r.Metadata)
	}
	return appendTensors(b, 4, r.Tensors, 5, r.InlineData)
}

// fastCallRequest decodes b into m (a new CallRequest) as proto.Unmarshal
// would, or reports false and sets nothing.
func fastCallRequest(b []byte, m *pb.CallRequest) bool {
	var r pb.CallRequest // fields set here, then moved to m
	for len(b) > 0 {
		num, typ, _, bs, rest, ok := field(b)
		if !ok || typ != protowire.BytesType {
			return false
		}
		b = rest
		switch num {
		case 1, 2:
			if !utf8.Valid(bs) {
				return false
			}
			if num == 1 {
				r.SessionId = string(bs)
			} else {
				r.Method = string(bs)
			}
		case 3:
			r.Metadata = append(r.Metadata[:0], bs...)
		case 4:
			t := fastTensorMeta(bs)
			if t == nil {
				return false
			}
			r.Tensors = append(r.Tensors, t)
		case 5:
			r.InlineData = append(r.InlineData, inlineCopy(bs))
		default:
			return false
		}
	}
	m.SessionId, m.Method, m.Metadata, m.Tensors, m.InlineData = r.SessionId, r.Method, r.Metadata, r.Tensors, r.InlineData
	return true
}

// callReplyBody is a CallResponse that encodes itself into a CALL_RESP
// frame (engine.FrameMarshaler).
type callReplyBody struct{ *pb.CallResponse }

func (r callReplyBody) fast() bool {
	return len(r.ProtoReflect().GetUnknown()) == 0 && fastMetas(r.Tensors)
}

// FrameSize is proto.Size(r).
func (r callReplyBody) FrameSize() int {
	if !r.fast() {
		return proto.Size(r.CallResponse)
	}
	n := 0
	if len(r.Metadata) > 0 {
		n += bytesField(len(r.Metadata))
	}
	n += tensorsSize(r.Tensors, r.InlineData)
	if len(r.TransferIds) > 0 {
		n += bytesField(packedSize(r.TransferIds))
	}
	return n
}

// AppendFrame appends proto.Marshal(r) to b.
func (r callReplyBody) AppendFrame(b []byte) []byte {
	if !r.fast() {
		return marshalAppend(b, r.CallResponse)
	}
	if len(r.Metadata) > 0 {
		b = appendBytesField(b, 1, r.Metadata)
	}
	b = appendTensors(b, 2, r.Tensors, 3, r.InlineData)
	if len(r.TransferIds) > 0 {
		b = appendPacked(b, 4, r.TransferIds)
	}
	return b
}

// callAnswer is a Call's reply as a CALL_RESP frame carries it, decoded
// by fastCallResponse (engine.FrameUnmarshaler).
type callAnswer struct{ pb.CallResponse }

// UnmarshalFrame decodes b as proto.Unmarshal would.
func (a *callAnswer) UnmarshalFrame(b []byte) error {
	if fastCallResponse(b, &a.CallResponse) {
		return nil
	}
	return proto.Unmarshal(b, &a.CallResponse)
}

// fastCallResponse decodes b into m (a new CallResponse) as
// proto.Unmarshal would, or reports false and sets nothing.
func fastCallResponse(b []byte, m *pb.CallResponse) bool {
	var r pb.CallResponse
	for len(b) > 0 {
		num, typ, v, bs, rest, ok := field(b)
		if !ok {
			return false
		}
		b = rest
		switch {
		case num == 4 && typ == protowire.VarintType: // unpacked
			r.TransferIds = append(r.TransferIds, v)
		case typ != protowire.BytesType:
			return false
		case num == 1:
			r.Metadata = append(r.Metadata[:0], bs...)
		case num == 2:
			t := fastTensorMeta(bs)
			if t == nil {
				return false
			}
			r.Tensors = append(r.Tensors, t)
		case num == 3:
			r.InlineData = append(r.InlineData, inlineCopy(bs))
		case num == 4: // packed
			if r.TransferIds, ok = appendUnpacked(r.TransferIds, bs); !ok {
				return false
			}
		default:
			return false
		}
	}
	m.Metadata, m.Tensors, m.InlineData, m.TransferIds = r.Metadata, r.Tensors, r.InlineData, r.TransferIds
	return true
}

// sendRequestBody is a SendRequest that encodes itself into a SEND_REQ
// frame (engine.FrameMarshaler).
type sendRequestBody struct{ *pb.SendRequest }

func (r sendRequestBody) fast() bool {
	return len(r.ProtoReflect().GetUnknown()) == 0 && utf8.ValidString(r.SessionId) && (r.Meta == nil || fastMeta(r.Meta))
}

// FrameSize is proto.Size(r).
func (r sendRequestBody) FrameSize() int {
	if !r.fast() {
		return proto.Size(r.SendRequest)
	}
	n := 0
	if r.SessionId != "" {
		n += bytesField(len(r.SessionId))
	}
	if r.Meta != nil {
		n += bytesField(metaSize(r.Meta))
	}
	if len(r.InlineData) > 0 {
		n += bytesField(len(r.InlineData))
	}
	if len(r.Rows) > 0 {
		n += bytesField(packedSize(r.Rows))
	}
	if r.Reserve {
		n += 2
	}
	if r.Commit != 0 {
		n += varintField(r.Commit)
	}
	return n
}

// AppendFrame appends proto.Marshal(r) to b.
func (r sendRequestBody) AppendFrame(b []byte) []byte {
	if !r.fast() {
		return marshalAppend(b, r.SendRequest)
	}
	if r.SessionId != "" {
		b = protowire.AppendString(protowire.AppendTag(b, 1, protowire.BytesType), r.SessionId)
	}
	if r.Meta != nil {
		b = appendMetaField(b, 2, r.Meta)
	}
	if len(r.InlineData) > 0 {
		b = appendBytesField(b, 3, r.InlineData)
	}
	if len(r.Rows) > 0 {
		b = appendPacked(b, 6, r.Rows)
	}
	if r.Reserve {
		b = appendVarintField(b, 7, 1)
	}
	if r.Commit != 0 {
		b = appendVarintField(b, 8, r.Commit)
	}
	return b
}

// fastSendRequest decodes b into m (a new SendRequest) as proto.Unmarshal
// would, or reports false and sets nothing.
func fastSendRequest(b []byte, m *pb.SendRequest) bool {
	var r pb.SendRequest
	for len(b) > 0 {
		num, typ, v, bs, rest, ok := field(b)
		if !ok {
			return false
		}
		b = rest
		switch {
		case typ == protowire.VarintType:
			switch num {
			case 6: // unpacked
				r.Rows = append(r.Rows, int64(v))
			case 7:
				r.Reserve = v != 0
			case 8:
				r.Commit = v
			default:
				return false
			}
		case num == 1:
			if !utf8.Valid(bs) {
				return false
			}
			r.SessionId = string(bs)
		case num == 2 && r.Meta == nil: // twice: protobuf merges them
			if r.Meta = fastTensorMeta(bs); r.Meta == nil {
				return false
			}
		case num == 3:
			r.InlineData = inlineCopy(bs)
		case num == 6: // packed
			if r.Rows, ok = appendUnpacked(r.Rows, bs); !ok {
				return false
			}
		default:
			return false
		}
	}
	m.SessionId, m.Meta, m.InlineData, m.Rows, m.Reserve, m.Commit = r.SessionId, r.Meta, r.InlineData, r.Rows, r.Reserve, r.Commit
	return true
}
