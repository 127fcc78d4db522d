package rpc

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// stager is a Client's or Server's pinned staging: the registrations of
// its pool's arenas with the devices it has staged for (gpudirect.Pinner,
// made at the first staged transfer of an AsyncBuffer and closed with the
// Client or Server), and the ring its pipelined transfers use.
type stager struct {
	pool  *mempool.Pool
	ring  gpudirect.StageRing
	mu    sync.Mutex
	pin   *gpudirect.Pinner
	ended bool
}

func newStager(pool *mempool.Pool, o *options) *stager {
	return &stager{pool: pool, ring: gpudirect.StageRing{Chunk: o.stageChunk}}
}

// async returns buf as an AsyncBuffer whose device's registrar has the
// pool's arenas registered (a device without a registrar copies
// asynchronously from pageable memory), or ok=false for a buffer that
// copies only synchronously (or after close).
func (g *stager) async(buf gpudirect.DeviceBuffer) (ab gpudirect.AsyncBuffer, ok bool) {
	ab, ok = buf.(gpudirect.AsyncBuffer)
	if !ok {
		return nil, false
	}
	reg := ab.HostRegistrar()
	if reg == nil {
		return ab, true // it copies asynchronously, from pageable memory
	}
	g.mu.Lock()
	if g.ended {
		g.mu.Unlock()
		return nil, false
	}
	if g.pin == nil {
		g.pin = gpudirect.NewPinner(g.pool)
	}
	pin := g.pin
	g.mu.Unlock()
	if err := pin.Pin(reg); err != nil {
		// The pool or the stager closed: the synchronous path reports
		// what is wrong.
		return nil, false
	}
	return ab, true
}

// count adds n staged bytes of pool buffer b, copied for ab (nil: a
// synchronous copy), to c as pinned or pageable.
func (g *stager) count(c *counters, ab gpudirect.AsyncBuffer, b *mempool.Buffer, n int) {
	if ab != nil && g.pinned(ab, b) {
		c.pinnedStaged.Add(int64(n))
		return
	}
	c.pageableStaged.Add(int64(n))
}

func (g *stager) pinned(ab gpudirect.AsyncBuffer, b *mempool.Buffer) bool {
	g.mu.Lock()
	pin := g.pin
	g.mu.Unlock()
	reg := ab.HostRegistrar()
	return pin != nil && reg != nil && pin.Pinned(reg, b.Arena())
}

// arenas is the number of arenas registered now (Stats.PinnedArenas).
func (g *stager) arenas() int {
	g.mu.Lock()
	pin := g.pin
	g.mu.Unlock()
	if pin == nil {
		return 0
	}
	return pin.Stats().Arenas
}

// close unregisters the arenas; transfers still under way stage
// synchronously from then on.
func (g *stager) close() {
	g.mu.Lock()
	pin := g.pin
	g.pin, g.ended = nil, true
	g.mu.Unlock()
	if pin != nil {
		pin.Close()
	}
}

// stageOut copies n bytes of t into a new pool buffer: asynchronously,
// from pinned memory, for an AsyncBuffer; else synchronously.
func (g *stager) stageOut(ctx context.Context, c *counters, t DeviceTensor, n int) (*mempool.Buffer, error) {
	var buf *mempool.Buffer
	var err error
	ab, async := g.async(t.Buffer)
	if async {
		buf, err = gpudirect.StageOutAsync(ctx, g.pool, ab, t.Offset, n)
	} else {
		buf, err = gpudirect.StageOut(ctx, g.pool, t.Buffer, t.Offset, n)
	}
	if err != nil {
		return nil, stagingStatus(t.Buffer, err)
	}
	g.count(c, ab, buf, n)
	return buf, nil
}

// stageIn copies src, bytes of pool buffer b, into dst at offset.
func (g *stager) stageIn(ctx context.Context, c *counters, dst gpudirect.DeviceBuffer, offset int, src []byte, b *mempool.Buffer) error {
	var err error
	ab, async := g.async(dst)
	if async {
		err = gpudirect.StageInAsync(ctx, ab, offset, src)
	} else {
		err = gpudirect.StageIn(dst, offset, src)
	}
	if err != nil {
		return stagingStatus(dst, err)
	}
	if b != nil {
		g.count(c, ab, b, len(src))
	} else {
		c.pageableStaged.Add(int64(len(src)))
	}
	return nil
}

