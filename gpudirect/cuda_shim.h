// Declarations of the few CUDA driver API entry points gpudirect uses, with
// their ABI types spelled out, so that no CUDA header is needed to build.
// The library is opened with dlopen at run time.

#ifndef TENSORRPC_GPUDIRECT_CUDA_SHIM_H
#define TENSORRPC_GPUDIRECT_CUDA_SHIM_H

#include <stddef.h>

typedef unsigned long long tr_devptr; // CUdeviceptr on 64-bit hosts
typedef struct tr_ctx_st *tr_ctx;     // CUcontext
typedef struct tr_cuda tr_cuda;
typedef struct tr_stream_st *tr_stream; // CUstream
typedef struct tr_event_st *tr_event;   // CUevent
typedef struct {
	char reserved[64];
} tr_ipc_handle; // CUipcMemHandle, passed by value
typedef struct {
	char bytes[16];
} tr_uuid; // CUuuid

// tr_cuda_open dlopens path and resolves the entry points. On failure it
// returns NULL and sets *err to a malloc'd message, and *not_found when the
// library itself could not be found.
tr_cuda *tr_cuda_open(const char *path, char **err, int *not_found);

int tr_cu_init(tr_cuda *c);
int tr_cu_driver_version(tr_cuda *c, int *v);
int tr_cu_device_count(tr_cuda *c, int *n);
int tr_cu_device_get(tr_cuda *c, int *dev, int ordinal);
int tr_cu_device_name(tr_cuda *c, char *name, int len, int dev);
int tr_cu_device_attribute(tr_cuda *c, int *v, int attr, int dev);
int tr_cu_device_total_mem(tr_cuda *c, size_t *bytes, int dev);
int tr_cu_primary_retain(tr_cuda *c, tr_ctx *ctx, int dev);
int tr_cu_primary_release(tr_cuda *c, int dev);

// The calls below make ctx current on the calling thread for their
// duration and restore the previous context after.
int tr_cu_mem_alloc(tr_cuda *c, tr_ctx ctx, tr_devptr *p, size_t n);
int tr_cu_mem_free(tr_cuda *c, tr_ctx ctx, tr_devptr p);
int tr_cu_htod(tr_cuda *c, tr_ctx ctx, tr_devptr dst, const void *src, size_t n);
int tr_cu_dtoh(tr_cuda *c, tr_ctx ctx, void *dst, tr_devptr src, size_t n);
int tr_cu_sync_memops(tr_cuda *c, tr_ctx ctx, tr_devptr p);
// tr_cu_dmabuf returns TR_MISSING when the driver lacks
// cuMemGetHandleForAddressRange (before CUDA 11.7).
int tr_cu_dmabuf(tr_cuda *c, tr_ctx ctx, int *fd, tr_devptr p, size_t n);

// Streams, events, host registration and IPC; each returns TR_MISSING
// when the driver lacks the entry point. tr_cu_async_ready and
// tr_cu_ipc_ready report whether all of a group are there.
int tr_cu_async_ready(tr_cuda *c);
int tr_cu_ipc_ready(tr_cuda *c);
int tr_cu_stream_create(tr_cuda *c, tr_ctx ctx, tr_stream *s);
int tr_cu_stream_destroy(tr_cuda *c, tr_ctx ctx, tr_stream s);
int tr_cu_stream_sync(tr_cuda *c, tr_ctx ctx, tr_stream s);
int tr_cu_htod_async(tr_cuda *c, tr_ctx ctx, tr_devptr dst, const void *src, size_t n, tr_stream s);
int tr_cu_dtoh_async(tr_cuda *c, tr_ctx ctx, void *dst, tr_devptr src, size_t n, tr_stream s);
int tr_cu_dtod_async(tr_cuda *c, tr_ctx ctx, tr_devptr dst, tr_devptr src, size_t n, tr_stream s);
int tr_cu_event_create(tr_cuda *c, tr_ctx ctx, tr_event *e);
int tr_cu_event_record(tr_cuda *c, tr_ctx ctx, tr_event e, tr_stream s);
int tr_cu_event_query(tr_cuda *c, tr_ctx ctx, tr_event e);
int tr_cu_event_sync(tr_cuda *c, tr_ctx ctx, tr_event e);
int tr_cu_event_destroy(tr_cuda *c, tr_ctx ctx, tr_event e);
int tr_cu_host_register(tr_cuda *c, tr_ctx ctx, void *p, size_t n);
int tr_cu_host_unregister(tr_cuda *c, tr_ctx ctx, void *p);
int tr_cu_ipc_get(tr_cuda *c, tr_ctx ctx, tr_ipc_handle *h, tr_devptr p);
int tr_cu_ipc_open(tr_cuda *c, tr_ctx ctx, tr_devptr *p, const tr_ipc_handle *h);
int tr_cu_ipc_close(tr_cuda *c, tr_ctx ctx, tr_devptr p);
int tr_cu_address_range(tr_cuda *c, tr_ctx ctx, tr_devptr *base, size_t *size, tr_devptr p);
int tr_cu_device_uuid(tr_cuda *c, tr_uuid *u, int dev);

const char *tr_cu_error_name(tr_cuda *c, int code);
const char *tr_cu_error_string(tr_cuda *c, int code);

void *tr_devptr_addr(tr_devptr p);

#define TR_MISSING (-1)

#endif
