/*
 * tensorrpc.h: the types of tensorrpc's C ABI.
 *
 * libtensorrpc.h, which `go build -buildmode=c-shared` writes next to
 * libtensorrpc.so, declares the functions and includes this file. See
 * shim/README.md for the functions, their arguments and the ownership rules.
 *
 * Every function returns 0 (OK) or a gRPC status code and, when its last
 * argument `char **err` is not NULL, stores a malloc'd message there on
 * failure; free it with trpc_free.
 */
#ifndef TENSORRPC_H
#define TENSORRPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* TRPC_ABI_VERSION is the C ABI these declarations describe; a program can
 * compare it with trpc_abi_version(), the library's. Versions only ever add:
 * a function, a flag, or a field appended to a struct the caller
 * zero-initialises; a program built against version N works with a library
 * of version N or later. Version 2 appended trpc_options.data_address and
 * made fetches of a key that is not published fail at once unless
 * TRPC_FETCH_WAIT is given. Version 3 added DLPack 1.0
 * (DLManagedTensorVersioned: trpc_dlpack_share_versioned,
 * trpc_dlpack_flags) and error details (trpc_reply_set_error_details,
 * trpc_error_details). Version 4 added rows and the caller's memory:
 * trpc_client_fetch_into, trpc_client_fetch_rows, trpc_client_send_rows,
 * trpc_server_publish_flags (TRPC_PUBLISH_WRITABLE) and trpc_row_index;
 * and trpc_client_send of caller memory no longer copies it into the pool
 * where the data plane reads it in place (tcp). Version 5 added CUDA
 * tensors (DLPack kDLCUDA): trpc_client_send_device,
 * trpc_client_fetch_device, trpc_cuda_device_count, trpc_device_stats
 * (trpc_device_mem_stats), TRPC_STREAM_LEGACY; and trpc_client_send,
 * trpc_client_call, trpc_server_publish(_flags) and trpc_reply_add_tensor
 * accept kDLCUDA tensors (staged through host memory). Version 6 added
 * trpc_server_publish_device (trpc_release_fn): a CUDA tensor published
 * in place on its device. Version 7 added trpc_client_fetch_tensor and
 * trpc_last_error: a fetch without out-parameters, for callers (Python's
 * ctypes) to whom each one costs. */
#define TRPC_ABI_VERSION 7

/* The DLPack types (dlpack.h; DLTensor has the same layout in v0.x and
 * v1.x). A program that includes dlpack.h before this file uses dlpack.h's
 * definitions. */
#if !defined(DLPACK_VERSION) && !defined(DLPACK_MAJOR_VERSION)
typedef struct {
  int32_t device_type; /* 1 = kDLCPU; 2 = kDLCUDA (ABI version 5) where a function says so */
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code; /* 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool */
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides; /* NULL means compact row-major */
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
#endif

/* DLPack 1.0: DLManagedTensorVersioned, in capsules named
 * "dltensor_versioned" (consumed: "used_dltensor_versioned"). Defined here
 * unless dlpack.h >= 1.0 was included first. */
#ifndef DLPACK_MAJOR_VERSION
typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)

typedef struct DLManagedTensorVersioned {
  DLPackVersion version; /* {1, 0} from this library */
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags; /* DLPACK_FLAG_BITMASK_* */
  DLTensor dl_tensor;
} DLManagedTensorVersioned;
#endif

/* trpc_dlpack_share_versioned(m, copy) returns a DLManagedTensorVersioned
 * (version 1.0) over the memory of m holding its own reference, like
 * trpc_dlpack_share, with DLPACK_FLAG_BITMASK_READ_ONLY set when m is
 * read-only (a shared-memory lease: TRPC_FETCH_LEASE). With copy != 0 it
 * is instead a malloc'd copy of the data (DLPACK_FLAG_BITMASK_IS_COPIED,
 * writable). NULL when m is NULL or deleted, or malloc fails. Its deleter
 * may run on any thread, once. trpc_dlpack_flags(m) is the flags such a
 * tensor would have (0 for NULL). Both added in ABI version 3. */

