package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// moves records how each Fetch of a client moved its bytes
// (CallInfo.Moved).
type moves struct {
	mu   sync.Mutex
	last string
}

func (m *moves) interceptor() rpc.Interceptor {
	return func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		err := next(ctx)
		m.mu.Lock()
		m.last = info.Moved
		m.mu.Unlock()
		return err
	}
}

func (m *moves) get() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.last
}

// fetchAs fetches key, checks its bytes and shape against want and
// returns how they moved.
func fetchAs(t *testing.T, c *rpc.Client, m *moves, key string, want []byte, shape []int64) string {
	t.Helper()
	got, err := c.Fetch(ctxT(t), key)
	if err != nil {
		t.Fatalf("Fetch %q: %v", key, err)
	}
	defer got.Release()
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatalf("Fetch %q: %d bytes differ from the %d published", key, len(got.Bytes()), len(want))
	}
	if fmt.Sprint(got.Shape()) != fmt.Sprint(shape) {
		t.Fatalf("Fetch %q: shape %v, want %v", key, got.Shape(), shape)
	}
	return m.get()
}

func publishShaped(t *testing.T, s *rpc.Server, key string, dtype zerocopy.DType, shape []int64, seed byte) []byte {
	t.Helper()
	n, err := zerocopy.ByteSize(dtype, shape)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, n)
	pattern(b, seed)
	zt, err := zerocopy.New(dtype, shape, b)
	if err != nil {
		t.Fatal(err)
	}
	w := rpc.WrapTensor(zt)
	defer w.Release()
	if err := s.Publish(ctxT(t), key, w); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestFetchLanding: on tcp, a Fetch of a key fetched before lands (the
// server Writes the bytes into the client's pool before it answers) when
// the tensor fits the size it had; one that grew is read as before, and
// lands from the next Fetch on; a smaller one lands in the larger
// landing. On each of the server's Fetch paths: answered where the frame
// was read, with inline interceptors, in a goroutine (an interceptor that
// may block), and with checksums.
func TestFetchLanding(t *testing.T) {
	noop := func(ctx context.Context, _ *rpc.CallInfo, next func(context.Context) error) error { return next(ctx) }
	for _, tc := range []struct {
		name string
		srv  []rpc.ServerOption
		cli  []rpc.DialOption
	}{
		{"answered-at-once", nil, nil},
		{"inline-interceptors", []rpc.ServerOption{rpc.WithInlineInterceptors(noop)}, nil},
		{"goroutine", []rpc.ServerOption{rpc.WithInterceptors(noop)}, nil},
		{"checksums", []rpc.ServerOption{rpc.WithChecksums(true)}, nil},
		// A user's gRPC options on both sides: the session's calls are
		// frames all the same, and land.
		{"grpc-options", []rpc.ServerOption{rpc.WithGRPCServerOptions(grpc.UnaryInterceptor(passUnary), grpc.StreamInterceptor(passStream), grpc.MaxRecvMsgSize(64<<20))},
			[]rpc.DialOption{rpc.WithGRPCDialOptions(grpc.WithUnaryInterceptor(passUnaryClient), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &moves{}
			s, c := pair(t, rpc.TransportTCP, tc.srv, append(tc.cli, rpc.WithInterceptors(m.interceptor())))
			f32 := zerocopy.Float32
			want := publishShaped(t, s, "w", f32, []int64{16, 1024}, 1) // 64 KiB
			if got := fetchAs(t, c, m, "w", want, []int64{16, 1024}); got != rpc.MovedPulled {
				t.Errorf("first Fetch: moved %q, want %q (nothing known of the key yet)", got, rpc.MovedPulled)
			}
			for i := range 3 {
				if got := fetchAs(t, c, m, "w", want, []int64{16, 1024}); got != rpc.MovedLanded {
					t.Errorf("Fetch %d: moved %q, want %q", i+2, got, rpc.MovedLanded)
				}
			}
			if cs, ss := c.Stats(), s.Stats(); cs.Landed != 3 || ss.Landed != 3 {
				t.Errorf("Landed: client %d, server %d, want 3 and 3", cs.Landed, ss.Landed)
			}
			// Grown: read as before, then landed.
			want = publishShaped(t, s, "w", f32, []int64{32, 1024}, 2)
			if got := fetchAs(t, c, m, "w", want, []int64{32, 1024}); got != rpc.MovedPulled {
				t.Errorf("Fetch of the grown tensor: moved %q, want %q", got, rpc.MovedPulled)
			}
			if got := fetchAs(t, c, m, "w", want, []int64{32, 1024}); got != rpc.MovedLanded {
				t.Errorf("second Fetch of the grown tensor: moved %q, want %q", got, rpc.MovedLanded)
			}
			// Shrunk, another dtype: lands in the larger landing.
			want = publishShaped(t, s, "w", zerocopy.Uint8, []int64{40000}, 3)
			if got := fetchAs(t, c, m, "w", want, []int64{40000}); got != rpc.MovedLanded {
				t.Errorf("Fetch of the shrunk tensor: moved %q, want %q", got, rpc.MovedLanded)
			}
			// Inline-sized: inline, whatever the key's size was.
			want = publishShaped(t, s, "w", zerocopy.Uint8, []int64{4096}, 4)
			if got := fetchAs(t, c, m, "w", want, []int64{4096}); got != rpc.MovedInline {
				t.Errorf("Fetch of a 4 KiB tensor: moved %q, want %q", got, rpc.MovedInline)
			}
		})
	}
}

// TestFetchLandingOff: either side's WithFetchLanding(0) turns landing
// off, and a tensor past the server's bound is read as before.
func TestFetchLandingOff(t *testing.T) {
	for _, tc := range []struct {
		name string
		srv  []rpc.ServerOption
		cli  []rpc.DialOption
		n    int
	}{
		{"client-off", nil, []rpc.DialOption{rpc.WithFetchLanding(0)}, 64 << 10},
		{"server-off", []rpc.ServerOption{rpc.WithFetchLanding(0)}, nil, 64 << 10},
		{"past-the-bound", []rpc.ServerOption{rpc.WithFetchLanding(100 << 10)}, nil, 128 << 10},
		{"past-the-client-bound", nil, []rpc.DialOption{rpc.WithFetchLanding(100 << 10)}, 128 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &moves{}
			s, c := pair(t, rpc.TransportTCP, tc.srv, append(tc.cli, rpc.WithInterceptors(m.interceptor())))
			want := publishBytes(t, s, "w", tc.n, 5)
			for i := range 3 {
				if got := fetchAs(t, c, m, "w", want, []int64{int64(tc.n)}); got != rpc.MovedPulled {
					t.Errorf("Fetch %d: moved %q, want %q", i+1, got, rpc.MovedPulled)
				}
			}
			if cs, ss := c.Stats(), s.Stats(); cs.Landed != 0 || ss.Landed != 0 {
				t.Errorf("Landed: client %d, server %d, want none", cs.Landed, ss.Landed)
			}
		})
	}
}

// TestFetchLandingCompressed: a session that compresses lands what is too
// small to compress, and reads what its mode would compress.
func TestFetchLandingCompressed(t *testing.T) {
	m := &moves{}
	opts := []rpc.Option{rpc.WithCompression(rpc.CompressionS2)}
	s, c := pair(t, rpc.TransportTCP, asServer(opts), append(asDial(opts), rpc.WithInterceptors(m.interceptor())))
	small := publishBytes(t, s, "small", 64<<10, 6)
	big := make([]byte, 2<<20) // compressible: s2 shrinks it
	for i := range big {
		big[i] = byte(i / 4096)
	}
	zt, _ := zerocopy.New(zerocopy.Uint8, []int64{int64(len(big))}, big)
	w := rpc.WrapTensor(zt)
	if err := s.Publish(ctxT(t), "big", w); err != nil {
		t.Fatal(err)
	}
	w.Release()
	for range 2 {
		fetchAs(t, c, m, "small", small, []int64{64 << 10})
		if got := fetchAs(t, c, m, "big", big, []int64{2 << 20}); got != rpc.MovedPulled {
			t.Errorf("Fetch of 2 MiB on an s2 session: moved %q, want %q", got, rpc.MovedPulled)
		}
	}
	if got := fetchAs(t, c, m, "small", small, []int64{64 << 10}); got != rpc.MovedLanded {
		t.Errorf("Fetch of 64 KiB on an s2 session: moved %q, want %q", got, rpc.MovedLanded)
	}
	if st := c.Stats(); st.CompressedTransfers == 0 {
		t.Errorf("no Fetch was compressed: %+v", st)
	}
}

// TestFetchLandingAbandoned: a Fetch given up while its landing is
// granted (it waits for its key) frees the landing once the server's
// answer comes, and the next Fetch of the key lands.
func TestFetchLandingAbandoned(t *testing.T) {
	m := &moves{}
	s, c := pair(t, rpc.TransportTCP, nil, []rpc.DialOption{rpc.WithInterceptors(m.interceptor())})
	want := publishBytes(t, s, "w", 64<<10, 7)
	fetchAs(t, c, m, "w", want, []int64{64 << 10})
	before := c.Pool().Stats().InUse
	s.Unpublish("w")
	ctx, cancel := context.WithTimeout(ctxT(t), 50*time.Millisecond)
	defer cancel()
	_, err := c.Fetch(ctx, "w", rpc.WaitForKey())
	if status.Code(err) != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fetch of an unpublished key until a deadline: %v, want DeadlineExceeded", err)
	}
	waitFor(t, "the abandoned landing to be freed", func() bool { return c.Pool().Stats().InUse == before })
	want = publishBytes(t, s, "w", 64<<10, 8)
	if got := fetchAs(t, c, m, "w", want, []int64{64 << 10}); got != rpc.MovedLanded {
		t.Errorf("Fetch after the abandoned one: moved %q, want %q", got, rpc.MovedLanded)
	}
}

