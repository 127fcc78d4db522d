// Package ibv is the verbs provider for RDMA NICs (InfiniBand and RoCE),
// through libibverbs and cgo.
//
// # Basics
//
// The real provider is compiled only with the rdma build tag, on Linux,
// with cgo, against libibverbs (Debian: libibverbs-dev):
//
//	go build -tags rdma ./...
//
// Without the tag the package still builds: New returns a provider whose
// Devices and Open fail with an error that wraps verbs.ErrNoDevice and says
// to rebuild with -tags rdma.
//
// New takes functional options: WithDevice, WithPort (default 1),
// WithGIDIndex (default: automatic), WithMTU, WithTrafficClass, WithRetry,
// WithTimeout, WithRNRTimer and WithMaxInline. Devices lists what
// ibv_get_device_list finds; when it finds nothing the error says why, e.g.
// that /sys/class/infiniband does not exist (a kernel without RDMA support)
// or that ib_uverbs is not loaded. Each Open opens the device, checks that
// the port is ACTIVE, picks the source GID and allocates a protection
// domain.
//
// Attributes come from the device, not from constants: ibv_query_device_ex
// (ibv_query_device where the driver lacks it), ibv_query_port and a probe
// queue pair that Open creates and destroys at once to learn what a queue
// pair really gets.
//
//   - MaxMessageBytes is the port's max_msg_sz (2^31 if it reports none).
//   - MaxSegments is max_sge, capped by max_sge_rd (Reads scatter too), by
//     16 (each element widens every work queue entry) and by what the
//     probe queue pair was granted; Open fails if that is below 4.
//   - MaxInline is the inline size asked for (WithMaxInline, 64 bytes by
//     default), capped by what the probe was granted; 0 when the device
//     refuses inline data.
//   - MaxOutstandingReads is the smaller of max_qp_rd_atom and
//     max_qp_init_rd_atom. Connect sets max_dest_rd_atomic (at RTR) to the
//     device's max_qp_rd_atom and max_rd_atomic (at RTS) to the smaller of
//     max_qp_init_rd_atom and what the peer serves, as carried in LocalInfo.
//   - MaxQueueDepth is max_qp_wr.
//   - Grants is GrantWindow when device_cap_flags(_ex) has
//     IBV_DEVICE_MEM_WINDOW_TYPE_2A or _2B and max_mw is not 0, otherwise
//     GrantRegistration.
//
// RegisterMemory calls ibv_reg_mr, which pins the pages. On a device with
// memory windows it adds IBV_ACCESS_MW_BIND, so that grants can bind
// windows to the region. Addr is the
// virtual address of the first byte and the keys are the region's lkey and
// rkey. Pass memory the Go collector does not manage, such as mempool's
// mmap'd arenas: only the address crosses into C, as an integer, and
// libibverbs never holds a Go pointer. Go heap memory also works, since the
// collector does not move heap objects and the region keeps the slice
// reachable, but it shares pages with unrelated objects (see fork safety
// below).
//
// A completion queue has its own completion channel and a capacity.
// NewQueuePair reserves MaxSend entries of its send queue's completion
// queue and MaxRecv of its receive queue's (both of one queue when they are
// the same), and fails with an error wrapping verbs.ErrQueueFull when there
// is not that much room left, so the NIC never overflows a completion
// queue. The reservation returns when the queue pair is destroyed: at its
// Close when nothing is outstanding, otherwise once its last flushed
// completion has been polled. Wait arms the queue (ibv_req_notify_cq) and
// sleeps on the channel's file descriptor in the Go poller, so a blocked
// Wait holds no OS thread and ends when its context does.
//
// A queue pair is a reliable-connected ibv_qp. LocalInfo carries, in 48
// bytes, the link layer, MTU, RDMA Read depth, LID, QP number, a random
// 24-bit first PSN, the GID and a random 128-bit secret. Connect moves the
// queue pair through INIT, RTR and RTS with the peer's values; receives may
// be posted before Connect (the queue pair then moves to INIT at once).
// Queue pairs are created with sq_sig_all=0: a request is posted with
// IBV_SEND_SIGNALED unless it is Unsignaled, and an Unsignaled one keeps its
// send queue slot until a later request of the queue pair completes (the
// send queue completes in order). Fence sets IBV_SEND_FENCE. Sends and
// Writes whose total length is at most the inline size the device granted
// the queue pair are posted inline (IBV_SEND_INLINE), so the NIC takes their
// bytes from the work request.
//
// PostSend and PostRecv are all or none. Every request is checked in Go
// first: the opcode; each segment (Local, or each of Segments, which become
// the request's ibv_sge list) against its region — a region of another
// domain, a deregistered region, a segment out of bounds, or a Read or
// Recv destination without local write fails with an error wrapping
// verbs.ErrInvalidMemory; more segments than the queue pair has or a total
// above MaxMessageBytes with one wrapping verbs.ErrTooLarge; more requests
// than free slots with verbs.ErrQueueFull. Then all of them go to the NIC
// as one chained list in a single ibv_post_send (or ibv_post_recv). Should
// the NIC refuse one all the same (bad_wr), nothing was posted when it is
// the first; when it is a later one, the requests before it are already on
// the queue and cannot be taken back, so the provider moves the queue pair
// to ERR (they then complete, most with StatusFlushed) and returns an error
// wrapping verbs.ErrQPError that says how many were posted. Remote keys,
// bounds and rights are the NIC's to check; its refusal is a
// StatusRemoteAccess completion.
//
// Grant, on a device with type 2 memory windows (GrantWindow), takes a
// window (an invalidated one from the domain's pool, or ibv_alloc_mw with
// IBV_MW_TYPE_2), posts an IBV_WR_BIND_MW on the queue pair that binds it
// to the granted range with the one right and a new rkey (the window's last
// rkey with its 8-bit tag advanced, as ibv_inc_rkey does), and waits for
// the bind to complete. The window is bound to that queue pair, so the NIC
// refuses its key on any other. Binding is a send request, so Grant needs a
// connected queue pair (verbs.ErrNotConnected before Connect) and a free
// send slot (verbs.ErrQueueFull). Revoke posts IBV_WR_LOCAL_INV of the key
// on the same queue pair and waits; the window returns to the pool. When
// that queue pair can no longer post (closed, in ERR), Revoke calls
// ibv_dealloc_mw instead, which unbinds the window too. On a device
// without type 2 windows (GrantRegistration), Grant registers just the
// range with the one right (ibv_reg_mr, ibv_reg_dmabuf_mr for DMA-BUF
// memory) and Revoke deregisters it; that key works on any queue pair of
// the domain, and Grant works before Connect. Registrations are not
// cached: two grants of one range would share a key that revoking one of
// them must kill. Granting remote write needs a region registered with
// local or remote write (the NIC requires local write under remote write),
// else Grant fails with an error wrapping verbs.ErrInvalidMemory, as it
// does for a range outside the region, a right other than exactly one of
// remote read and remote write, or a region of another domain; all of this
// is checked before any libibverbs call. Deregister revokes the region's
// remaining grants first (a bound window keeps ibv_dereg_mr from
// succeeding).
//
// Bind and invalidate completions are internal: their wr_id has bit 62
// set (receives have bit 63; the low 32 bits are a slot index, and the
// caller's ID stays in the slot), and they take a send queue slot like any
// request, so they are inside the queue pair's completion queue
// reservation. Whoever polls the send completion queue first finishes them
// in the poll path: the caller's Poll or Wait, which never returns them,
// or the Grant or Revoke that waits, which drains the queue itself with a
// short backoff, so it needs no poller elsewhere. The caller's completions
// that a waiting Grant or Revoke takes are kept, in order, and handed out
// first by the next Poll. A bind or invalidate that fails moves the queue
// pair to ERR like any failed request, and Grant or Revoke returns an error
// wrapping verbs.ErrQPError; one that has not completed after 10 seconds
// makes Grant or Revoke give up, and the window is deallocated whenever
// its completion comes (or the queue pair is destroyed).
//
// Close on a queue pair moves it to ERR, so the NIC flushes its
// outstanding requests with StatusFlushed. Those completions must still be
// polled; the queue pair is destroyed when the last of them has been, at
// once if nothing is outstanding or a completion queue is closed, and at
// the latest by the domain's Close, which destroys queue pairs, completion
// queues and their channels, memory regions (revoking their grants),
// pooled memory windows, the protection domain and the device context, in
// that order. Because an unsignaled request that succeeded has no
// completion, Close posts one more signaled, empty Send behind the
// outstanding requests (flushed at once on a queue pair in ERR; its
// completion is internal) so that the queue drains. Close, Deregister,
// Revoke and the domain's Close are idempotent: a second call returns nil.
//
// # Caveats
//
// This provider needs an RDMA NIC, a kernel with RDMA support and the
// rdma-core user-space driver for the NIC. Our CI has none of these: it
// only compiles the package with -tags rdma, vets it, and runs its tests,
// which skip with the reason Devices gives. None of the code that calls
// libibverbs has run on RDMA hardware: not the attribute queries and the
// probe queue pair, not memory windows (allocation, IBV_WR_BIND_MW,
// IBV_WR_LOCAL_INV, the pool), not per-grant registrations, not
// scatter/gather lists, unsignaled or fenced requests, the chained posts or
// the internal completions. Only the pure-Go parts (attribute mapping,
// argument checks, wr_id encoding, the send queue accounting) are tested,
// on every build. No performance figure has been measured.
//
// A memory window's rkey changes only in its low 8 bits with each bind, so
// a key from 256 binds of the same window earlier would match again; a
// peer holding such a stale key that long is outside what a grant
// protects against.
//
// Registered memory is pinned and counts against RLIMIT_MEMLOCK (often
// 8 MiB, see ulimit -l). Raise the limit (limits.conf, systemd
// LimitMEMLOCK, docker --ulimit memlock=-1) for arenas of real size;
// registration failing with ENOMEM or EPERM is the usual symptom, and the
// error says so.
//
// Fork safety: after fork, copy-on-write would give the parent new pages
// behind the NIC's back. mempool's arenas are marked MADV_DONTFORK, which
// avoids this; for other memory set RDMAV_FORK_SAFE=1 in the environment
// so that libibverbs calls ibv_fork_init itself (Linux 5.13 and later copy
// pinned pages at fork and need neither). os/exec starts programs without
// copy-on-write fork (CLONE_VM|CLONE_VFORK), so most Go programs are not
// affected at all.
//
// RoCE GID selection: by default the provider picks the first RoCE v2 GID
// holding an IPv4-mapped address (from /sys/class/infiniband/<dev>/ports/
// <port>/gid_attrs/types), then the first RoCE v2 GID, then index 0. Both
// ends must pick GIDs that can reach each other; the GID table changes
// when addresses are added to or removed from the netdev, so pin the index
// with WithGIDIndex where the table is not what this rule expects. On
// InfiniBand the provider routes by LID within one subnet.
//
// Inline size: the provider asks for 64 bytes (WithMaxInline or
// QueuePairConfig.MaxInline change it) and retries without inline data
// when the device refuses; the device may grant more than asked.
//
// The secret in LocalInfo is not checked by the NIC: an RC queue pair
// accepts packets only from the QP number, PSN range and GID/LID it was
// connected to, and those values reach the peer over the same control-plane
// session that carries the secret. Binding the data plane to that session
// therefore rests on the control plane, as it does for every provider.
//
// The completion queue reservation counts the capacity asked of
// NewCompletionQueue (the NIC may round it up). Asynchronous events
// (ibv_get_async_event) are not read by this provider.
package ibv
