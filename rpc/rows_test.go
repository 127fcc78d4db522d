package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// rowsPlanes are the planes the rows and caller-memory tests run on.
var rowsPlanes = []string{rpc.TransportTCP, rpc.TransportSHM, rpc.TransportGRPC}

// publishRows publishes a [rows, rowBytes] uint8 tensor whose row r is
// filled with a pattern of r, and returns its bytes.
func publishRows(t *testing.T, s *rpc.Server, key string, rows, rowBytes int, opts ...rpc.PublishOption) []byte {
	t.Helper()
	b := make([]byte, rows*rowBytes)
	for r := range rows {
		pattern(b[r*rowBytes:(r+1)*rowBytes], byte(r*7+1))
	}
	w := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{int64(rows), int64(rowBytes)}, b))
	if err := s.Publish(ctxT(t), key, w, opts...); err != nil {
		t.Fatal(err)
	}
	return b
}

// wantRows is rows idx of src (rows of rowBytes), back to back.
func wantRows(src []byte, rowBytes int, idx []int64) []byte {
	var out []byte
	for _, r := range idx {
		out = append(out, src[int(r)*rowBytes:(int(r)+1)*rowBytes]...)
	}
	return out
}

// guarded is caller memory of n bytes with guard bytes on both sides.
type guarded struct {
	all   []byte
	guard int
}

func newGuarded(n int) *guarded {
	g := &guarded{all: make([]byte, n+2*4096), guard: 4096}
	g.all[0] = 0xA5
	for k := 1; k < len(g.all); { // doubling copies: a byte loop is slow under the race detector
		k += copy(g.all[k:], g.all[:k])
	}
	return g
}

func (g *guarded) bytes() []byte { return g.all[g.guard : len(g.all)-g.guard] }

func (g *guarded) intact(t *testing.T) {
	t.Helper()
	for i, b := range g.all[:g.guard] {
		if b != 0xA5 {
			t.Fatalf("guard byte %d before the tensor was written: %#x", g.guard-i, b)
		}
	}
	for i, b := range g.all[len(g.all)-g.guard:] {
		if b != 0xA5 {
			t.Fatalf("guard byte %d after the tensor was written: %#x", i, b)
		}
	}
}

// TestFetchRows: Fetch with Rows returns exactly those rows, in the order
// asked (repeats and runs of neighbours included), small enough to come
// inline, large enough to be read from the server's memory, and from a
// source large enough to be granted on both lanes (read over both).
func TestFetchRows(t *testing.T) {
	for _, tr := range rowsPlanes {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, []rpc.ServerOption{rpc.WithLanes(2)}, []rpc.DialOption{rpc.WithLanes(2)})
			for _, sz := range []struct{ rows, rowBytes, n int }{{16, 16, 3}, {512, 4096, 200}, {1536, 8192, 300}} {
				key := fmt.Sprintf("t%d", sz.rowBytes)
				src := publishRows(t, s, key, sz.rows, sz.rowBytes)
				rng := rand.New(rand.NewPCG(1, uint64(sz.rowBytes)))
				idx := make([]int64, sz.n)
				for i := range idx {
					idx[i] = int64(rng.IntN(sz.rows))
				}
				if sz.n > 10 {
					copy(idx[5:], []int64{40, 41, 42, 43, 42, int64(sz.rows - 1)}) // a run, a repeat, the last row
				}
				got, err := c.Fetch(ctxT(t), key, rpc.Rows(idx...))
				if err != nil {
					t.Fatalf("Fetch %d rows of %d bytes: %v", sz.n, sz.rowBytes, err)
				}
				if sh := got.Shape(); len(sh) != 2 || sh[0] != int64(sz.n) || sh[1] != int64(sz.rowBytes) {
					t.Fatalf("shape %v, want [%d %d]", sh, sz.n, sz.rowBytes)
				}
				if !bytes.Equal(got.Bytes(), wantRows(src, sz.rowBytes, idx)) {
					t.Fatalf("%d rows of %d bytes: wrong bytes", sz.n, sz.rowBytes)
				}
				got.Release()
			}
		})
	}
}

// TestFetchRowsRefused: rows out of range, negative, or of a scalar fail
// with InvalidArgument, and nothing stays allocated on either side.
func TestFetchRowsRefused(t *testing.T) {
	for _, tr := range rowsPlanes {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			publishRows(t, s, "m", 64, 4096)
			scalar := rpc.WrapTensor(mustTensor(zerocopy.Float32, nil, make([]byte, 4)))
			if err := s.Publish(ctxT(t), "scalar", scalar); err != nil {
				t.Fatal(err)
			}
			before := c.Pool().Stats().InUse
			for name, tc := range map[string]struct {
				key string
				idx []int64
			}{
				"past the end": {"m", []int64{0, 64}},
				"negative":     {"m", []int64{-1}},
				"none":         {"m", []int64{}},
				"scalar":       {"scalar", []int64{0}},
			} {
				got, err := c.Fetch(ctxT(t), tc.key, rpc.Rows(tc.idx...))
				if status.Code(err) != codes.InvalidArgument {
					got.Release()
					t.Fatalf("%s: Fetch = %v, want InvalidArgument", name, err)
				}
			}
			if n := c.Pool().Stats().InUse; n != before {
				t.Fatalf("%d bytes of the client's pool in use after refused Fetches, %d before", n, before)
			}
		})
	}
}