// TestFetchLandingStreams: concurrent Fetches of keys of several sizes,
// republished meanwhile, each get their own tensor's bytes.
func TestFetchLandingStreams(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, nil, nil)
	const keys, rounds = 8, 20
	var mu sync.Mutex
	wants := map[string][]byte{}
	publish := func(k, round int) {
		key := fmt.Sprint("k", k)
		b := publishBytes(t, s, key, (k+1)*24<<10+round*4096, byte(k*rounds+round))
		mu.Lock()
		wants[key] = b
		mu.Unlock()
	}
	for k := range keys {
		publish(k, 0)
	}
	var wg sync.WaitGroup
	errs := make(chan error, keys*2)
	for k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprint("k", k)
			for r := range rounds {
				if r%5 == 4 && k%2 == 0 {
					publish(k, r) // the only publisher of this key: its Fetches see what it published
				}
				got, err := c.Fetch(ctxT(t), key)
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				want := wants[key]
				mu.Unlock()
				if !bytes.Equal(got.Bytes(), want) {
					errs <- fmt.Errorf("%s round %d: %d bytes, not the %d published", key, r, len(got.Bytes()), len(want))
				}
				got.Release()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if st := c.Stats(); st.Landed == 0 {
		t.Errorf("no Fetch landed: %+v", st)
	}
}