// stagingStatus gives a staging error its code: ctx's, or Internal.
func stagingStatus(buf gpudirect.DeviceBuffer, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return status.FromContextError(err).Err()
	}
	if _, ok := status.FromError(err); ok && status.Code(err) != codes.Unknown {
		return err
	}
	return status.Errorf(codes.Internal, "tensorrpc: staging %s: %v", buf.Device(), err)
}

// fetchPipelined is FetchToDevice staged on a data plane: an ordinary
// Fetch request, whose answer grants the whole tensor; the client reads
// it a chunk at a time into a ring of pinned pool slots (over every lane
// where it is granted on all) and copies each chunk to the device
// asynchronously while it reads the next (gpudirect.StageInPipelined).
// The server sees a Fetch like any other: nothing new on the wire.
func (c *Client) fetchPipelined(ctx context.Context, e framePlane, key string, dst gpudirect.AsyncBuffer, offset int) (zerocopy.DType, []int64, error) {
	s := e.s
	l, resp, err := e.ask(ctx, key, fetchOptions{})
	if err != nil {
		return 0, nil, err
	}
	if err := checkMeta(resp.Meta, c.opts.maxTensorBytes); err != nil {
		c.releaseTransfer(s, resp.TransferId)
		return 0, nil, err
	}
	dtype, shape := shapeOf(resp.Meta)
	n := int(resp.Meta.ByteLength)
	if offset < 0 || offset+n > dst.Len() {
		c.releaseTransfer(s, resp.TransferId)
		return 0, nil, status.Errorf(codes.InvalidArgument, "tensorrpc: %d bytes at offset %d do not fit %s (%d bytes)", n, offset, dst.Device(), dst.Len())
	}
	loc := resp.Meta.Location
	if loc == nil { // small: it came inline
		if len(resp.InlineData) != n {
			return 0, nil, status.Errorf(codes.InvalidArgument, "tensorrpc: inline tensor %q: %d bytes for %d", key, len(resp.InlineData), n)
		}
		if err := c.stage.stageIn(ctx, &c.stats, dst, offset, resp.InlineData, nil); err != nil {
			return 0, nil, err
		}
		c.stats.inlineBytes.Add(int64(n))
		c.stats.transfers.Add(1)
		return dtype, append([]int64(nil), shape...), nil
	}
	id := resp.TransferId
	if loc.Transport != transportOf(s.transport) || id == 0 || loc.Length != uint64(n) {
		c.releaseTransfer(s, id)
		return 0, nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: a location of %d bytes on %s for %d bytes on %s", key, loc.Length, loc.Transport, n, s.transport)
	}
	// The server's grant stays until every Read of it has completed,
	// also those a cancelled transfer left under way.
	var holds atomic.Int32
	holds.Store(1)
	drop := func() {
		if holds.Add(-1) == 0 {
			c.releaseTransfer(s, id)
		}
	}
	var pinned atomic.Bool
	err = gpudirect.StageInPipelined(ctx, c.pool, dst, offset, n, c.stage.ring, func(ctx context.Context, ch gpudirect.StageChunk) error {
		local, err := l.Domain.Reg.Local(ch.Ring)
		if err != nil {
			return status.Error(codes.Internal, err.Error())
		}
		local.Offset += ch.At
		local.Length = ch.Len
		pinned.Store(c.stage.pinned(dst, ch.Ring))
		striped := loc.Lanes
		if len(striped) > 0 {
			striped = make([]*pb.LaneRemote, len(loc.Lanes))
			for i, lr := range loc.Lanes {
				striped[i] = &pb.LaneRemote{Address: lr.Address + uint64(ch.Pos), RemoteKey: lr.RemoteKey}
			}
		}
		holds.Add(1)
		ch.Ring.Retain()
		end := func() {
			ch.Ring.Release()
			drop()
		}
		remote := verbs.Remote{Addr: loc.Address + uint64(ch.Pos), Key: loc.RemoteKey}
		if err := engine.ReadLanes(ctx, l, s.lanes, local, remote, striped, end); err != nil {
			return err
		}
		end()
		return nil
	})
	drop()
	if err != nil {
		c.stats.errors.Add(1)
		return 0, nil, stagingStatus(dst, err)
	}
	if pinned.Load() {
		c.stats.pinnedStaged.Add(int64(n))
	} else {
		c.stats.pageableStaged.Add(int64(n))
	}
	c.stats.transfers.Add(1)
	c.stats.dataPlaneBytes.Add(int64(n))
	return dtype, append([]int64(nil), shape...), nil
}
