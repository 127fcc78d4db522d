package rpc

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// A reserved Send (SendRequest.reserve and commit in tensorrpc.proto):
// the server reserves a destination in its pool and grants it writable
// to the session; the client Writes the tensor's bytes into it as it has
// them (SendDevice, a chunk at a time while the device copies the next),
// then commits, and the server publishes it as a Send. Until the commit
// the destination is a transfer of the session like a fetched tensor:
// counted against TransfersPerSession and, unlike one, against the
// session's quota; released by id or by the reserve's client_ref, or
// freed at the session's end, never published.

// reservation is what a destination was reserved for (Transfer.Reserved):
// the commit must name the same tensor.
type reservation struct {
	key    string
	dtype  pb.DType
	shape  []int64
	length uint64
}

// reserveSend is a SEND_REQ's reserve on lane l: a destination for the
// tensor req.Meta describes, zeroed (a commit without Writes must not
// publish what the pool held before), granted writable on l (and on every
// lane, striped, when large), held as a transfer of the call ref.
func (s *Server) reserveSend(ctx context.Context, ss *serverSession, l *engine.Link, ref uint64, req *pb.SendRequest) (*pb.SendResponse, error) {
	m := req.Meta
	if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
		return nil, err
	}
	n := int(m.ByteLength)
	switch {
	case m.Location != nil || len(req.InlineData) > 0 || req.Rows != nil:
		return nil, status.Error(codes.InvalidArgument, "tensorrpc: a reserve describes its tensor only: no location, inline data or rows")
	case n == 0:
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: a reserve of the empty tensor %q: send it inline", m.Key)
	}
	if err := ss.charge(int64(n), s.opts.sessionQuota); err != nil {
		return nil, err
	}
	refund := sync.OnceFunc(func() { ss.refund(int64(n)) })
	buf, err := allocBuffer(ctx, s.pool, n)
	if err != nil {
		refund()
		return nil, err
	}
	clear(buf.Bytes()[:n])
	grant := func(x *engine.Link) (verbs.Grant, error) { return x.Grant(buf, n, verbs.AccessRemoteWrite) }
	g, err := grant(l)
	if err != nil {
		buf.Release()
		refund()
		return nil, engine.Unavailable(err)
	}
	extra, striped, err := engine.GrantLanes(ss.lanes, l, g, n, grant)
	if err != nil {
		(&engine.Transfer{Buf: buf, Grant: g, Done: refund}).Finish()
		return nil, engine.Unavailable(err)
	}
	tr := &engine.Transfer{Buf: buf, Grant: g, Stripes: extra, Done: refund,
		Reserved: reservation{key: m.Key, dtype: m.Dtype, shape: slices.Clone(m.Shape), length: m.ByteLength}}
	if err := ss.Add(ctx, tr, ref); err != nil {
		tr.Finish()
		return nil, err
	}
	remote := g.Remote()
	return &pb.SendResponse{ReservationId: tr.ID, Reservation: &pb.Location{
		Transport: transportOf(ss.transport), RegionId: buf.Arena().ID(), RemoteKey: remote.Key,
		Address: remote.Addr, Offset: uint64(buf.Offset()), Length: uint64(n), Lanes: striped,
	}}, nil
}

// commitSend is a SEND_REQ's commit: the reservation req.Commit, its
// grants revoked, is published under its key as a Send is, ordered by
// the commit's arrival. A commit that fails frees the reservation.
func (s *Server) commitSend(ss *serverSession, req *pb.SendRequest) error {
	seq := s.rv.NextSeq()
	tr := ss.TakeReserved(req.Commit)
	if tr == nil {
		return status.Errorf(codes.FailedPrecondition, "tensorrpc: no reservation %d in this session (released, committed or never made)", req.Commit)
	}
	m := req.Meta
	if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
		tr.Finish()
		return err
	}
	r := tr.Reserved.(reservation)
	if m.Key != r.key || m.Dtype != r.dtype || !slices.Equal(m.Shape, r.shape) || m.ByteLength != r.length || m.Location != nil || len(req.InlineData) > 0 || req.Rows != nil || req.Reserve {
		tr.Finish()
		return status.Errorf(codes.InvalidArgument, "tensorrpc: the commit of %q names another tensor than its reserve, or carries bytes", r.key)
	}
	tr.Revoke() // no Write lands in what is published
	refund := tr.Done
	defer refund()
	n := int(r.length)
	if err := verifySum(m, tr.Buf.Bytes()[:n]); err != nil {
		tr.Buf.Release()
		return err
	}
	t, err := tensorOf(m, tr.Buf)
	if err != nil {
		return err
	}
	ss.stats.transfers.Add(1)
	ss.stats.dataPlaneBytes.Add(int64(n))
	return s.send(m.Key, t, seq)
}

