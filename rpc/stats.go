package rpc

import "sync/atomic"

// Stats counts what a Client's session, or one session of a Server, moved.
type Stats struct {
	// Transport is the session's data plane.
	Transport string
	// Transfers is the number of tensors sent or received.
	Transfers int64
	// DataPlaneBytes moved over the data plane (Read or lease);
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
	// RefusedSessions, RefusedLanes, RefusedStreams and RefusedTransfers
	// count what a Server refused over its budgets (WithAdmission):
	// sessions, lanes a session asked for and did not get, fallback
	// streams (over their count or byte budget) and transfers past a
	// session's TransfersPerSession.
	RefusedSessions, RefusedLanes, RefusedStreams, RefusedTransfers int64
}

// counters is the live, concurrently updated form of Stats.
type counters struct {
	transfers, dataPlaneBytes, inlineBytes, streamBytes atomic.Int64
	copies, copiedBytes, leases, errors                 atomic.Int64
	direct, staged                                      atomic.Int64
	refusedSessions, refusedLanes                       atomic.Int64
	refusedStreams, refusedTransfers                    atomic.Int64
}

func (c *counters) copied(n int) {
	c.copies.Add(1)
	c.copiedBytes.Add(int64(n))
}

func (c *counters) snapshot(transport string) Stats {
	return Stats{
		Transport:      transport,
		Transfers:      c.transfers.Load(),
		DataPlaneBytes: c.dataPlaneBytes.Load(),
		InlineBytes:    c.inlineBytes.Load(),
		StreamBytes:    c.streamBytes.Load(),
		Copies:         c.copies.Load(),
		CopiedBytes:    c.copiedBytes.Load(),
		Leases:         c.leases.Load(),
		Errors:         c.errors.Load(),

		DirectTransfers: c.direct.Load(),
		StagedTransfers: c.staged.Load(),

		RefusedSessions:  c.refusedSessions.Load(),
		RefusedLanes:     c.refusedLanes.Load(),
		RefusedStreams:   c.refusedStreams.Load(),
		RefusedTransfers: c.refusedTransfers.Load(),
	}
}

// add accumulates s into t (for server totals).
func (t *Stats) add(s Stats) {
	t.Transfers += s.Transfers
	t.DataPlaneBytes += s.DataPlaneBytes
	t.InlineBytes += s.InlineBytes
	t.StreamBytes += s.StreamBytes
	t.Copies += s.Copies
	t.CopiedBytes += s.CopiedBytes
	t.Leases += s.Leases
	t.Errors += s.Errors
	t.DirectTransfers += s.DirectTransfers
	t.StagedTransfers += s.StagedTransfers
	t.RefusedSessions += s.RefusedSessions
	t.RefusedLanes += s.RefusedLanes
	t.RefusedStreams += s.RefusedStreams
	t.RefusedTransfers += s.RefusedTransfers
}
