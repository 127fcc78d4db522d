package rpc

import (
	"context"
	"errors"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
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

// chunkAt is where a chunk at pos of a granted tensor lies: on the lane
// the location was sent on, and on each lane of a striped grant.
func chunkAt(loc *pb.Location, pos int) (verbs.Remote, []*pb.LaneRemote) {
	striped := loc.Lanes
	if len(striped) > 0 {
		striped = make([]*pb.LaneRemote, len(loc.Lanes))
		for i, lr := range loc.Lanes {
			striped[i] = &pb.LaneRemote{Address: lr.Address + uint64(pos), RemoteKey: lr.RemoteKey}
		}
	}
	return verbs.Remote{Addr: loc.Address + uint64(pos), Key: loc.RemoteKey}, striped
}