// TestFetchInto: Fetch Into lands the tensor in the caller's memory and
// nowhere else, returns that tensor, and on tcp and shm copies nothing on
// the client; a tensor of another shape or dtype is refused before anything
// is written.
func TestFetchInto(t *testing.T) {
	for _, tr := range rowsPlanes {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			const rows, rowBytes = 256, 4096
			src := publishRows(t, s, "m", rows, rowBytes)
			for _, big := range []bool{false, true} {
				n, opts := rows*rowBytes, []rpc.FetchOption(nil)
				idx := []int64{3, 4, 5, 200, 7}
				want := src
				shape := []int64{rows, rowBytes}
				if !big {
					opts = append(opts, rpc.Rows(idx...))
					n, want, shape = len(idx)*rowBytes, wantRows(src, rowBytes, idx), []int64{int64(len(idx)), rowBytes}
				}
				g := newGuarded(n)
				dst := rpc.WrapTensor(mustTensor(zerocopy.Uint8, shape, g.bytes()))
				copies := c.Stats().Copies
				got, err := c.Fetch(ctxT(t), "m", append(opts, rpc.Into(dst))...)
				if err != nil {
					t.Fatalf("Fetch Into (%d bytes): %v", n, err)
				}
				if got != dst {
					t.Fatal("Fetch Into returned another tensor than Into's")
				}
				if !bytes.Equal(g.bytes(), want) {
					t.Fatalf("Fetch Into (%d bytes): wrong bytes", n)
				}
				g.intact(t)
				if d := c.Stats().Copies - copies; tr != rpc.TransportGRPC && big && d != 0 {
					t.Fatalf("Fetch Into of %d bytes on %s copied %d times on the client", n, tr, d)
				}
			}
			// Another shape, another dtype: refused, dst untouched.
			for name, tc := range map[string]struct {
				dtype zerocopy.DType
				shape []int64
			}{
				"shape": {zerocopy.Uint8, []int64{rows * rowBytes}},
				"dtype": {zerocopy.Int8, []int64{rows, rowBytes}},
			} {
				g := newGuarded(rows * rowBytes)
				zt, err := zerocopy.New(tc.dtype, tc.shape, g.bytes())
				if err != nil {
					t.Fatal(err)
				}
				if _, err := c.Fetch(ctxT(t), "m", rpc.Into(rpc.WrapTensor(zt))); status.Code(err) != codes.InvalidArgument {
					t.Fatalf("Fetch Into a tensor of another %s: %v, want InvalidArgument", name, err)
				}
				for i, b := range g.all {
					if b != 0xA5 {
						t.Fatalf("Fetch Into a tensor of another %s wrote byte %d", name, i)
					}
				}
			}
		})
	}
}