// sendPipelined is SendDevice staged on a data plane whose server takes
// reserved Sends: it reserves a destination, and while the reserve's
// round trip runs the first chunks are already being copied off the
// device (gpudirect.StageOutPipelined: a ring of pinned pool slots, the
// copy of the next chunks under way while the current one is written).
// Each chunk is Written into the reservation (striped over the lanes
// where it is granted on all) once its copy's event completed, and its
// slot is reused once the Write completed; then a commit publishes it.
// On failure or cancellation nothing is published: the reservation is
// released once every Write into it has completed, also those a
// cancelled transfer left under way.
func (c *Client) sendPipelined(ctx context.Context, e framePlane, key string, t DeviceTensor, src gpudirect.AsyncBuffer, n int) error {
	s := e.s
	l := s.lane()
	meta := &pb.TensorMeta{Key: key, Dtype: pb.DType(t.DType), Shape: slices.Clone(t.Shape), ByteLength: uint64(n)}
	type reserved struct {
		loc *pb.Location
		id  uint64
		err error
	}
	reply := make(chan reserved, 1)
	go func() {
		loc, id, err := c.reserve(ctx, s, l, meta)
		reply <- reserved{loc, id, err}
	}()
	var res reserved
	got := false
	reservation := func() reserved {
		if !got {
			res, got = <-reply, true
		}
		return res
	}
	// The reservation stays until every Write into it has completed.
	var holds atomic.Int32
	var id atomic.Uint64
	var committed atomic.Bool
	holds.Store(1)
	drop := func() {
		if holds.Add(-1) == 0 && !committed.Load() {
			c.releaseTransfer(s, id.Load())
		}
	}
	var crc uint32
	var pinned atomic.Bool
	err := gpudirect.StageOutPipelined(ctx, c.pool, src, t.Offset, n, c.stage.ring, func(ctx context.Context, ch gpudirect.StageChunk) error {
		r := reservation()
		if r.err != nil {
			return r.err
		}
		local, err := l.Domain.Reg.Local(ch.Ring)
		if err != nil {
			return status.Error(codes.Internal, err.Error())
		}
		local.Offset += ch.At
		local.Length = ch.Len
		if c.opts.checksums {
			crc = zerocopy.UpdateChecksum(crc, ch.Bytes())
		}
		pinned.Store(c.stage.pinned(src, ch.Ring))
		remote, striped := chunkAt(r.loc, ch.Pos)
		holds.Add(1)
		ch.Ring.Retain()
		end := func() {
			ch.Ring.Release()
			drop()
		}
		if err := engine.WriteLanes(ctx, l, s.lanes, local, remote, striped, end); err != nil {
			return err
		}
		end()
		return nil
	})
	r := reservation()
	id.Store(r.id)
	if err == nil {
		err = r.err
	}
	if err == nil {
		if c.opts.checksums {
			meta.Crc32C = &crc
		}
		err = c.commit(ctx, s, l, meta, r.id)
		committed.Store(err == nil)
	}
	drop()
	if err != nil {
		c.stats.errors.Add(1)
		return stagingStatus(src, err)
	}
	c.stats.stagedTransfer(n, pinned.Load())
	return nil
}

// reserve asks the server on lane l for a destination for the tensor
// meta describes: its Location, writable by this session, and its id.
func (c *Client) reserve(ctx context.Context, s *clientSession, l *engine.Link, meta *pb.TensorMeta) (*pb.Location, uint64, error) {
	resp, err := c.sendRequestFrame(ctx, s, l, &pb.SendRequest{Meta: meta, Reserve: true})
	if err != nil {
		return nil, 0, err
	}
	loc, id := resp.Reservation, resp.ReservationId
	if loc == nil || id == 0 || loc.Length != meta.ByteLength || loc.Transport != transportOf(s.transport) || len(loc.Lanes) != 0 && len(loc.Lanes) != len(s.lanes) {
		c.releaseTransfer(s, id)
		return nil, 0, status.Errorf(codes.Internal, "tensorrpc: the server's reservation for %q (%d bytes on %s) is not one of %d bytes on %s", meta.Key, loc.GetLength(), loc.GetTransport(), meta.ByteLength, s.transport)
	}
	return loc, id, nil
}

// commit asks the server to publish the reservation id, filled, as the
// tensor meta describes.
func (c *Client) commit(ctx context.Context, s *clientSession, l *engine.Link, meta *pb.TensorMeta, id uint64) error {
	_, err := c.sendRequestFrame(ctx, s, l, &pb.SendRequest{Meta: meta, Commit: id})
	return err
}

// sendRequestFrame is one SEND_REQ of req on lane l and its answer.
func (c *Client) sendRequestFrame(ctx context.Context, s *clientSession, l *engine.Link, req *pb.SendRequest) (*pb.SendResponse, error) {
	r, ref, err := c.roundTrip(ctx, s, l, wire.FrameSendReq, 0, nil, req, func(uint16) proto.Message { return &pb.SendResponse{} }, nil)
	if err == nil {
		err = c.replyError(s, ref, r)
	}
	if err != nil {
		return nil, err
	}
	resp, ok := r.Msg.(*pb.SendResponse)
	if !ok || r.Flags&wire.FlagIndirect != 0 {
		c.releaseRef(s, ref)
		return nil, status.Error(codes.Internal, "tensorrpc: the server's answer to a send is not a SendResponse")
	}
	return resp, nil
}
