package rpc

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/gpudirect"
)

// maxOpenHandles bounds a session's cache of opened IPC handles: past it,
// handles no copy is using are closed as others open.
const maxOpenHandles = 64

// handleCache keeps the IPC handles a session opened, by the handle's
// bytes, so that transfers from one allocation (a CUDA IPC handle names a
// whole allocation) open it once: opening costs milliseconds, and closing
// synchronises the device (TensorPipe's cuda_gotchas), so neither belongs
// on every transfer. An entry is opened from the allocation's base and
// is reopened larger when a transfer reaches past it.
//
// An entry is never served for another allocation: the owner names each
// allocation it exports with an id (DeviceHandle.allocation), and equal
// bytes with another id reopen. It is safe for concurrent use.
type handleCache struct {
	drv ipcDriver

	mu      sync.Mutex
	entries map[[64]byte]*openedHandle
	closed  bool
	opened  int // handles opened, for tests
	freed   int // handles closed, for tests
	// streams are the copies' streams, by device, kept for the next copy:
	// a stream made and destroyed per copy costs the driver's calls each
	// time. Closed with the cache.
	streams map[string][]gpudirect.Stream
}

// openedHandle is one opened allocation, from its base.
type openedHandle struct {
	alloc uint64
	buf   gpudirect.DeviceBuffer
	users int
	stale bool // closed as its last user leaves
}

func newHandleCache(drv ipcDriver) *handleCache {
	return &handleCache{drv: drv, entries: map[[64]byte]*openedHandle{}}
}

// acquire returns the opened allocation h.Handle names (alloc says which)
// covering its first need bytes; release it after the copy.
func (c *handleCache) acquire(h gpudirect.IPCHandle, alloc uint64, need int) (*openedHandle, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errors.New("the session ended")
	}
	var free []gpudirect.DeviceBuffer
	if e := c.entries[h.Handle]; e != nil {
		if e.alloc == alloc && e.buf.Len() >= need {
			e.users++
			c.mu.Unlock()
			return e, nil
		}
		c.retireLocked(h.Handle, e, &free) // another allocation, or too short
	}
	c.evictLocked(&free)
	c.mu.Unlock()
	freeAll(free)

	buf, err := c.drv.OpenIPC(gpudirect.IPCHandle{Handle: h.Handle, Offset: 0, Len: int64(need), UUID: h.UUID})
	if err != nil {
		return nil, err
	}
	if buf.Len() < need {
		buf.Free()
		return nil, fmt.Errorf("the opened handle has %d bytes, %d needed", buf.Len(), need)
	}
	e := &openedHandle{alloc: alloc, buf: buf, users: 1}
	c.mu.Lock()
	c.opened++
	if c.closed {
		e.stale = true // freed by its release
		c.mu.Unlock()
		return e, nil
	}
	if old := c.entries[h.Handle]; old != nil {
		c.retireLocked(h.Handle, old, &free) // opened meanwhile by another transfer
	}
	c.entries[h.Handle] = e
	c.mu.Unlock()
	freeAll(free)
	return e, nil
}

// release ends one use of e.
func (c *handleCache) release(e *openedHandle) {
	c.mu.Lock()
	e.users--
	free := e.users == 0 && e.stale
	if free {
		c.freed++
	}
	c.mu.Unlock()
	if free {
		e.buf.Free()
	}
}

// retireLocked removes e from the cache; unused, it joins *free, which
// the caller closes once it let go of the lock (closing synchronises the
// device).
func (c *handleCache) retireLocked(key [64]byte, e *openedHandle, free *[]gpudirect.DeviceBuffer) {
	if c.entries[key] == e {
		delete(c.entries, key)
	}
	if e.stale {
		return
	}
	e.stale = true
	if e.users == 0 {
		c.freed++
		*free = append(*free, e.buf)
	}
}