// TestSendRows: SendRows writes exactly the rows named of a tensor
// published Writable, in place (its owner, who published a NewTensor,
// sees them), on every plane; a tensor published without Writable is
// refused with PermissionDenied, rows out of range or named twice and a
// tensor of the wrong shape with InvalidArgument, and nothing is written.
func TestSendRows(t *testing.T) {
	for _, tr := range rowsPlanes {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			const rows, rowBytes = 128, 8192
			owned, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{rows, rowBytes})
			if err != nil {
				t.Fatal(err)
			}
			defer owned.Release()
			if err := s.Publish(ctxT(t), "w", owned, rpc.Writable()); err != nil {
				t.Fatal(err)
			}
			want := make([]byte, rows*rowBytes)
			for _, n := range []int{1, 3, 100} { // inline and read from the client
				idx := make([]int64, n)
				for i := range idx {
					idx[i] = int64((i*37 + n) % rows)
				}
				src := make([]byte, n*rowBytes)
				pattern(src, byte(n))
				for i, r := range idx {
					copy(want[int(r)*rowBytes:(int(r)+1)*rowBytes], src[i*rowBytes:])
				}
				w := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{int64(n), rowBytes}, src))
				if err := c.SendRows(ctxT(t), "w", idx, w); err != nil {
					t.Fatalf("SendRows of %d rows: %v", n, err)
				}
				if !bytes.Equal(owned.Bytes(), want) {
					t.Fatalf("after SendRows of %d rows the published tensor differs", n)
				}
				got, err := c.Fetch(ctxT(t), "w")
				if err != nil {
					t.Fatal(err)
				}
				same := bytes.Equal(got.Bytes(), want)
				got.Release()
				if !same {
					t.Fatalf("a Fetch after SendRows of %d rows differs", n)
				}
			}
			publishRows(t, s, "ro", rows, rowBytes)
			one := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{1, rowBytes}, make([]byte, rowBytes)))
			two := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{2, rowBytes}, make([]byte, 2*rowBytes)))
			narrow := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{1, rowBytes / 2}, make([]byte, rowBytes/2)))
			for name, tc := range map[string]struct {
				key  string
				idx  []int64
				src  *rpc.Tensor
				code codes.Code
			}{
				"not writable":  {"ro", []int64{0}, one, codes.PermissionDenied},
				"not published": {"none", []int64{0}, one, codes.NotFound},
				"out of range":  {"w", []int64{rows}, one, codes.InvalidArgument},
				"twice":         {"w", []int64{4, 4}, two, codes.InvalidArgument},
				"row shape":     {"w", []int64{0}, narrow, codes.InvalidArgument},
				"row count":     {"w", []int64{0, 1, 2}, two, codes.InvalidArgument},
			} {
				if err := c.SendRows(ctxT(t), tc.key, tc.idx, tc.src); status.Code(err) != tc.code {
					t.Fatalf("%s: SendRows = %v, want %v", name, err, tc.code)
				}
				if !bytes.Equal(owned.Bytes(), want) {
					t.Fatalf("%s: a refused SendRows wrote to the tensor", name)
				}
			}
		})
	}
}

// TestSendRowsConcurrent: 8 clients writing disjoint rows of one tensor at
// once all land.
func TestSendRowsConcurrent(t *testing.T) {
	for _, tr := range rowsPlanes {
		t.Run(tr, func(t *testing.T) {
			e := start(t, tr, nil, nil)
			s := e.srv
			const clients, per, rowBytes = 8, 16, 16 << 10
			owned, err := s.NewTensor(ctxT(t), zerocopy.Uint8, []int64{clients * per, rowBytes})
			if err != nil {
				t.Fatal(err)
			}
			defer owned.Release()
			if err := s.Publish(ctxT(t), "w", owned, rpc.Writable()); err != nil {
				t.Fatal(err)
			}
			errs := make(chan error, clients)
			for k := range clients {
				c := dialTo(t, e.addr, tr)
				go func() {
					idx := make([]int64, per)
					for i := range idx {
						idx[i] = int64(i*clients + k) // interleaved, disjoint
					}
					src := bytes.Repeat([]byte{byte(k + 1)}, per*rowBytes)
					errs <- c.SendRows(ctxT(t), "w", idx, rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{per, rowBytes}, src)))
				}()
			}
			for range clients {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
			b := owned.Bytes()
			for r := range clients * per {
				if want := byte(r%clients + 1); !bytes.Equal(b[r*rowBytes:(r+1)*rowBytes], bytes.Repeat([]byte{want}, rowBytes)) {
					t.Fatalf("row %d is not client %d's", r, want-1)
				}
			}
		})
	}
}

// dialTo dials another Client to the server at addr, restricted to
// transport, closed when the test ends (before the server stops).
func dialTo(t *testing.T, addr, transport string) *rpc.Client {
	t.Helper()
	ts := []string{transport}
	if transport != rpc.TransportGRPC {
		ts = append(ts, rpc.TransportGRPC)
	}
	c, err := rpc.Dial(ctxT(t), addr, rpc.WithTransports(ts...), testPool(), insecureCreds())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("client Close: %v", err)
		}
	})
	return c
}

// TestFetchIntoGivenUpWritesNothingAfter: a Fetch Into caller memory whose
// context ends while its Reads are under way returns only once none is:
// nothing lands in the caller's memory after Fetch returned.
func TestFetchIntoGivenUpWritesNothingAfter(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, nil, nil)
	const n = 256 << 20
	publishBytes(t, s, "big", n, 3)
	given := 0
	for try := 0; try < 20 && given < 3; try++ {
		g := newGuarded(n)
		dst := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{n}, g.bytes()))
		ctx, cancel := context.WithTimeout(ctxT(t), time.Duration(1+try)*time.Millisecond)
		_, err := c.Fetch(ctx, "big", rpc.Into(dst))
		cancel()
		if err == nil {
			continue // it finished in time
		}
		given++
		before := bytes.Clone(g.all)
		time.Sleep(50 * time.Millisecond)
		if !bytes.Equal(before, g.all) {
			t.Fatalf("a Fetch Into given up (%v) kept writing the caller's memory after it returned", err)
		}
		g.intact(t)
	}
	if given == 0 {
		t.Fatal("every Fetch of 256 MiB finished within its deadline (1-20 ms): the test checked nothing")
	}
}
