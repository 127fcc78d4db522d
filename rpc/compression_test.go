package rpc_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/payloadtest"
	"github.com/tensorrpc/tensorrpc/internal/zchunk"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rpctest"
)

// compressKinds are the payloads the compression tests move.
var compressKinds = []string{"sparse-f32", "lowent-f16", "random"}

// payloadTensor is a Client tensor of n bytes of payload kind.
func payloadTensor(t *testing.T, c *rpc.Client, kind string, n int, seed uint64) *rpc.Tensor {
	t.Helper()
	x := newBytes(t, c, n, 0)
	payloadtest.Fill(kind, x.Bytes(), seed)
	return x
}

// TestCompressionRoundTrips: with every mode on both sides, every payload
// and sizes from 0 B to 64 MiB (under the race detector, 16 and 64 MiB
// of one payload, and zstd up to 3 MiB) go
// through Send, Fetch and a Call's request and reply exact on tcp and the
// gRPC fallback. s2 and zstd compress the compressible tensors of at
// least 1 MiB that cross (on the fallback, all but a Call's reply), and
// Stats and CallInfo say so; off never does. What auto decides depends on
// the speeds it measures, which a test does not assert (tensorbench
// -sections slowlink measures it).
func TestCompressionRoundTrips(t *testing.T) {
	sizes := []int{0, 1, 4 << 10, 1<<20 - 1, 1 << 20, 3<<20 + 5, 16 << 20, 64 << 20}
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportGRPC} {
		for _, mode := range []string{rpc.CompressionOff, rpc.CompressionAuto, rpc.CompressionS2, rpc.CompressionZstd} {
			t.Run(plane+"/"+mode, func(t *testing.T) {
				var infos []rpc.CallInfo
				record := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
					err := next(ctx)
					infos = append(infos, *info)
					return err
				}
				e := start(t, plane, []rpc.ServerOption{rpc.WithCompression(mode)},
					[]rpc.DialOption{rpc.WithCompression(mode), rpc.WithInterceptors(record)})
				e.srv.Handle("echo", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
					return &rpc.Message{Tensors: req.Tensors}, nil
				})
				ctx := testCtx(t)
				for _, kind := range compressKinds {
					for i, n := range sizes {
						if rpctest.Race && n >= 16<<20 && (kind != "sparse-f32" || mode == rpc.CompressionZstd) {
							// The race detector is slow: one payload of the
							// two largest sizes, and zstd (pure Go,
							// instrumented) only up to 3 MiB.
							continue
						}
						x := payloadTensor(t, e.c, kind, n, uint64(i))
						key := fmt.Sprintf("%s-%d", kind, n)
						if err := e.c.Send(ctx, key, x); err != nil {
							t.Fatalf("Send %s: %v", key, err)
						}
						infos = infos[:0]
						got, err := e.c.Fetch(ctx, key)
						if err != nil {
							t.Fatalf("Fetch %s: %v", key, err)
						}
						if !bytes.Equal(got.Bytes(), x.Bytes()) {
							t.Fatalf("Fetch %s: wrong bytes", key)
						}
						got.Release()
						// What CallInfo says of the Fetch: nothing under
						// 1 MiB or when off; the codec when one was asked
						// for (on the fallback's streams, "off" when every
						// chunk was stored: random bytes); in auto, some
						// answer.
						want := ""
						if n >= 1<<20 && mode != rpc.CompressionOff {
							want = rpc.CompressionOff
							if mode == rpc.CompressionS2 || mode == rpc.CompressionZstd {
								want = mode
							}
						}
						said := ""
						if len(infos) == 1 {
							said = infos[0].Compression
						}
						ok := said == want || plane == rpc.TransportGRPC && kind == "random" && said == rpc.CompressionOff
						if mode == rpc.CompressionAuto && said != "" {
							ok = true // whether a codec wins depends on the speeds measured
						}
						if len(infos) != 1 || !ok {
							t.Errorf("Fetch %s: CallInfo %+v, want compression %q", key, infos, want)
						} else if want == mode && kind == "sparse-f32" && infos[0].WireBytes > int64(n)/2 {
							t.Errorf("Fetch %s: %d bytes on the wire", key, infos[0].WireBytes)
						}
						if n == 64<<20 && rpctest.Race {
							x.Release() // Send and Fetch will do: the race detector is slow
							continue
						}
						reply, err := e.c.Call(ctx, "echo", &rpc.Message{Tensors: []*rpc.Tensor{x}})
						if err != nil {
							t.Fatalf("Call %s: %v", key, err)
						}
						if len(reply.Tensors) != 1 || !bytes.Equal(reply.Tensors[0].Bytes(), x.Bytes()) {
							t.Fatalf("Call %s: wrong reply", key)
						}
						reply.Release()
						x.Release()
					}
				}
				cs, ss := e.c.Stats(), e.srv.Stats()
				compresses := mode == rpc.CompressionS2 || mode == rpc.CompressionZstd
				if mode == rpc.CompressionAuto {
					// What auto does depends on the speeds it measures
					// (the fallback's streams, or tcp under the race
					// detector, move slower than a codec on sparse data):
					// tensorbench -sections slowlink measures it.
					return
				}
				if (cs.CompressedTransfers > 0) != compresses || (ss.CompressedTransfers > 0) != compresses {
					t.Errorf("compressed transfers: client %d, server %d; want some: %v", cs.CompressedTransfers, ss.CompressedTransfers, compresses)
				}
				if compresses && (cs.CompressionSavedBytes <= 0 || ss.CompressionSavedBytes <= 0) {
					t.Errorf("bytes saved: client %d, server %d", cs.CompressionSavedBytes, ss.CompressionSavedBytes)
				}
			})
		}
	}
}

