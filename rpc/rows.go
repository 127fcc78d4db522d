package rpc

import (
	"context"
	"fmt"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/rpc/internal/rendezvous"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Rows of a published tensor: Fetch(key, Rows(idx...)) reads some rows
// (indices along dimension 0), SendRows writes some. A row is everything
// below the first dimension: shape[1:], rowBytes bytes.

// MaxRows bounds the rows one Fetch or SendRows names (a request of them
// must fit what a server takes).
const MaxRows = 1 << 20

// rowBytesOf is the size of one row of a tensor of shape, and its rows.
func rowBytesOf(dtype zerocopy.DType, shape []int64) (rowBytes int64, rows int64, err error) {
	if len(shape) == 0 {
		return 0, 0, status.Error(codes.InvalidArgument, "tensorrpc: rows of a tensor without dimensions (a scalar)")
	}
	rowBytes = int64(dtype.Size())
	for _, d := range shape[1:] {
		rowBytes *= d
	}
	return rowBytes, shape[0], nil
}

// checkRows checks row indices against a tensor of n rows: every one in
// range, and with distinct, distinct ones (a write of the same row twice
// in one call has no defined result).
func checkRows(key string, idx []int64, n int64, distinct bool) error {
	if len(idx) == 0 {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: no rows named", key)
	}
	if len(idx) > MaxRows {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %d rows named, more than %d (MaxRows)", key, len(idx), MaxRows)
	}
	var seen map[int64]struct{}
	if distinct {
		seen = make(map[int64]struct{}, len(idx))
	}
	for i, r := range idx {
		if r < 0 || r >= n {
			return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: row index %d (at %d) out of range [0, %d)", key, r, i, n)
		}
		if distinct {
			if _, dup := seen[r]; dup {
				return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: row %d named twice in one write", key, r)
			}
			seen[r] = struct{}{}
		}
	}
	return nil
}

// rowsShape is the shape of len(idx) rows of a tensor of shape.
func rowsShape(shape []int64, n int) []int64 {
	return append([]int64{int64(n)}, shape[1:]...)
}

// rowsOfEntry checks a request for rows idx of the published entry e (of
// key) and returns a row's size.
func rowsOfEntry(key string, e rendezvous.Entry, idx []int64) (int64, error) {
	rowBytes, n, err := rowBytesOf(e.Tensor.DType(), e.Tensor.Shape())
	if err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %s", key, status.Convert(err).Message())
	}
	return rowBytes, checkRows(key, idx, n, false)
}

// gatherRows replaces e by a new pool tensor holding rows idx of it, back
// to back (one copy, counted): the answer of a rows Fetch where the client
// does not read them itself (inline answers, the fallback's streams). It
// takes over e's reference.
func (s *Server) gatherRows(ctx context.Context, ss *serverSession, key string, e rendezvous.Entry, idx []int64) (rendezvous.Entry, error) {
	defer e.Buf.Release()
	rowBytes, err := rowsOfEntry(key, e, idx)
	if err != nil {
		return rendezvous.Entry{}, err
	}
	n := int64(len(idx)) * rowBytes
	buf, err := allocBuffer(ctx, s.pool, int(n))
	if err != nil {
		return rendezvous.Entry{}, err
	}
	src, dst := e.Tensor.Bytes(), buf.Bytes()
	for i, r := range idx {
		memcopy.Copy(dst[int64(i)*rowBytes:int64(i+1)*rowBytes], src[r*rowBytes:(r+1)*rowBytes])
	}
	if n > 0 {
		s.count(ss, func(c *counters) { c.copied(int(n)) })
	}
	t, err := zerocopy.New(e.Tensor.DType(), rowsShape(e.Tensor.Shape(), len(idx)), dst)
	if err != nil {
		buf.Release()
		return rendezvous.Entry{}, status.Error(codes.Internal, err.Error())
	}
	return rendezvous.Entry{Tensor: t, Buf: buf, Seq: e.Seq}, nil
}

