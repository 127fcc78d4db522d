//go:build linux && cgo

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <stdio.h>

#include "cuda_shim.h"

// CUDA driver API values used here (cuda.h).
enum {
	CU_POINTER_ATTRIBUTE_SYNC_MEMOPS = 6,
	CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
};

struct tr_cuda {
	int (*init)(unsigned int);
	int (*driver_version)(int *);
	int (*device_count)(int *);
	int (*device_get)(int *, int);
	int (*device_name)(char *, int, int);
	int (*device_attribute)(int *, int, int);
	int (*device_total_mem)(size_t *, int);
	int (*primary_retain)(tr_ctx *, int);
	int (*primary_release)(int);
	int (*ctx_get_current)(tr_ctx *);
	int (*ctx_set_current)(tr_ctx);
	int (*mem_alloc)(tr_devptr *, size_t);
	int (*mem_free)(tr_devptr);
	int (*htod)(tr_devptr, const void *, size_t);
	int (*dtoh)(void *, tr_devptr, size_t);
	int (*pointer_set_attribute)(const void *, int, tr_devptr);
	// Optional: absent from older drivers.
	int (*handle_for_range)(void *, tr_devptr, size_t, int, unsigned long long);
	int (*error_name)(int, const char **);
	int (*error_string)(int, const char **);
	// Optional, for asynchronous staging, pinning and IPC (TR_MISSING when
	// the driver lacks them).
	int (*stream_create)(tr_stream *, unsigned int);
	int (*stream_destroy)(tr_stream);
	int (*stream_sync)(tr_stream);
	int (*htod_async)(tr_devptr, const void *, size_t, tr_stream);
	int (*dtoh_async)(void *, tr_devptr, size_t, tr_stream);
	int (*dtod_async)(tr_devptr, tr_devptr, size_t, tr_stream);
	int (*event_create)(tr_event *, unsigned int);
	int (*event_record)(tr_event, tr_stream);
	int (*event_query)(tr_event);
	int (*event_sync)(tr_event);
	int (*event_destroy)(tr_event);
	int (*host_register)(void *, size_t, unsigned int);
	int (*host_unregister)(void *);
	int (*ipc_get)(tr_ipc_handle *, tr_devptr);
	int (*ipc_open)(tr_devptr *, tr_ipc_handle, unsigned int);
	int (*ipc_close)(tr_devptr);
	int (*address_range)(tr_devptr *, size_t *, tr_devptr);
	int (*device_uuid)(tr_uuid *, int);
};

static char *dup_message(const char *prefix, const char *detail) {
	size_t n = strlen(prefix) + strlen(detail) + 1;
	char *s = malloc(n);
	if (s != NULL) {
		snprintf(s, n, "%s%s", prefix, detail);
	}
	return s;
}

