package fallback

import (
	"bytes"
	"context"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // the codec chunkcodec falls back to
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/pooltest"
	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/fallback/chunkcodec"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// pipe is a stream whose messages go through the chunk codec, as on the
// wire, and wait in memory until received.
type pipe struct {
	codec chunkcodec.Codec
	msgs  []mem.BufferSlice
}

func newPipe() *pipe { return &pipe{codec: chunkcodec.New(encoding.GetCodecV2("proto"))} }

func (p *pipe) SendMsg(m any) error {
	data, err := p.codec.Marshal(m)
	if err != nil {
		return err
	}
	// Keep a copy, as gRPC's transport does, and let go of the views.
	p.msgs = append(p.msgs, mem.BufferSlice{mem.SliceBuffer(data.Materialize())})
	data.Free()
	return nil
}

func (p *pipe) RecvMsg(m any) error {
	if len(p.msgs) == 0 {
		return io.EOF
	}
	data := p.msgs[0]
	p.msgs = p.msgs[1:]
	return p.codec.Unmarshal(data, m)
}

type counts struct{ stream, copied, transfers, compressed, saved atomic.Int64 }

func (c *counts) AddStreamBytes(n int64) { c.stream.Add(n) }
func (c *counts) AddCopied(n int)        { c.copied.Add(int64(n)) }
func (c *counts) AddTransfer()           { c.transfers.Add(1) }
func (c *counts) AddCompressed(raw, wire int64) {
	c.compressed.Add(1)
	c.saved.Add(raw - wire)
}

func newPool(t *testing.T) *mempool.Pool { return pooltest.New(t, 8<<20) }

func receiver(p *mempool.Pool, c Counters) Receiver {
	return Receiver{
		Check:    func(*pb.TensorMeta) error { return nil },
		Alloc:    func(ctx context.Context, n int) (*mempool.Buffer, error) { return p.Alloc(ctx, n) },
		Verify:   func(*pb.TensorMeta, []byte) error { return nil },
		Counters: c,
	}
}

// TestRoundTrip sends tensors that span chunks and share them, and
// receives them back.
func TestRoundTrip(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	sizes := []int{0, 3, ChunkSize + 5, 7}
	var bufs []*mempool.Buffer
	var metas []*pb.TensorMeta
	for i, n := range sizes {
		b, err := p.Alloc(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		for j := range b.Bytes() {
			b.Bytes()[j] = byte(i + j)
		}
		bufs = append(bufs, b)
		metas = append(metas, &pb.TensorMeta{Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{int64(n)}, ByteLength: uint64(n)})
	}
	s := newPipe()
	var sent, got counts
	refs := NewChunkRefs()
	if err := SendChunks(s, &pb.ChunkHeader{Method: "m", Tensors: metas}, bufs, &sent, refs, zchunk.Stored); err != nil {
		t.Fatal(err)
	}
	refs.Settle(ctx) // the pipe copied every chunk and freed it
	h, err := RecvHeader(s)
	if err != nil || h.Method != "m" || len(h.Tensors) != len(sizes) {
		t.Fatalf("RecvHeader: %v, %v", h, err)
	}
	out, err := RecvBuffers(ctx, s, h.Tensors, receiver(p, &got))
	if err != nil {
		t.Fatal(err)
	}
	if err := ExpectEnd(s); err != nil {
		t.Fatal(err)
	}
	total := 0
	for i := range bufs {
		if !bytes.Equal(out[i].Bytes(), bufs[i].Bytes()) {
			t.Errorf("tensor %d differs", i)
		}
		total += sizes[i]
		out[i].Release()
		bufs[i].Release()
	}
	if sent.stream.Load() != int64(total) || got.stream.Load() != int64(total) || got.copied.Load() != int64(total) || got.transfers.Load() != int64(len(sizes)) {
		t.Errorf("counted sent %d, received %d, copied %d bytes and %d transfers; want %d bytes and %d transfers",
			sent.stream.Load(), got.stream.Load(), got.copied.Load(), got.transfers.Load(), total, len(sizes))
	}
}

// TestCompressedRoundTrip: tensors sent compressed (each codec) come
// back exact, chunk by chunk, counted as compressed; a corrupt chunk
// fails DataLoss and one that declares more than its tensor has left
// InvalidArgument, releasing what was allocated (the pool's check).
func TestCompressedRoundTrip(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	sizes := []int{0, 3, ChunkSize + 5, 7}
	for _, codec := range []zchunk.Codec{zchunk.S2, zchunk.Zstd, zchunk.Huff} {
		var bufs []*mempool.Buffer
		var metas []*pb.TensorMeta
		for _, n := range sizes {
			b, err := p.Alloc(ctx, n)
			if err != nil {
				t.Fatal(err)
			}
			for j := range b.Bytes() {
				b.Bytes()[j] = byte(j % 7)
			}
			bufs = append(bufs, b)
			metas = append(metas, &pb.TensorMeta{Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{int64(n)}, ByteLength: uint64(n)})
		}
		s := newPipe()
		var sent, got counts
		h := &pb.ChunkHeader{Tensors: metas}
		if err := SendChunks(s, h, bufs, &sent, nil, codec); err != nil {
			t.Fatal(err)
		}
		h, err := RecvHeader(s)
		if err != nil || !h.Compressed {
			t.Fatalf("RecvHeader: %v, %v", h, err)
		}
		rc := receiver(p, &got)
		rc.Compressed = true
		out, err := RecvBuffers(ctx, s, h.Tensors, rc)
		if err != nil {
			t.Fatalf("%v: %v", codec, err)
		}
		for i := range bufs {
			if !bytes.Equal(out[i].Bytes(), bufs[i].Bytes()) {
				t.Errorf("%v: tensor %d differs", codec, i)
			}
			out[i].Release()
			bufs[i].Release()
		}
		if got.compressed.Load() != 1 || got.saved.Load() <= 0 || sent.stream.Load() != got.stream.Load() || sent.stream.Load() >= ChunkSize {
			t.Errorf("%v: %d compressed, %d saved, %d bytes sent, %d received", codec, got.compressed.Load(), got.saved.Load(), sent.stream.Load(), got.stream.Load())
		}
	}
	for _, tc := range []struct {
		name  string
		chunk []byte
		want  codes.Code
	}{
		{"corrupt", func() []byte {
			c := zchunk.AppendChunk(nil, zchunk.S2, bytes.Repeat([]byte{1}, 4096))
			c[zchunk.HeaderLen] ^= 0xff
			return c
		}(), codes.DataLoss},
		{"longer than its tensor", zchunk.AppendChunk(nil, zchunk.S2, bytes.Repeat([]byte{1}, 8192)), codes.InvalidArgument},
	} {
		s := newPipe()
		s.SendMsg(&chunkcodec.OutChunk{Data: mem.BufferSlice{mem.SliceBuffer(tc.chunk)}})
		rc := receiver(p, &counts{})
		rc.Compressed = true
		metas := []*pb.TensorMeta{{Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{4096}, ByteLength: 4096}}
		if _, err := RecvBuffers(ctx, s, metas, rc); status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}

// TestShortAndLong checks that a stream short of its tensors, or with
// bytes past them, fails InvalidArgument and releases what it allocated.
func TestShortAndLong(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name     string
		declared uint64
	}{{"short", 10}, {"long", 2}} {
		s := newPipe()
		if err := s.SendMsg(&chunkcodec.OutChunk{Data: mem.BufferSlice{mem.SliceBuffer(make([]byte, 5))}}); err != nil {
			t.Fatal(err)
		}
		metas := []*pb.TensorMeta{{Dtype: pb.DType_DTYPE_UINT8, Shape: []int64{int64(tc.declared)}, ByteLength: tc.declared}}
		_, err := RecvBuffers(ctx, s, metas, receiver(p, &counts{}))
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s stream: %v, want InvalidArgument", tc.name, err)
		}
	}
}

// blocked is a receiver that never receives anything.
type blocked struct{ done chan struct{} }

func (b blocked) RecvMsg(any) error { <-b.done; return io.EOF }

func TestReceiveIdle(t *testing.T) {
	b := blocked{done: make(chan struct{})}
	discarded := make(chan int, 1)
	_, err := ReceiveIdle(b, 20*time.Millisecond, func(r MsgReceiver) (int, error) {
		return 1, r.RecvMsg(nil)
	}, func(v int) { discarded <- v })
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("an idle stream: %v, want DeadlineExceeded", err)
	}
	close(b.done) // the stream ends: the receive fails, nothing to discard
	select {
	case v := <-discarded:
		t.Fatalf("discarded %d of a failed receive", v)
	case <-time.After(50 * time.Millisecond):
	}
}
