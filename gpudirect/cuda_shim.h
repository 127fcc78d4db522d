// Declarations of the few CUDA driver API entry points gpudirect uses, with
// their ABI types spelled out, so that no CUDA header is needed to build.
// The library is opened with dlopen at run time.

#ifndef TENSORRPC_GPUDIRECT_CUDA_SHIM_H
#define TENSORRPC_GPUDIRECT_CUDA_SHIM_H

#include <stddef.h>

typedef unsigned long long tr_devptr; // CUdeviceptr on 64-bit hosts
typedef struct tr_ctx_st *tr_ctx;     // CUcontext
typedef struct tr_cuda tr_cuda;

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

const char *tr_cu_error_name(tr_cuda *c, int code);
const char *tr_cu_error_string(tr_cuda *c, int code);

void *tr_devptr_addr(tr_devptr p);

#define TR_MISSING (-1)

#endif