// TestFetchLandingInto: a tcp Fetch into a tensor of the caller's lands
// in that tensor's own memory from the first Fetch on (its size is
// known): caller memory, or pool memory of the client's. A tensor of
// another shape is refused as before, its memory untouched; so is one
// too small.
func TestFetchLandingInto(t *testing.T) {
	m := &moves{}
	s, c := pair(t, rpc.TransportTCP, nil, []rpc.DialOption{rpc.WithInterceptors(m.interceptor())})
	want := publishShaped(t, s, "w", zerocopy.Float32, []int64{64, 256}, 9)
	ctx := ctxT(t)
	check := func(what string, dst *rpc.Tensor) {
		t.Helper()
		got, err := c.Fetch(ctx, "w", rpc.Into(dst))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got != dst || !bytes.Equal(dst.Bytes(), want) {
			t.Fatalf("%s: not the published bytes in the caller's tensor", what)
		}
		if mv := m.get(); mv != rpc.MovedLanded {
			t.Errorf("%s: moved %q, want %q", what, mv, rpc.MovedLanded)
		}
	}
	caller := make([]byte, len(want))
	zt, _ := zerocopy.New(zerocopy.Float32, []int64{64, 256}, caller)
	own := rpc.WrapTensor(zt)
	inUse := c.Pool().Stats().InUse
	check("caller memory", own)
	check("caller memory again", own)
	if got := c.Pool().Stats().InUse; got != inUse {
		t.Errorf("landing in caller memory used %d bytes of the pool", got-inUse)
	}
	pooled, err := c.NewTensor(ctx, zerocopy.Float32, []int64{64, 256})
	if err != nil {
		t.Fatal(err)
	}
	check("pool memory", pooled)
	pooled.Release()
	own.Release()

	for _, shape := range [][]int64{{128, 128}, {64, 255}} {
		b := bytes.Repeat([]byte{0xee}, int(4*shape[0]*shape[1]))
		zt, _ := zerocopy.New(zerocopy.Float32, shape, b)
		dst := rpc.WrapTensor(zt)
		_, err := c.Fetch(ctx, "w", rpc.Into(dst))
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("Into a %v tensor: %v, want InvalidArgument", shape, err)
		}
		if bytes.Count(b, []byte{0xee}) != len(b) {
			t.Errorf("Into a %v tensor: its memory was written", shape)
		}
		dst.Release()
	}
	if st := c.Stats(); st.Landed != 3 || st.Copies != 0 {
		t.Errorf("client stats: %d landed, %d copies; want 3 and none", st.Landed, st.Copies)
	}
}