// offerRows answers a rows Fetch on a data plane: rows that fit inline
// are gathered into the answer; more are left where they are, the whole
// published tensor granted to the client, which reads the rows it asked
// for itself (FetchResponse.rows_of_source): one request and one batch of
// Reads, and no copy on this side. It takes over e's reference.
func (s *Server) offerRows(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, key string, e rendezvous.Entry, idx []int64, inlineMax int, held *[]*mempool.Buffer) (*pb.FetchResponse, error) {
	rowBytes, err := rowsOfEntry(key, e, idx)
	if err != nil {
		e.Buf.Release()
		return nil, err
	}
	if int64(len(idx))*rowBytes <= int64(inlineMax) || l == nil {
		g, err := s.gatherRows(ctx, ss, key, e, idx)
		if err != nil {
			return nil, err
		}
		return s.fetchAnswer(ctx, ss, l, ref, key, g, inlineMax, held, nil)
	}
	meta, _, id, err := s.offer(ctx, ss, l, ref, key, e.Tensor, e.Buf, -1, nil)
	if err != nil {
		return nil, err
	}
	meta.Shape = rowsShape(e.Tensor.Shape(), len(idx))
	meta.ByteLength = uint64(int64(len(idx)) * rowBytes)
	meta.Crc32C = nil
	return &pb.FetchResponse{Meta: meta, TransferId: id, RowsOfSource: true}, nil
}

// readRowsOfSource reads the rows idx of the source tensor that meta's
// location grants (rows_of_source) into buf, back to back, over l.
func readRowsOfSource(ctx context.Context, l *engine.Link, lanes []*engine.Link, local verbs.Local, meta *pb.TensorMeta, sourceBytes uint64, idx []int64, done func()) error {
	loc := meta.Location
	n := int64(len(idx))
	if n == 0 || meta.ByteLength%uint64(n) != 0 {
		done()
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %d bytes for %d rows", meta.Key, meta.ByteLength, n)
	}
	rowBytes := int64(meta.ByteLength) / n
	for _, r := range idx {
		if r < 0 || uint64(r+1)*uint64(rowBytes) > sourceBytes {
			done()
			return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: row %d past the %d bytes granted", meta.Key, r, sourceBytes)
		}
	}
	runs := engine.RowRuns(len(idx), func(i int) (int64, int64) { return idx[i], int64(i) })
	if len(loc.Lanes) == len(lanes) && len(lanes) > 1 {
		// The source is granted on every lane: the rows are read over all.
		remotes := make([]verbs.Remote, len(lanes))
		for i, lr := range loc.Lanes {
			remotes[i] = verbs.Remote{Addr: lr.Address, Key: lr.RemoteKey}
		}
		return engine.ReadRowsLanes(ctx, lanes, local, remotes, rowBytes, runs, done)
	}
	return engine.ReadRows(ctx, l, local, verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}, rowBytes, runs, done)
}

// checkRowsAnswer checks that a gathered answer to a rows Fetch has the
// rows asked for.
func checkRowsAnswer(m *pb.TensorMeta, n int) error {
	if m == nil || len(m.Shape) == 0 || m.Shape[0] != int64(n) {
		return status.Errorf(codes.Internal, "tensorrpc: the server answered %d rows with shape %v", n, m.GetShape())
	}
	return nil
}

// rowsErr names the operation in an argument error about rows.
func rowsErr(op, key string, format string, a ...any) error {
	return status.Errorf(codes.InvalidArgument, "tensorrpc: %s of %q: %s", op, key, fmt.Sprintf(format, a...))
}

