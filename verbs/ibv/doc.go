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
// RegisterMemory calls ibv_reg_mr, which pins the pages. Addr is the
// virtual address of the first byte and the keys are the region's lkey and
// rkey. Pass memory the Go collector does not manage, such as mempool's
// mmap'd arenas: only the address crosses into C, as an integer, and
// libibverbs never holds a Go pointer. Go heap memory also works, since the
// collector does not move heap objects and the region keeps the slice
// reachable, but it shares pages with unrelated objects (see fork safety
// below).
//
// A completion queue has its own completion channel. Wait arms the queue
// (ibv_req_notify_cq) and sleeps on the channel's file descriptor in the Go
// poller, so a blocked Wait holds no OS thread and ends when its context
// does.
//
// A queue pair is a reliable-connected ibv_qp. LocalInfo carries, in 48
// bytes, the link layer, MTU, RDMA Read depth, LID, QP number, a random
// 24-bit first PSN, the GID and a random 128-bit secret. Connect moves the
// queue pair through INIT, RTR and RTS with the peer's values; receives may
// be posted before Connect (the queue pair then moves to INIT at once).
// Every send request is signaled; Sends and Writes of at most the inline
// size the device granted the queue pair are posted inline (IBV_SEND_INLINE),
// so the NIC takes their bytes from the work request.
//
// Local buffers are checked in Go before anything is posted: a buffer
// outside its region, a region of another domain, a deregistered region, or
// a Read or Recv into a region without local write makes PostSend or
// PostRecv fail with an error wrapping verbs.ErrInvalidMemory, and no
// completion follows. Remote keys, bounds and rights are the NIC's to
// check; its refusal is a StatusRemoteAccess completion.
//
// Close on a queue pair moves it to ERR, so the NIC flushes its
// outstanding requests with StatusFlushed. Those completions must still be
// polled; the queue pair is destroyed when the last of them has been, at
// once if nothing is outstanding or a completion queue is closed, and at
// the latest by the domain's Close, which destroys queue pairs, completion
// queues and their channels, memory regions, the protection domain and the
// device context, in that order.
//
// # Caveats
//
// This provider needs an RDMA NIC, a kernel with RDMA support and the
// rdma-core user-space driver for the NIC. Our CI has none of these: it
// only compiles the package with -tags rdma and runs its tests, which skip
// with the reason Devices gives. The provider has not been run on RDMA
// hardware in our CI; no performance figure for it has been measured.
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
// A completion queue must hold every completion that can be outstanding at
// once on the queue pairs using it; if it overflows, the NIC reports an
// asynchronous error and the queue pairs stop. Asynchronous events
// (ibv_get_async_event) are not read by this provider.
package ibv