// TestCompressionNegotiated: a session compresses only when both sides
// allow it: one side off keeps the other's s2 from compressing either
// way.
func TestCompressionNegotiated(t *testing.T) {
	for _, c := range []struct{ server, client string }{{rpc.CompressionOff, rpc.CompressionS2}, {rpc.CompressionS2, rpc.CompressionOff}} {
		t.Run(c.server+"-"+c.client, func(t *testing.T) {
			e := start(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithCompression(c.server)}, []rpc.DialOption{rpc.WithCompression(c.client)})
			ctx := testCtx(t)
			x := payloadTensor(t, e.c, "sparse-f32", 4<<20, 1)
			defer x.Release()
			if err := e.c.Send(ctx, "k", x); err != nil {
				t.Fatal(err)
			}
			got, err := e.c.Fetch(rpc.UseCompression(ctx, rpc.CompressionZstd), "k")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), x.Bytes()) {
				t.Fatal("wrong bytes")
			}
			got.Release()
			if n := e.c.Stats().CompressedTransfers + e.srv.Stats().CompressedTransfers; n != 0 {
				t.Errorf("%d transfers compressed", n)
			}
		})
	}
}

// TestUseCompression: a call's own mode overrides the session's, for the
// client's reads and, carried in the call's metadata, the server's; an
// unknown mode fails the call, and an unknown WithCompression or
// TENSORRPC_COMPRESSION fails NewServer and Dial, with InvalidArgument.
func TestUseCompression(t *testing.T) {
	e := start(t, rpc.TransportTCP, nil, nil) // auto on both sides: nothing compresses on loopback
	ctx := testCtx(t)
	x := payloadTensor(t, e.c, "sparse-f32", 4<<20, 2)
	defer x.Release()
	if err := e.c.Send(rpc.UseCompression(ctx, rpc.CompressionS2), "k", x); err != nil {
		t.Fatal(err)
	}
	if n := e.srv.Stats().CompressedTransfers; n != 1 {
		t.Errorf("the server compressed %d reads of a Send with s2, want 1", n)
	}
	for _, mode := range []string{rpc.CompressionZstd, rpc.CompressionOff} {
		before := e.c.Stats().CompressedTransfers
		got, err := e.c.Fetch(rpc.UseCompression(ctx, mode), "k")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes(), x.Bytes()) {
			t.Fatal("wrong bytes")
		}
		got.Release()
		if n := e.c.Stats().CompressedTransfers - before; n != map[string]int64{rpc.CompressionZstd: 1, rpc.CompressionOff: 0}[mode] {
			t.Errorf("Fetch with %s: %d compressed", mode, n)
		}
	}
	if _, err := e.c.Fetch(rpc.UseCompression(ctx, "lz4"), "k"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Fetch with an unknown mode: %v, want InvalidArgument", err)
	}
	if _, err := rpc.NewServer(rpc.WithCompression("brotli")); status.Code(err) != codes.InvalidArgument {
		t.Errorf("NewServer with an unknown mode: %v", err)
	}
	if _, err := rpc.Dial(ctx, "127.0.0.1:1", insecureCreds(), rpc.WithCompression("brotli")); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Dial with an unknown mode: %v", err)
	}
	t.Setenv(rpc.EnvCompression, "fast")
	if _, err := rpc.NewServer(); status.Code(err) != codes.InvalidArgument {
		t.Errorf("NewServer with %s=fast: %v", rpc.EnvCompression, err)
	}
}