/* Error details (ABI version 3). A handler may attach details to its error
 * (trpc_reply_set_error_details, e.g. a traceback); they travel to the
 * client in the gRPC status's details (a google.rpc.DebugInfo), while the
 * status message stays the short text of trpc_reply_set_error. After a
 * function of this library fails, trpc_error_details() on the same thread
 * returns the details of that failure as a malloc'd string (free it with
 * trpc_free), or NULL when it had none; each failing call replaces them and
 * the getter hands them over, so a second call returns NULL. */

/* The last error (ABI version 7). A function that returns its result
 * rather than a status code (trpc_client_fetch_tensor) reports a failure
 * by returning NULL; trpc_last_error() on the same thread then returns its
 * status code and, when message is not NULL, hands over its malloc'd
 * message there (free it with trpc_free). It returns 0 (and NULL) when no
 * such failure happened since it was last called: each call clears it.
 * trpc_error_details() works after such a failure too. */
int trpc_last_error(char **message);

/* Handles name servers, clients and handler replies. 0 is never a valid
 * handle. */
typedef uint64_t trpc_server;
typedef uint64_t trpc_client;
typedef uint64_t trpc_reply;

/* trpc_options configures trpc_server_new and trpc_client_dial. A NULL
 * pointer, a NULL string and a zero number each mean the default. New
 * fields are only ever appended; zero-initialise the whole struct
 * (`trpc_options opts = {0};`) so that fields a program does not know stay
 * at their defaults. */
typedef struct {
  const char *transports;     /* comma-separated, e.g. "shm,tcp,grpc" */
  int64_t eager_threshold;    /* bytes; server only (the server's value is used for a session) */
  int64_t pool_limit;         /* bytes the pool may reserve (default 4 GiB) */
  int64_t max_tensor_bytes;   /* largest tensor a peer may make us allocate (default 1 GiB) */
  int64_t connect_timeout_ms; /* per data plane */
  /* Server only (trpc_client_dial ignores it): the address the tcp data
   * plane listens on and advertises to clients, "host" (a free port is
   * chosen) or "host:port" (rpc.WithDataAddress). NULL or "" means the
   * local address of the gRPC connection each session arrived on, which
   * clients on other hosts can reach; the environment variables
   * TENSORRPC_TCP_ADDR ("host[:port]") and TENSORRPC_SOCKET_IFNAME
   * (interface name prefixes, as NCCL_SOCKET_IFNAME) also choose it. Added
   * in C ABI version 2. */
  const char *data_address;
} trpc_options;

/* Flags of trpc_client_fetch and trpc_server_fetch. Without
 * TRPC_FETCH_WAIT, a key that is not published fails at once with
 * NOT_FOUND (5), as rpc's Fetch does; with it the call waits for the key
 * until timeout_ms passes (DEADLINE_EXCEEDED, 4). */
#define TRPC_FETCH_LEASE 1 /* trpc_client_fetch: a shared-memory lease of the server's memory (shm; do not write it) */
#define TRPC_FETCH_TAKE 1  /* trpc_server_fetch: also unpublish the key */
#define TRPC_FETCH_WAIT 2  /* both: wait until the key is published (rpc.WaitForKey) */

/* Flags of trpc_server_publish_flags (ABI version 4). */
#define TRPC_PUBLISH_WRITABLE 1 /* clients may write rows of it (trpc_client_send_rows) */

/* trpc_release_fn is how trpc_server_publish_device (ABI version 6) gives
 * back what it was handed: called once with the owner pointer, from any
 * thread, when the library no longer reads the tensor. A DLPack
 * producer's deleter (DLManagedTensor's or DLManagedTensorVersioned's,
 * with the managed tensor as owner) is one. */
typedef void (*trpc_release_fn)(void *owner);