tr_cuda *tr_cuda_open(const char *path, char **err, int *not_found) {
	*err = NULL;
	*not_found = 0;
	dlerror();
	// The handle is never closed: the CUDA driver does not support being
	// unloaded, and one load serves the whole process.
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		if (e == NULL) {
			e = "dlopen failed";
		}
		*not_found = strstr(e, "No such file") != NULL || strstr(e, "cannot open shared object file") != NULL;
		*err = dup_message("", e);
		return NULL;
	}
	tr_cuda *c = calloc(1, sizeof *c);
	if (c == NULL) {
		*err = dup_message("", "out of memory");
		return NULL;
	}
	struct {
		void **fn;
		const char *name;
		const char *fallback;
		int optional;
	} syms[] = {
		{(void **)&c->init, "cuInit", NULL, 0},
		{(void **)&c->driver_version, "cuDriverGetVersion", NULL, 0},
		{(void **)&c->device_count, "cuDeviceGetCount", NULL, 0},
		{(void **)&c->device_get, "cuDeviceGet", NULL, 0},
		{(void **)&c->device_name, "cuDeviceGetName", NULL, 0},
		{(void **)&c->device_attribute, "cuDeviceGetAttribute", NULL, 0},
		{(void **)&c->device_total_mem, "cuDeviceTotalMem_v2", "cuDeviceTotalMem", 0},
		{(void **)&c->primary_retain, "cuDevicePrimaryCtxRetain", NULL, 0},
		{(void **)&c->primary_release, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease", 0},
		{(void **)&c->ctx_get_current, "cuCtxGetCurrent", NULL, 0},
		{(void **)&c->ctx_set_current, "cuCtxSetCurrent", NULL, 0},
		{(void **)&c->mem_alloc, "cuMemAlloc_v2", NULL, 0},
		{(void **)&c->mem_free, "cuMemFree_v2", NULL, 0},
		{(void **)&c->htod, "cuMemcpyHtoD_v2", NULL, 0},
		{(void **)&c->dtoh, "cuMemcpyDtoH_v2", NULL, 0},
		{(void **)&c->pointer_set_attribute, "cuPointerSetAttribute", NULL, 0},
		{(void **)&c->handle_for_range, "cuMemGetHandleForAddressRange", NULL, 1},
		{(void **)&c->error_name, "cuGetErrorName", NULL, 1},
		{(void **)&c->error_string, "cuGetErrorString", NULL, 1},
		{(void **)&c->stream_create, "cuStreamCreate", NULL, 1},
		{(void **)&c->stream_destroy, "cuStreamDestroy_v2", "cuStreamDestroy", 1},
		{(void **)&c->stream_sync, "cuStreamSynchronize", NULL, 1},
		{(void **)&c->htod_async, "cuMemcpyHtoDAsync_v2", NULL, 1},
		{(void **)&c->dtoh_async, "cuMemcpyDtoHAsync_v2", NULL, 1},
		{(void **)&c->dtod_async, "cuMemcpyDtoDAsync_v2", NULL, 1},
		{(void **)&c->event_create, "cuEventCreate", NULL, 1},
		{(void **)&c->event_record, "cuEventRecord", NULL, 1},
		{(void **)&c->event_query, "cuEventQuery", NULL, 1},
		{(void **)&c->event_sync, "cuEventSynchronize", NULL, 1},
		{(void **)&c->event_destroy, "cuEventDestroy_v2", "cuEventDestroy", 1},
		{(void **)&c->host_register, "cuMemHostRegister_v2", "cuMemHostRegister", 1},
		{(void **)&c->host_unregister, "cuMemHostUnregister", NULL, 1},
		{(void **)&c->ipc_get, "cuIpcGetMemHandle", NULL, 1},
		{(void **)&c->ipc_open, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle", 1},
		{(void **)&c->ipc_close, "cuIpcCloseMemHandle", NULL, 1},
		{(void **)&c->address_range, "cuMemGetAddressRange_v2", NULL, 1},
		{(void **)&c->device_uuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid", 1},
	};
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		*syms[i].fn = dlsym(h, syms[i].name);
		if (*syms[i].fn == NULL && syms[i].fallback != NULL) {
			*syms[i].fn = dlsym(h, syms[i].fallback);
		}
		if (*syms[i].fn == NULL && !syms[i].optional) {
			*err = dup_message("the library lacks ", syms[i].name);
			free(c);
			return NULL;
		}
	}
	return c;
}

int tr_cu_init(tr_cuda *c) { return c->init(0); }
int tr_cu_driver_version(tr_cuda *c, int *v) { return c->driver_version(v); }
int tr_cu_device_count(tr_cuda *c, int *n) { return c->device_count(n); }
int tr_cu_device_get(tr_cuda *c, int *dev, int ordinal) { return c->device_get(dev, ordinal); }
int tr_cu_device_name(tr_cuda *c, char *name, int len, int dev) { return c->device_name(name, len, dev); }
int tr_cu_device_attribute(tr_cuda *c, int *v, int attr, int dev) { return c->device_attribute(v, attr, dev); }
int tr_cu_device_total_mem(tr_cuda *c, size_t *bytes, int dev) { return c->device_total_mem(bytes, dev); }
int tr_cu_primary_retain(tr_cuda *c, tr_ctx *ctx, int dev) { return c->primary_retain(ctx, dev); }
int tr_cu_primary_release(tr_cuda *c, int dev) { return c->primary_release(dev); }

// A Go goroutine may run on any thread, and the thread's current context
// may belong to someone else (a framework sharing the process): every call
// makes ours current and puts the previous one back.
#define WITH_CTX(c, ctx, call)                   \
	do {                                         \
		tr_ctx prev = NULL;                      \
		int r = (c)->ctx_get_current(&prev);     \
		if (r != 0) {                            \
			return r;                            \
		}                                        \
		if (prev != (ctx)) {                     \
			r = (c)->ctx_set_current(ctx);       \
			if (r != 0) {                        \
				return r;                        \
			}                                    \
		}                                        \
		r = (call);                              \
		if (prev != (ctx)) {                     \
			(c)->ctx_set_current(prev);          \
		}                                        \
		return r;                                \
	} while (0)

int tr_cu_mem_alloc(tr_cuda *c, tr_ctx ctx, tr_devptr *p, size_t n) { WITH_CTX(c, ctx, c->mem_alloc(p, n)); }
int tr_cu_mem_free(tr_cuda *c, tr_ctx ctx, tr_devptr p) { WITH_CTX(c, ctx, c->mem_free(p)); }
int tr_cu_htod(tr_cuda *c, tr_ctx ctx, tr_devptr dst, const void *src, size_t n) { WITH_CTX(c, ctx, c->htod(dst, src, n)); }
int tr_cu_dtoh(tr_cuda *c, tr_ctx ctx, void *dst, tr_devptr src, size_t n) { WITH_CTX(c, ctx, c->dtoh(dst, src, n)); }

int tr_cu_sync_memops(tr_cuda *c, tr_ctx ctx, tr_devptr p) {
	unsigned int one = 1;
	WITH_CTX(c, ctx, c->pointer_set_attribute(&one, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p));
}

int tr_cu_dmabuf(tr_cuda *c, tr_ctx ctx, int *fd, tr_devptr p, size_t n) {
	if (c->handle_for_range == NULL) {
		return TR_MISSING;
	}
	WITH_CTX(c, ctx, c->handle_for_range(fd, p, n, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
}

// The asynchronous, pinning and IPC entry points, each TR_MISSING when the
// driver lacks it.
#define NEED(fn)                 \
	do {                         \
		if ((fn) == NULL) {      \
			return TR_MISSING;   \
		}                        \
	} while (0)

int tr_cu_async_ready(tr_cuda *c) {
	return c->stream_create != NULL && c->stream_destroy != NULL && c->stream_sync != NULL && c->htod_async != NULL &&
	       c->dtoh_async != NULL && c->dtod_async != NULL && c->event_create != NULL && c->event_record != NULL &&
	       c->event_query != NULL && c->event_sync != NULL && c->event_destroy != NULL && c->host_register != NULL &&
	       c->host_unregister != NULL;
}

int tr_cu_ipc_ready(tr_cuda *c) {
	return c->ipc_get != NULL && c->ipc_open != NULL && c->ipc_close != NULL && c->address_range != NULL;
}

// Streams are made with flags 0 (blocking): they order after work on the
// legacy default stream, where producers such as PyTorch without a stream
// of their own put theirs.
int tr_cu_stream_create(tr_cuda *c, tr_ctx ctx, tr_stream *s) { NEED(c->stream_create); WITH_CTX(c, ctx, c->stream_create(s, 0)); }
int tr_cu_stream_destroy(tr_cuda *c, tr_ctx ctx, tr_stream s) { NEED(c->stream_destroy); WITH_CTX(c, ctx, c->stream_destroy(s)); }
int tr_cu_stream_sync(tr_cuda *c, tr_ctx ctx, tr_stream s) { NEED(c->stream_sync); WITH_CTX(c, ctx, c->stream_sync(s)); }
int tr_cu_htod_async(tr_cuda *c, tr_ctx ctx, tr_devptr dst, const void *src, size_t n, tr_stream s) {
	NEED(c->htod_async);
	WITH_CTX(c, ctx, c->htod_async(dst, src, n, s));
}
int tr_cu_dtoh_async(tr_cuda *c, tr_ctx ctx, void *dst, tr_devptr src, size_t n, tr_stream s) {
	NEED(c->dtoh_async);
	WITH_CTX(c, ctx, c->dtoh_async(dst, src, n, s));
}
int tr_cu_dtod_async(tr_cuda *c, tr_ctx ctx, tr_devptr dst, tr_devptr src, size_t n, tr_stream s) {
	NEED(c->dtod_async);
	WITH_CTX(c, ctx, c->dtod_async(dst, src, n, s));
}
// Events are made with CU_EVENT_DISABLE_TIMING (2): they only order.
int tr_cu_event_create(tr_cuda *c, tr_ctx ctx, tr_event *e) { NEED(c->event_create); WITH_CTX(c, ctx, c->event_create(e, 2)); }
int tr_cu_event_record(tr_cuda *c, tr_ctx ctx, tr_event e, tr_stream s) { NEED(c->event_record); WITH_CTX(c, ctx, c->event_record(e, s)); }
int tr_cu_event_query(tr_cuda *c, tr_ctx ctx, tr_event e) { NEED(c->event_query); WITH_CTX(c, ctx, c->event_query(e)); }
int tr_cu_event_sync(tr_cuda *c, tr_ctx ctx, tr_event e) { NEED(c->event_sync); WITH_CTX(c, ctx, c->event_sync(e)); }
int tr_cu_event_destroy(tr_cuda *c, tr_ctx ctx, tr_event e) { NEED(c->event_destroy); WITH_CTX(c, ctx, c->event_destroy(e)); }
// Host memory is registered CU_MEMHOSTREGISTER_PORTABLE (1): pinned for
// every context, as the pool is shared by every device staged for.
int tr_cu_host_register(tr_cuda *c, tr_ctx ctx, void *p, size_t n) { NEED(c->host_register); WITH_CTX(c, ctx, c->host_register(p, n, 1)); }
int tr_cu_host_unregister(tr_cuda *c, tr_ctx ctx, void *p) { NEED(c->host_unregister); WITH_CTX(c, ctx, c->host_unregister(p)); }
int tr_cu_ipc_get(tr_cuda *c, tr_ctx ctx, tr_ipc_handle *h, tr_devptr p) { NEED(c->ipc_get); WITH_CTX(c, ctx, c->ipc_get(h, p)); }
// Opened with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1).
int tr_cu_ipc_open(tr_cuda *c, tr_ctx ctx, tr_devptr *p, const tr_ipc_handle *h) {
	NEED(c->ipc_open);
	WITH_CTX(c, ctx, c->ipc_open(p, *h, 1));
}
int tr_cu_ipc_close(tr_cuda *c, tr_ctx ctx, tr_devptr p) { NEED(c->ipc_close); WITH_CTX(c, ctx, c->ipc_close(p)); }
int tr_cu_address_range(tr_cuda *c, tr_ctx ctx, tr_devptr *base, size_t *size, tr_devptr p) {
	NEED(c->address_range);
	WITH_CTX(c, ctx, c->address_range(base, size, p));
}
int tr_cu_device_uuid(tr_cuda *c, tr_uuid *u, int dev) {
	NEED(c->device_uuid);
	return c->device_uuid(u, dev);
}

const char *tr_cu_error_name(tr_cuda *c, int code) {
	const char *s = NULL;
	if (c->error_name == NULL || c->error_name(code, &s) != 0) {
		return NULL;
	}
	return s;
}

const char *tr_cu_error_string(tr_cuda *c, int code) {
	const char *s = NULL;
	if (c->error_string == NULL || c->error_string(code, &s) != 0) {
		return NULL;
	}
	return s;
}

void *tr_devptr_addr(tr_devptr p) { return (void *)(uintptr_t)p; }