// TestCompressedGarbage: a peer whose compressed chunks lie (data cut
// short of what it encodes, data that decodes to more than the chunk
// declares, data that does not decode)
// fails the call that read them with DataLoss and leaks nothing (start's
// cleanup checks pools and goroutines); the session, whose stream cannot
// be followed past a lie, ends, and the Client opens a new one.
func TestCompressedGarbage(t *testing.T) {
	for _, lie := range []struct {
		name string
		f    func(chunk []byte)
	}{
		{"truncated: declares less data than it has", func(c []byte) {
			if zchunk.Codec(c[0]) != zchunk.Stored {
				binary.LittleEndian.PutUint32(c[8:], binary.LittleEndian.Uint32(c[8:])-10)
			}
		}},
		{"inflates past its declared raw size", func(c []byte) {
			if zchunk.Codec(c[0]) != zchunk.Stored {
				binary.LittleEndian.PutUint32(c[4:], binary.LittleEndian.Uint32(c[4:])-1)
			}
		}},
		{"bad data", func(c []byte) {
			if zchunk.Codec(c[0]) != zchunk.Stored {
				for i := zchunk.HeaderLen; i < len(c) && i < zchunk.HeaderLen+16; i++ {
					c[i] ^= 0x5a
				}
			}
		}},
	} {
		t.Run(lie.name, func(t *testing.T) {
			e := start(t, rpc.TransportTCP, []rpc.ServerOption{rpc.WithCompression(rpc.CompressionS2)}, []rpc.DialOption{rpc.WithCompression(rpc.CompressionS2)})
			ctx := testCtx(t)
			x := payloadTensor(t, e.c, "sparse-f32", 2<<20, 3)
			defer x.Release()
			if err := e.c.Send(ctx, "k", x); err != nil {
				t.Fatal(err)
			}
			zchunk.SetTamper(lie.f)
			_, err := e.c.Fetch(ctx, "k")
			zchunk.SetTamper(nil)
			if status.Code(err) != codes.DataLoss {
				t.Fatalf("Fetch of lying chunks: %v, want DataLoss", err)
			}
			// The lying session is over; calls may find it ending
			// (Unavailable) until it has, and then a new one opens.
			var got *rpc.Tensor
			for range 500 {
				if got, err = e.c.Fetch(ctx, "k"); status.Code(err) != codes.Unavailable {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if err != nil {
				t.Fatalf("Fetch after: %v", err)
			}
			if !bytes.Equal(got.Bytes(), x.Bytes()) {
				t.Error("wrong bytes after")
			}
			got.Release()
		})
	}
}

// TestCompressionWithChecksums: with checksums on (WithChecksums), a
// tensor that crossed compressed, on tcp and the fallback, both ways,
// verifies: the CRC covers the raw bytes, computed before compressing and
// checked after decompressing, so a chunk changed on the way fails the
// call with DataLoss even when it decodes.
func TestCompressionWithChecksums(t *testing.T) {
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportGRPC} {
		t.Run(plane, func(t *testing.T) {
			opts := []rpc.Option{rpc.WithCompression(rpc.CompressionS2), rpc.WithChecksums(true)}
			e := start(t, plane, []rpc.ServerOption{opts[0], opts[1]}, []rpc.DialOption{opts[0], opts[1]})
			ctx := testCtx(t)
			x := payloadTensor(t, e.c, "sparse-f32", 4<<20, 5)
			defer x.Release()
			if err := e.c.Send(ctx, "k", x); err != nil {
				t.Fatal(err)
			}
			got, err := e.c.Fetch(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), x.Bytes()) {
				t.Error("wrong bytes")
			}
			got.Release()
			if c, s := e.c.Stats().CompressedTransfers, e.srv.Stats().CompressedTransfers; c == 0 || s == 0 {
				t.Errorf("compressed transfers: client %d, server %d; want both", c, s)
			}
			// A chunk whose bytes change on the way but still decode (a
			// stored one: random bytes do not compress) is caught by the
			// checksum of the raw bytes.
			r := payloadTensor(t, e.c, "random", 2<<20, 6)
			defer r.Release()
			if err := e.c.Send(ctx, "r", r); err != nil {
				t.Fatal(err)
			}
			zchunk.SetTamper(func(c []byte) {
				if zchunk.Codec(c[0]) == zchunk.Stored {
					c[zchunk.HeaderLen+100] ^= 1
				}
			})
			_, err = e.c.Fetch(ctx, "r")
			zchunk.SetTamper(nil)
			if status.Code(err) != codes.DataLoss {
				t.Errorf("Fetch of a changed chunk: %v, want DataLoss", err)
			}
		})
	}
}