/* Rows (ABI version 4). A row is everything below a tensor's first
 * dimension: rows are indices along dimension 0. The functions that take
 * rows read `nrows` indices at `rows`, a `const int64_t *` (spelled
 * `trpc_row_index *` in libtensorrpc.h, which cgo writes without const),
 * during the call only; at most 1048576 (rpc.MaxRows) per call.
 *
 * trpc_client_fetch_into(cli, key, dst, rows, nrows, flags, timeout_ms,
 *     &err) lands the tensor published under key, or rows[0:nrows] of it
 *     (rows NULL or nrows 0: the whole tensor), in dst, the caller's CPU
 *     tensor (C-contiguous, writable): its dtype and shape must be exactly
 *     what arrives ([nrows, shape[1:]...] for rows), else INVALID_ARGUMENT
 *     and dst is not written. dst's memory is wrapped, not copied: on tcp
 *     the bytes go straight into it (a whole tensor of up to 4 MiB the
 *     server writes there before it answers, saving a round trip; larger
 *     ones and rows the client reads there); where a plane cannot reach
 *     caller memory (grpc), or the tensor is small enough to come
 *     inline, they are copied into it once (trpc_stats.copies). flags:
 *     TRPC_FETCH_WAIT; TRPC_FETCH_LEASE is ignored. On a failure dst's
 *     contents are undefined, but when the call returns, whatever its
 *     result, nothing writes dst any more (a Read under way, or the
 *     server's answer while dst is open to its writes, is waited for; a
 *     peer that holds one past 5 s has the session ended), so dst
 *     may be freed at once.
 * trpc_client_fetch_rows(cli, key, rows, nrows, flags, timeout_ms, &mt,
 *     &err) returns rows[0:nrows] (nrows >= 1; in this order, repeats
 *     allowed) as a new tensor of shape [nrows, shape[1:]...] in the
 *     client's pool, in one request.
 * trpc_client_send_rows(cli, key, rows, nrows, src, timeout_ms, &err)
 *     writes src's rows over rows[0:nrows] (distinct) of the tensor the
 *     server published with TRPC_PUBLISH_WRITABLE; src has shape [nrows,
 *     shape[1:]...] and the published dtype. Not writable:
 *     PERMISSION_DENIED (7); not published: NOT_FOUND (5); a bad row,
 *     dtype or shape: INVALID_ARGUMENT (3); nothing is written on an
 *     error. The library reads src only until it returns.
 * In fetches of rows, an index out of range (or negative) fails with
 * INVALID_ARGUMENT and nothing moves. */
typedef const int64_t trpc_row_index;

/* CUDA tensors (ABI version 5). The CUDA driver is loaded on the first
 * call that needs it, from $TENSORRPC_CUDA_LIBRARY when set, else
 * libcuda.so.1; without one such calls fail with FAILED_PRECONDITION (9)
 * and a message starting "tensorrpc: no CUDA driver". A kDLCUDA tensor on
 * a device the driver does not have fails with INVALID_ARGUMENT. Device
 * tensors are staged through host memory today (a device-to-host copy into
 * a pool buffer when sent, a host-to-device copy when fetched).
 *
 * trpc_client_send_device(cli, key, dl, stream, timeout_ms, &err) sends a
 *     tensor on any device (kDLCPU: as trpc_client_send). stream is the
 *     CUstream on which the tensor was made ready; the library's copies are
 *     ordered after the legacy default stream, so 0 and TRPC_STREAM_LEGACY
 *     (1; DLPack consumers pass it as __dlpack__(stream=1)) are accepted,
 *     other streams fail with UNIMPLEMENTED for now (synchronise them, or
 *     make the legacy stream wait for them, and pass 1). Read until it
 *     returns.
 * trpc_client_send, trpc_client_call (request tensors),
 *     trpc_server_publish(_flags) and trpc_reply_add_tensor take kDLCUDA
 *     tensors ready on the legacy default stream; they are copied into the
 *     pool during the call. trpc_client_fetch_into and
 *     trpc_client_send_rows take CPU tensors only.
 * trpc_client_fetch_device(cli, key, device, flags, timeout_ms, &mt, &err)
 *     fetches onto device ({2, ordinal}; {1, 0} is trpc_client_fetch): *mt
 *     is a kDLCUDA tensor in device memory the library owns (an arena per
 *     device, or an allocation of its own above 16 MiB), complete when the
 *     call returns (no stream to wait on), freed by its deleter. flags:
 *     TRPC_FETCH_WAIT. trpc_dlpack_share and trpc_dlpack_share_versioned
 *     (copy = 0) share it; a copy (copy != 0) is not made (NULL).
 * trpc_cuda_device_count(&n, &err) loads the driver and counts its devices.
 * trpc_device_stats(device, &stats, &err): the library's device memory on
 *     device: tensors fetched onto it and not deleted, and their arenas. */
