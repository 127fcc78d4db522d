package chunkcodec

import (
	"bytes"
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// FuzzUnmarshal feeds arbitrary bytes, split into buffers of stride bytes,
// to Unmarshal. It must never panic or leak a buffer; what it accepts,
// proto.Unmarshal must accept with the same header and data; and what it
// accepts must marshal back to the same message.
func FuzzUnmarshal(f *testing.F) {
	good, _ := proto.Marshal(&tensorrpcpb.Chunk{Header: testHeader(), Data: []byte("hello, tensors")})
	f.Add(good, uint8(0))
	f.Add(good, uint8(3))
	f.Add([]byte{0x12, 0x80}, uint8(1))
	f.Add([]byte{0x0b, 0x0c}, uint8(1))
	f.Add([]byte{0x12, 0x02, 'a', 'b', 0x12, 0x01, 'c'}, uint8(2))
	f.Fuzz(func(t *testing.T, msg []byte, stride uint8) {
		pool := newCountingPool()
		in := pool.split(msg, int(stride)+1)
		var ic InChunk
		err := New(nil).Unmarshal(in, &ic)
		in.Free()

		var ref tensorrpcpb.Chunk
		refErr := proto.Unmarshal(msg, &ref)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			if ic.Header != nil || ic.Data != nil {
				t.Fatal("InChunk not cleared on error")
			}
			pool.check(t)
			return
		}
		if refErr != nil {
			t.Fatalf("accepted what proto.Unmarshal rejects: %v", refErr)
		}
		if !sameHeader(ic.Header, ref.Header) {
			t.Fatalf("header %v, proto.Unmarshal says %v", ic.Header, ref.Header)
		}
		if got := ic.Data.Materialize(); !bytes.Equal(got, ref.Data) {
			t.Fatalf("data %x, proto.Unmarshal says %x", got, ref.Data)
		}

		out, err := New(nil).Marshal(&ic)
		if err != nil {
			t.Fatal(err)
		}
		var back tensorrpcpb.Chunk
		if err := proto.Unmarshal(out.Materialize(), &back); err != nil {
			t.Fatal(err)
		}
		out.Free()
		if !sameHeader(back.Header, ref.Header) || !bytes.Equal(back.Data, ref.Data) {
			t.Fatal("re-marshalled chunk differs")
		}
		ic.Free()
		pool.check(t)
	})
}