// evictLocked retires unused entries while the cache is full.
func (c *handleCache) evictLocked(free *[]gpudirect.DeviceBuffer) {
	for key, e := range c.entries {
		if len(c.entries) < maxOpenHandles {
			return
		}
		if e.users == 0 {
			c.retireLocked(key, e, free)
		}
	}
}

func freeAll(bufs []gpudirect.DeviceBuffer) {
	for _, b := range bufs {
		b.Free()
	}
}

// drop closes the entries of the allocations the owner no longer exports.
func (c *handleCache) drop(allocs []uint64) {
	if len(allocs) == 0 {
		return
	}
	gone := map[uint64]bool{}
	for _, a := range allocs {
		gone[a] = true
	}
	var free []gpudirect.DeviceBuffer
	c.mu.Lock()
	for key, e := range c.entries {
		if gone[e.alloc] {
			c.retireLocked(key, e, &free)
		}
	}
	c.mu.Unlock()
	freeAll(free)
}

// close closes every entry, at once or as its last copy ends, and
// refuses to open more.
func (c *handleCache) close() {
	c.mu.Lock()
	c.closed = true
	var free []gpudirect.DeviceBuffer
	for key, e := range c.entries {
		delete(c.entries, key)
		e.stale = true
		if e.users == 0 {
			c.freed++
			free = append(free, e.buf)
		}
	}
	streams := c.streams
	c.streams = nil
	c.mu.Unlock()
	freeAll(free)
	for _, ss := range streams {
		for _, st := range ss {
			st.Close()
		}
	}
}

// copy is copyOn on a stream of the cache's, made once per device and
// reused.
func (c *handleCache) copy(ctx context.Context, dst gpudirect.DeviceBuffer, dstOff int, src gpudirect.DeviceBuffer, srcOff, n int) error {
	a, ok := dst.(gpudirect.AsyncBuffer)
	if !ok {
		return fmt.Errorf("%s has no streams (gpudirect.AsyncBuffer)", dst.Device())
	}
	dev := dst.Device()
	c.mu.Lock()
	var st gpudirect.Stream
	if ss := c.streams[dev]; len(ss) > 0 {
		st, c.streams[dev] = ss[len(ss)-1], ss[:len(ss)-1]
	}
	c.mu.Unlock()
	if st == nil {
		var err error
		if st, err = a.NewStream(); err != nil {
			return err
		}
	}
	err := copyOn(ctx, st, dst, dstOff, src, srcOff, n)
	c.mu.Lock()
	if c.closed || err != nil {
		c.mu.Unlock()
		st.Close() // a failed copy's stream may hold its error
		return err
	}
	if c.streams == nil {
		c.streams = map[string][]gpudirect.Stream{}
	}
	c.streams[dev] = append(c.streams[dev], st)
	c.mu.Unlock()
	return nil
}

// counts returns how many handles were opened and closed.
func (c *handleCache) counts() (opened, freed int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.opened, c.freed
}

// copyOn copies n bytes device to device, from src at srcOff to dst at
// dstOff, on stream st, and waits for the copy. When ctx ends first it
// still waits for the copy (so nothing lands in dst after it returns) and
// returns ctx's status.
func copyOn(ctx context.Context, st gpudirect.Stream, dst gpudirect.DeviceBuffer, dstOff int, src gpudirect.DeviceBuffer, srcOff, n int) error {
	if err := st.CopyDevice(dst, dstOff, src, srcOff, n); err != nil {
		return err
	}
	ev, err := st.Record()
	if err != nil {
		st.Sync()
		return err
	}
	defer ev.Close()
	if err := ev.Wait(ctx); err != nil {
		if ctx.Err() != nil {
			st.Sync()
			return status.FromContextError(ctx.Err()).Err()
		}
		return err
	}
	return nil
}

// ipcCopyError is a failed open or copy of peer memory: DataLoss, unless
// it is already a status (the call's context ended).
func ipcCopyError(what string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(codes.DataLoss, "tensorrpc: CUDA IPC: %s: %v", what, err)
}
