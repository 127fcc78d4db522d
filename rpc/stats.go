package rpc

import "sync/atomic"

// Stats counts what a Client's session, or one session of a Server, moved.
type Stats struct {
	// Transport is the session's data plane.
	Transport string
	// Transfers is the number of tensors sent or received.
	Transfers int64
	// DataPlaneBytes moved over the data plane (Read, Write or lease);
	// InlineBytes inside control messages (tensors up to the eager
	// threshold); StreamBytes through the plain-gRPC fallback streams.
	DataPlaneBytes, InlineBytes, StreamBytes int64
	// Copies is the number of times tensor bytes were copied by the CPU on
	// this side (into or out of control messages, from caller memory into
	// pool memory, out of fallback chunks), and CopiedBytes their size.
	// Transfers over a data plane between pool buffers add none.
	Copies, CopiedBytes int64
	// Leases is the number of zero-copy shared-memory leases taken.
	Leases int64
	// Errors is the number of failed transfers.
	Errors int64
	// DirectTransfers and StagedTransfers count device tensors
	// (SendDevice, FetchToDevice) moved directly by the NIC and through
	// host memory.
	DirectTransfers, StagedTransfers int64
	// PinnedStagedBytes counts the bytes of staged device tensors copied
	// asynchronously (a gpudirect.AsyncBuffer's stream) to or from pool
	// memory registered with the device's driver (pinned: DMA);
	// PageableStagedBytes those copied otherwise: synchronously (a plain
	// DeviceBuffer) or from an arena the driver refused to register,
	// which it copies through a bounce buffer.
	PinnedStagedBytes, PageableStagedBytes int64
	// PinnedArenas is the number of pool arenas registered now with the
	// drivers of devices staged for (once per arena and device, from the
	// first staged transfer of that device until the arena goes or the
	// Client or Server closes): a gauge, not a count of a session's.
	PinnedArenas int
	// IPC counts device tensors moved over CUDA IPC (WithCUDA), device to
	// device between two processes of one host: by a Client, those it
	// fetched or sent; by a Server, those its sessions' clients fetched or
	// sent. A host Fetch of a tensor published on a device counts as
	// StagedTransfers on the Server.
	IPC int64
	// RefusedSessions, RefusedLanes, RefusedStreams and RefusedTransfers
	// count what a Server refused over its budgets (WithAdmission):
	// sessions, lanes a session asked for and did not get, fallback
	// streams (over their count or byte budget) and transfers past a
	// session's TransfersPerSession.
	RefusedSessions, RefusedLanes, RefusedStreams, RefusedTransfers int64
	// CompressedTransfers counts the tensors this side read that crossed
	// the wire compressed (WithCompression), and CompressionSavedBytes the
	// bytes that saved on the wire.
	CompressedTransfers, CompressionSavedBytes int64
	// LeftBehind counts a Server's calls of handlers not registered
	// Inline that ran where their frames were read and ran past the
	// watchdog's second look (1-2 ms): the lane's receiving moved on
	// without them (see WithHandlerGoroutines). Many of them say that a
	// handler blocks or runs long: such a call holds its lane 1-2 ms.
	LeftBehind int64
	// Landed counts the Fetches whose bytes the server wrote into the
	// client's landing before it answered (WithFetchLanding): by a
	// Client, those it fetched so; by a Server, those it wrote. They are
	// counted in Transfers and DataPlaneBytes too.
	Landed int64
}

// counters is the live, concurrently updated form of Stats.
type counters struct {
	transfers, dataPlaneBytes, inlineBytes, streamBytes atomic.Int64
	copies, copiedBytes, leases, errors                 atomic.Int64
	direct, staged, ipc                                 atomic.Int64
	pinnedStaged, pageableStaged                        atomic.Int64
	refusedSessions, refusedLanes                       atomic.Int64
	refusedStreams, refusedTransfers                    atomic.Int64
	compressed, compressedSaved                         atomic.Int64
	leftBehind, landed                                  atomic.Int64
}

// each calls f with every counter and its field of st: the one list of
// the counters that snapshot and merge go through.
func (c *counters) each(st *Stats, f func(c *atomic.Int64, field *int64)) {
	f(&c.transfers, &st.Transfers)
	f(&c.dataPlaneBytes, &st.DataPlaneBytes)
	f(&c.inlineBytes, &st.InlineBytes)
	f(&c.streamBytes, &st.StreamBytes)
	f(&c.copies, &st.Copies)
	f(&c.copiedBytes, &st.CopiedBytes)
	f(&c.leases, &st.Leases)
	f(&c.errors, &st.Errors)
	f(&c.direct, &st.DirectTransfers)
	f(&c.staged, &st.StagedTransfers)
	f(&c.pinnedStaged, &st.PinnedStagedBytes)
	f(&c.pageableStaged, &st.PageableStagedBytes)
	f(&c.ipc, &st.IPC)
	f(&c.compressed, &st.CompressedTransfers)
	f(&c.compressedSaved, &st.CompressionSavedBytes)
	f(&c.refusedSessions, &st.RefusedSessions)
	f(&c.refusedLanes, &st.RefusedLanes)
	f(&c.refusedStreams, &st.RefusedStreams)
	f(&c.refusedTransfers, &st.RefusedTransfers)
	f(&c.leftBehind, &st.LeftBehind)
	f(&c.landed, &st.Landed)
}

func (c *counters) copied(n int) {
	c.copies.Add(1)
	c.copiedBytes.Add(int64(n))
}

func (c *counters) snapshot(transport string) Stats {
	st := Stats{Transport: transport}
	c.each(&st, func(c *atomic.Int64, field *int64) { *field = c.Load() })
	return st
}

// merge adds src's counts to c.
func (c *counters) merge(src *counters) {
	st := src.snapshot("")
	c.each(&st, func(c *atomic.Int64, field *int64) { c.Add(*field) })
}

// AddStreamBytes, AddCopied and AddTransfer count a fallback stream's
// work (fallback.Counters).
func (c *counters) AddStreamBytes(n int64) { c.streamBytes.Add(n) }
func (c *counters) AddCopied(n int)        { c.copied(n) }
func (c *counters) AddTransfer()           { c.transfers.Add(1) }

// stagedTransfer counts a pipelined staged transfer of n bytes over the
// data plane, its device copies pinned or not.
func (c *counters) stagedTransfer(n int, pinned bool) {
	if pinned {
		c.pinnedStaged.Add(int64(n))
	} else {
		c.pageableStaged.Add(int64(n))
	}
	c.transfers.Add(1)
	c.dataPlaneBytes.Add(int64(n))
}

// AddCompressed counts the tensors of a compressed fallback stream.
func (c *counters) AddCompressed(raw, wire int64) {
	c.compressed.Add(1)
	c.compressedSaved.Add(max(raw-wire, 0))
}