#define TRPC_STREAM_LEGACY 1     /* CU_STREAM_LEGACY */
#define TRPC_STREAM_PER_THREAD 2 /* CU_STREAM_PER_THREAD (not supported yet) */

typedef struct {
  int64_t buffers;     /* device tensors of the library alive (not of 0 bytes) */
  int64_t bytes;       /* their bytes */
  int64_t arenas;      /* device allocations they are carved from */
  int64_t arena_bytes; /* the arenas' bytes */
} trpc_device_mem_stats;

/* The control connection of trpc_client_dial is plaintext gRPC (insecure
 * credentials, passed explicitly: rpc.Dial requires credentials): the shim
 * has no TLS. Use it on trusted networks, or tunnel it. */

/* trpc_pool_stats mirrors mempool.Stats. */
typedef struct {
  int64_t in_use, requested, peak, reserved;
  int64_t allocs, total_allocs, arenas, waiting;
} trpc_pool_stats;

/* trpc_stats mirrors rpc.Stats. */
typedef struct {
  int64_t transfers, data_plane_bytes, inline_bytes, stream_bytes;
  int64_t copies, copied_bytes, leases, errors;
} trpc_stats;

/* trpc_handler_fn serves a method registered with trpc_server_handle. It
 * runs on a tensorrpc thread, possibly several at once. The request tensors
 * are the callee's: it calls each one's deleter when done with it (they stay
 * valid until then, also after the handler returns). It builds its reply
 * with trpc_reply_set_metadata and trpc_reply_add_tensor on `reply`, which
 * is valid only until it returns, and returns 0, or a status code after
 * trpc_reply_set_error. */
typedef int (*trpc_handler_fn)(void *user_data, trpc_reply reply,
                               const char *method, const uint8_t *metadata,
                               int64_t metadata_len, DLManagedTensor **tensors,
                               int64_t n_tensors);

/* Implemented in C (dlpack.c). */
DLManagedTensor *trpc_managed_alloc(int32_t ndim, uint64_t handle);
void trpc_managed_deleter(DLManagedTensor *self);
int trpc_invoke_handler(trpc_handler_fn fn, void *user_data, trpc_reply reply,
                        const char *method, const uint8_t *metadata,
                        int64_t metadata_len, DLManagedTensor **tensors,
                        int64_t n_tensors);
void trpc_call_release(trpc_release_fn fn, void *owner);
void trpc_set_capsule_api(void *is_valid, void *get_pointer);
void trpc_dlpack_capsule_destructor(void *capsule);
const char *trpc_dltensor_name(void);
const char *trpc_dltensor_versioned_name(void);
DLManagedTensorVersioned *trpc_versioned_wrap(DLManagedTensor *inner, uint64_t flags);
DLManagedTensorVersioned *trpc_versioned_copy(const DLTensor *src, size_t nbytes);
void trpc_set_error_details(char *details);
void trpc_set_last_error(int code, char *message);
void trpc_managed_set_device(DLManagedTensor *m, int32_t device_type,
                             int32_t device_id, uint64_t data);
char *trpc_error_details(void);

#ifdef __cplusplus
}
#endif

#endif /* TENSORRPC_H */