// writeRows is a SendRequest with rows (SendRows), however it arrived:
// rows of the request's tensor written over rows req.Rows of the
// writable tensor published under its key, inline or read on lane l from
// the client's grant, each row straight into its place.
func (s *Server) writeRows(ctx context.Context, ss *serverSession, l *engine.Link, req *pb.SendRequest) error {
	m := req.Meta
	if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
		return err
	}
	key := m.Key
	e, err := s.rv.TryFetch(key)
	if err != nil {
		return rendezvousError(key, err)
	}
	hold := true
	defer func() {
		if hold {
			e.Buf.Release()
		}
	}()
	if !e.Writable {
		return status.Errorf(codes.PermissionDenied, "tensorrpc: tensor %q is not published writable (Publish with Writable): its rows cannot be written", key)
	}
	rowBytes, rows, err := rowBytesOf(e.Tensor.DType(), e.Tensor.Shape())
	if err != nil {
		return err
	}
	if zerocopy.DType(m.Dtype) != e.Tensor.DType() || !slices.Equal(m.Shape, rowsShape(e.Tensor.Shape(), len(req.Rows))) {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: rows of %v%v written to tensor %q of %v%v: want %v%v", zerocopy.DType(m.Dtype), m.Shape, key, e.Tensor.DType(), e.Tensor.Shape(), e.Tensor.DType(), rowsShape(e.Tensor.Shape(), len(req.Rows)))
	}
	if err := checkRows(key, req.Rows, rows, true); err != nil {
		return err
	}
	dst := e.Tensor.Bytes()
	n := int64(len(req.Rows)) * rowBytes
	switch {
	case m.Location == nil:
		if int64(len(req.InlineData)) != n {
			return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %d inline bytes for %d rows of %d", key, len(req.InlineData), len(req.Rows), rowBytes)
		}
		for i, r := range req.Rows {
			copy(dst[r*rowBytes:(r+1)*rowBytes], req.InlineData[int64(i)*rowBytes:])
		}
		s.countInline(ss, int(n))
		return nil
	case l == nil:
		return status.Error(codes.InvalidArgument, "tensorrpc: written rows have no location")
	case len(req.InlineData) > 0:
		return status.Error(codes.InvalidArgument, "tensorrpc: written rows with both inline data and a location")
	case m.Location.Length != uint64(n) || m.Location.Transport != transportOf(ss.transport):
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: a location of %d bytes on %v for %d bytes of rows on %s", key, m.Location.Length, m.Location.Transport, n, ss.transport)
	}
	local, err := l.Domain.Reg.Local(e.Buf)
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	runs := engine.RowRuns(len(req.Rows), func(i int) (int64, int64) { return int64(i), req.Rows[i] })
	hold = false // from here the Reads' end releases it
	err = engine.ReadRows(ctx, l, local, verbs.Remote{Addr: m.Location.Address, Key: m.Location.RemoteKey}, rowBytes, runs, func() { e.Buf.Release() })
	if err != nil {
		return err
	}
	e.Buf.Release()
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(n)
	return nil
}

// SendRows writes the rows of src over rows idx (indices along dimension
// 0, distinct) of the tensor the server published under key with
// Writable: src has shape [len(idx), shape[1:]...] of the published
// tensor, and its dtype. The published tensor must be writable (else
// PermissionDenied), and every index in range (else InvalidArgument);
// nothing is written then. On a data plane it is one request, and the
// server reads each row from src straight into its place: src is read in
// place where the plane can (tcp; caller memory is registered, not
// copied), else copied into pool memory once. Writes of different rows
// by different clients do not interfere; the rows are visible to Fetches
// that start after SendRows returns. src stays the caller's.
func (c *Client) SendRows(ctx context.Context, key string, idx []int64, src *Tensor) error {
	if err := checkOutgoing(src, "SendRows' tensor"); err != nil {
		return err
	}
	switch sh := src.Shape(); {
	case len(idx) == 0:
		return rowsErr("SendRows", key, "no rows named")
	case len(idx) > MaxRows:
		return rowsErr("SendRows", key, "%d rows, more than %d (MaxRows)", len(idx), MaxRows)
	case len(sh) == 0 || sh[0] != int64(len(idx)):
		return rowsErr("SendRows", key, "a tensor of shape %v for %d rows", sh, len(idx))
	}
	for i, r := range idx {
		if r < 0 {
			return rowsErr("SendRows", key, "row index %d (at %d) is negative", r, i)
		}
	}
	s, err := c.start(ctx)
	if err != nil {
		return err
	}
	defer c.leave()
	rows := append([]int64{}, idx...)
	return c.intercept(ctx, s, OpSend, key, int64(len(src.Bytes())), func(ctx context.Context, _ *CallInfo) error {
		switch p := s.calls.(type) {
		case framePlane:
			return c.sendFrame(ctx, s, outgoing{meta: metaOf(key, src.Tensor, false), t: src, rows: rows})
		case streams:
			ctx, stop := c.untilClose(ctx)
			defer stop()
			return c.sendStream(ctx, s, key, src, rows)
		default:
			return status.Errorf(codes.Unimplemented, "tensorrpc: SendRows on %T", p)
		}
	})
}
