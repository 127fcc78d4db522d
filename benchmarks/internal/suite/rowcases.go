package suite

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// The rows cases: a server publishes a table of RowsOf rows of RowBytes
// (a paged KV cache, an embedding table), and each Fetch asks for Rows of
// them, distinct and scattered (drawn at random with a fixed seed, in
// random order), with rpc.Rows, landing with rpc.Into in a tensor of the
// stream's own. Alongside, on the same data plane and in alternating reps,
// two partners move the same bytes: one Fetch per row (Rows Fetches of
// one-row tensors, each Into a one-row tensor of the stream's), and one
// Fetch of a tensor of Rows rows back to back (Into the stream's tensor),
// the ceiling of a scattered read.

// rowsMode is how a rows session fetches the rows.
type rowsMode int

const (
	rowsScattered  rowsMode = iota // one Fetch with Rows(idx...) of the table
	rowsEach                       // one Fetch per row, of one-row tensors
	rowsContiguous                 // one Fetch of the rows back to back
)

func (m rowsMode) String() string {
	return [...]string{"scattered", "per-row", "contiguous"}[m]
}

// rowsEnv is the geometry of a rows measurement: the table has of rows of
// rowBytes; a Fetch moves idx, len(idx) rows, whose bytes are data (the
// source the streams' bytes are checked against), row j of data being
// row idx[j] of the table.
type rowsEnv struct {
	plane    string
	of       int
	rowBytes int
	idx      []int64
	data     []byte
	maxConc  int
}

// rowsIndices draws n distinct rows of of, in random order, from seed.
func rowsIndices(of, n int, seed uint64) []int64 {
	rng := rand.New(rand.NewPCG(seed, 0x6b76))
	perm := rng.Perm(of)
	idx := make([]int64, n)
	for i := range idx {
		idx[i] = int64(perm[i])
	}
	return idx
}

// stampRows writes row j's number into its first 8 bytes, so that rows
// tiled from a repeating payload differ and a row out of place fails the
// check.
func stampRows(data []byte, rowBytes int) {
	for j := 0; (j+1)*rowBytes <= len(data); j++ {
		if rowBytes >= 8 {
			binary.LittleEndian.PutUint64(data[j*rowBytes:], uint64(j)^0x726f77737461)
		}
	}
}

// rowsKey names the table, rowKey(j) the per-row partner's row j and
// contiguousKey the contiguous partner's tensor.
const (
	rowsKey       = "kv.cache"
	contiguousKey = "kv.contiguous"
)

func rowKey(j int) string { return "kv.row." + strconv.Itoa(j) }

// trpcRowsSession is a server publishing what mode fetches, and a client.
type trpcRowsSession struct {
	mode   rowsMode
	env    *rowsEnv
	server *rpc.Server
	client *rpc.Client
}

// openRows opens the session of mode for env.
func openRows(ctx context.Context, env *rowsEnv, mode rowsMode) (session, error) {
	n := len(env.idx)
	tableBytes := int64(env.of) * int64(env.rowBytes)
	fetched := int64(len(env.data))
	s := &trpcRowsSession{mode: mode, env: env}
	var err error
	// The client holds, per stream, one tensor of the rows and (per-row
	// mode) as many one-row tensors.
	if s.server, err = rpc.NewServer(serverOptions(trpcOptions([]string{env.plane}, tableBytes, tableBytes+2*fetched))...); err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.server.Close()
		return nil, err
	}
	go s.server.Serve(lis)
	fail := func(err error) (session, error) {
		if s.client != nil {
			s.client.Close()
		}
		s.server.Stop()
		return nil, err
	}
	publish := func(key string, rows int, fill func(b []byte)) error {
		t, err := s.server.NewTensor(ctx, zerocopy.Uint8, []int64{int64(rows), int64(env.rowBytes)})
		if err != nil {
			return err
		}
		fill(t.Bytes())
		err = s.server.Publish(ctx, key, t)
		t.Release()
		return err
	}
	rb := env.rowBytes
	switch mode {
	case rowsScattered:
		// Rows nobody asks for hold their own number in every byte, so
		// a wrong row cannot pass for a right one.
		err = publish(rowsKey, env.of, func(b []byte) {
			for r := range env.of {
				row := b[r*rb : (r+1)*rb]
				for i := range row {
					row[i] = byte(r) ^ 0xa5
				}
			}
			for j, r := range env.idx {
				copy(b[int(r)*rb:(int(r)+1)*rb], env.data[j*rb:])
			}
		})
	case rowsEach:
		for j := 0; j < n && err == nil; j++ {
			err = publish(rowKey(j), 1, func(b []byte) { copy(b, env.data[j*rb:(j+1)*rb]) })
		}
	case rowsContiguous:
		err = publish(contiguousKey, n, func(b []byte) { copy(b, env.data) })
	}
	if err != nil {
		return fail(err)
	}
	if s.client, err = rpc.Dial(ctx, lis.Addr().String(), dialOptions(trpcOptions([]string{env.plane}, fetched, 2*fetched*int64(env.maxConc)))...); err != nil {
		return fail(err)
	}
	if got := s.client.Transport(); got != env.plane {
		return fail(fmt.Errorf("negotiated %s, not %s: %s", got, env.plane, rejections(s.client)))
	}
	return s, nil
}

func (s *trpcRowsSession) transport() string { return s.client.Transport() }

func (s *trpcRowsSession) close() error {
	err := s.client.Close()
	s.server.Stop()
	return err
}

// newStream allocates the stream's destinations in the client's pool, as
// a caller with memory of its own for the rows would.
func (s *trpcRowsSession) newStream() (stream, error) {
	ctx := context.Background()
	n, rb := len(s.env.idx), int64(s.env.rowBytes)
	st := &trpcRowsStream{s: s}
	var err error
	if st.dst, err = s.client.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n), rb}); err != nil {
		return nil, err
	}
	if s.mode == rowsEach {
		st.rows = make([]*rpc.Tensor, n)
		for j := range st.rows {
			if st.rows[j], err = s.client.NewTensor(ctx, zerocopy.Uint8, []int64{1, rb}); err != nil {
				st.close()
				return nil, err
			}
		}
	}
	return st, nil
}

// trpcRowsStream fetches the rows into dst, or (per-row) each into its
// one-row tensor.
type trpcRowsStream struct {
	s    *trpcRowsSession
	dst  *rpc.Tensor
	rows []*rpc.Tensor
}

func (t *trpcRowsStream) do(ctx context.Context) error {
	s := t.s
	var err error
	switch s.mode {
	case rowsScattered:
		_, err = s.client.Fetch(ctx, rowsKey, rpc.Rows(s.env.idx...), rpc.Into(t.dst))
	case rowsEach:
		for j, r := range t.rows {
			if _, err = s.client.Fetch(ctx, rowKey(j), rpc.Into(r)); err != nil {
				break
			}
		}
	case rowsContiguous:
		_, err = s.client.Fetch(ctx, contiguousKey, rpc.Into(t.dst))
	}
	return err
}

// received is the rows in order: dst, into which the per-row stream
// gathers its one-row tensors first (outside the timed region, as every
// check is).
func (t *trpcRowsStream) received() []byte {
	if t.s.mode == rowsEach {
		b := t.dst.Bytes()
		for j, r := range t.rows {
			copy(b[j*t.s.env.rowBytes:], r.Bytes())
		}
	}
	return t.dst.Bytes()
}

func (t *trpcRowsStream) close() error {
	t.dst.Release()
	for _, r := range t.rows {
		r.Release()
	}
	return nil
}
