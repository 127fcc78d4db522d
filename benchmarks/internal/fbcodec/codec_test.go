package fbcodec

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
)

func TestMarshalUnmarshal(t *testing.T) {
	var pool BuilderPool
	b := pool.Get(1 << 20)
	if cap(b.Bytes) < 1<<20 {
		t.Fatalf("builder capacity %d, want ≥ 1 MiB", cap(b.Bytes))
	}
	payload := bytes.Repeat([]byte{7}, 1<<20)
	vec := b.CreateByteVector(payload)
	b.Finish(vec)
	want := append([]byte(nil), b.FinishedBytes()...)

	var c Codec
	out, err := c.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	// Split the message as gRPC's receive path does, into several buffers.
	flat := out.Materialize()
	out.Free()
	var in mem.BufferSlice
	for off := 0; off < len(flat); off += 16 << 10 {
		in = append(in, mem.SliceBuffer(flat[off:min(off+16<<10, len(flat))]))
	}
	var f Frame
	if err := c.Unmarshal(in, &f); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(f.Bytes(), want) {
		t.Fatal("unmarshalled frame differs")
	}
	f.Free()
	if f.Bytes() != nil {
		t.Fatal("freed frame still has bytes")
	}
	if _, err := c.Marshal(42); err == nil {
		t.Fatal("marshalled an int")
	}
}