// TestFetchLandingIntoAbandoned: a Fetch into caller memory given up
// while its landing is granted returns only once the grant is revoked:
// nothing the server writes later reaches that memory.
func TestFetchLandingIntoAbandoned(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, nil, nil)
	b := bytes.Repeat([]byte{0xee}, 64<<10)
	zt, _ := zerocopy.New(zerocopy.Uint8, []int64{64 << 10}, b)
	dst := rpc.WrapTensor(zt)
	defer dst.Release()
	ctx, cancel := context.WithTimeout(ctxT(t), 50*time.Millisecond)
	defer cancel()
	_, err := c.Fetch(ctx, "later", rpc.WaitForKey(), rpc.Into(dst))
	if status.Code(err) != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fetch into caller memory of an unpublished key until a deadline: %v, want DeadlineExceeded", err)
	}
	want := publishBytes(t, s, "later", 64<<10, 10)
	got, err := c.Fetch(ctxT(t), "later")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Error("Fetch after the abandoned one: other bytes")
	}
	got.Release()
	if bytes.Count(b, []byte{0xee}) != len(b) {
		t.Error("the abandoned Fetch's caller memory was written after it returned")
	}
}

// TestCallReplyLanding: on tcp, a Call's reply tensors that do not go
// inline land in buffers the client grants with its request, sized as
// the method's last reply's were: each that fits, in order; one that
// grew is read as before, and lands from the next Call on. For handlers
// run where their frames are read and in goroutines.
func TestCallReplyLanding(t *testing.T) {
	for _, inline := range []bool{false, true} {
		t.Run(fmt.Sprint("inline=", inline), func(t *testing.T) {
			s, c := pair(t, rpc.TransportTCP, nil, nil)
			var mu sync.Mutex
			sizes := []int{64 << 10, 100, 128 << 10}
			var opts []rpc.HandlerOption
			if inline {
				opts = append(opts, rpc.Inline())
			}
			s.Handle("make", func(ctx context.Context, in *rpc.Message) (*rpc.Message, error) {
				mu.Lock()
				ns := slices.Clone(sizes)
				mu.Unlock()
				out := &rpc.Message{Metadata: in.Metadata}
				for i, n := range ns {
					b := make([]byte, n)
					pattern(b, byte(i+int(in.Metadata[0])))
					zt, _ := zerocopy.New(zerocopy.Uint8, []int64{int64(n)}, b)
					out.Tensors = append(out.Tensors, rpc.WrapTensor(zt))
				}
				return out, nil
			}, opts...)
			call := func(round byte, wantLanded int64) {
				t.Helper()
				before := c.Stats().Landed
				reply, err := c.Call(ctxT(t), "make", &rpc.Message{Metadata: []byte{round}})
				if err != nil {
					t.Fatalf("round %d: %v", round, err)
				}
				defer reply.Release()
				mu.Lock()
				ns := slices.Clone(sizes)
				mu.Unlock()
				if len(reply.Tensors) != len(ns) {
					t.Fatalf("round %d: %d tensors, want %d", round, len(reply.Tensors), len(ns))
				}
				for i, n := range ns {
					want := make([]byte, n)
					pattern(want, byte(i+int(round)))
					if !bytes.Equal(reply.Tensors[i].Bytes(), want) {
						t.Fatalf("round %d: reply tensor %d (%d bytes) differs", round, i, n)
					}
				}
				if got := c.Stats().Landed - before; got != wantLanded {
					t.Errorf("round %d: %d reply tensors landed, want %d", round, got, wantLanded)
				}
			}
			call(1, 0) // nothing known of the method yet
			call(2, 2)
			call(3, 2)
			mu.Lock()
			sizes = []int{64 << 10, 200 << 10, 32 << 10} // the second grew, the third came out of inline
			mu.Unlock()
			call(4, 1)
			call(5, 3)
			mu.Lock()
			sizes = []int{50 << 10}
			mu.Unlock()
			call(6, 1)
			if st := s.Stats(); st.Landed != 9 {
				t.Errorf("server: %d landed, want 9", st.Landed)
			}
		})
	}
}

func passUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	return h(ctx, req)
}

func passStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	return h(srv, ss)
}

func passUnaryClient(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	return invoke(ctx, method, req, reply, cc, opts...)
}
