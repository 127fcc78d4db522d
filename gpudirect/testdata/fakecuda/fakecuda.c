// A fake libcuda.so.1 for tests on hosts without a GPU: the CUDA driver
// entry points gpudirect uses, over host memory. It checks the protocol a
// real driver needs: a current context for memory calls, device handles
// from cuDeviceGet, balanced primary context retains and releases,
// CU_POINTER_ATTRIBUTE_SYNC_MEMOPS set before copies, page-aligned DMA-BUF
// exports, and frees of allocated pointers only.
//
// It also emulates, with the real driver's semantics and error codes, what
// staging and CUDA IPC use: device memory in shared mappings (/dev/shm), so
// that an IPC handle opened in another process sees the same bytes, and
// handles that name an allocation's base (a receiver that forgets the
// offset reads the wrong bytes); streams whose copies run on a worker
// thread of their own, truly asynchronous to and from registered host
// memory and synchronous to and from pageable memory, as the driver's are;
// events; cuMemHostRegister/Unregister with their errors; and a failure
// switch.
//
// Build: gcc -shared -fPIC -pthread -o libcuda.so.1 fakecuda.c
// FAKECUDA_NO_DEVICE=1 makes cuInit fail with CUDA_ERROR_NO_DEVICE.
// FAKECUDA_COPY_DELAY_US=N makes each asynchronous copy wait N µs on its
// stream's worker before it moves its bytes (so that a missing wait shows).
// FAKECUDA_FAIL=name:N[:code] makes the Nth call of entry point name fail
// with code (default CUDA_ERROR_UNKNOWN, 999).

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
typedef struct ctx { int device; } *CUcontext;

enum {
	SUCCESS = 0,
	INVALID_VALUE = 1,
	OUT_OF_MEMORY = 2,
	NOT_INITIALIZED = 3,
	NO_DEVICE = 100,
	INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201,
	INVALID_HANDLE = 400,
	NOT_READY = 600,
	HOST_MEMORY_ALREADY_REGISTERED = 712,
	HOST_MEMORY_NOT_REGISTERED = 713,
	UNKNOWN = 999,
};

#define HANDLE_BASE 100 // device handles differ from ordinals, as they may in real drivers
#define MAX_ALLOCS 64

static struct ctx primary = {HANDLE_BASE};
static int retains;
static int initialized;
static __thread CUcontext current;

// Allocations, and the IPC mappings opened here (opened = 1): each a
// shared mapping of a file in /dev/shm named by the exporting process and
// the allocation's id.
static struct {
	void *p;
	size_t n, mapped;
	int sync;
	int opened;
	unsigned long long id;
} allocs[MAX_ALLOCS];
static unsigned long long next_id = 1;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; // allocs, registered, events, streams' queues
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;

static int fail_point(const char *name);
static void wait_idle(void);
static int host_registered(const void *p, size_t n);

int cuInit(unsigned int flags) {
	if (flags != 0) {
		return INVALID_VALUE;
	}
	const char *e = getenv("FAKECUDA_NO_DEVICE");
	if (e != NULL && e[0] == '1') {
		return NO_DEVICE;
	}
	initialized = 1;
	return SUCCESS;
}

int cuDriverGetVersion(int *v) {
	*v = 12040;
	return SUCCESS;
}

int cuDeviceGetCount(int *n) {
	if (!initialized) {
		return NOT_INITIALIZED;
	}
	*n = 1;
	return SUCCESS;
}

int cuDeviceGet(int *dev, int ordinal) {
	if (ordinal != 0) {
		return INVALID_DEVICE;
	}
	*dev = HANDLE_BASE + ordinal;
	return SUCCESS;
}

int cuDeviceGetName(char *name, int len, int dev) {
	if (dev != HANDLE_BASE) {
		return INVALID_DEVICE;
	}
	strncpy(name, "Fake GPU", len);
	return SUCCESS;
}

int cuDeviceGetAttribute(int *v, int attr, int dev) {
	if (dev != HANDLE_BASE) {
		return INVALID_DEVICE;
	}
	switch (attr) {
	case 33: // PCI bus
		*v = 3;
		break;
	case 34: // PCI device
	case 50: // PCI domain
		*v = 0;
		break;
	case 116: // GPUDirect RDMA
	case 124: // DMA-BUF
		*v = 1;
		break;
	default:
		return INVALID_VALUE;
	}
	return SUCCESS;
}

int cuDeviceTotalMem_v2(size_t *n, int dev) {
	if (dev != HANDLE_BASE) {
		return INVALID_DEVICE;
	}
	*n = (size_t)16 << 30;
	return SUCCESS;
}

int cuDevicePrimaryCtxRetain(CUcontext *ctx, int dev) {
	if (dev != HANDLE_BASE) {
		return INVALID_DEVICE;
	}
	retains++;
	*ctx = &primary;
	return SUCCESS;
}

int cuDevicePrimaryCtxRelease_v2(int dev) {
	if (dev != HANDLE_BASE || retains == 0) {
		return INVALID_CONTEXT;
	}
	retains--;
	return SUCCESS;
}

int cuCtxGetCurrent(CUcontext *ctx) {
	*ctx = current;
	return SUCCESS;
}

int cuCtxSetCurrent(CUcontext ctx) {
	if (ctx != NULL && (ctx != &primary || retains == 0)) {
		return INVALID_CONTEXT;
	}
	current = ctx;
	return SUCCESS;
}

static int find(CUdeviceptr p, size_t n) {
	for (int i = 0; i < MAX_ALLOCS; i++) {
		char *base = allocs[i].p;
		if (base != NULL && (char *)(uintptr_t)p >= base && (char *)(uintptr_t)p + n <= base + allocs[i].n) {
			return i;
		}
	}
	return -1;
}

static void shm_name(char *buf, size_t n, int pid, unsigned long long id) {
	snprintf(buf, n, "/dev/shm/fakecuda-%d-%llu", pid, id);
}

int cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	if (n == 0) {
		return INVALID_VALUE;
	}
	pthread_mutex_lock(&mu);
	int i = 0;
	while (i < MAX_ALLOCS && allocs[i].p != NULL) {
		i++;
	}
	if (i == MAX_ALLOCS) {
		pthread_mutex_unlock(&mu);
		return OUT_OF_MEMORY;
	}
	size_t mapped = (n + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1);
	unsigned long long id = next_id++;
	char name[64];
	shm_name(name, sizeof name, getpid(), id);
	int fd = open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0 && errno == EEXIST) {
		// A leftover of a process that had this pid and died before it
		// freed its memory (ids are unique within a process): without
		// this, a test whose pid was reused fails its first allocation.
		unlink(name);
		fd = open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	}
	void *m = MAP_FAILED;
	if (fd >= 0 && ftruncate(fd, mapped) == 0) {
		m = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	}
	if (fd >= 0) {
		close(fd);
	}
	if (m == MAP_FAILED) {
		unlink(name);
		pthread_mutex_unlock(&mu);
		return OUT_OF_MEMORY;
	}
	allocs[i].p = m;
	allocs[i].n = n;
	allocs[i].mapped = mapped;
	allocs[i].sync = 0;
	allocs[i].opened = 0;
	allocs[i].id = id;
	*p = (CUdeviceptr)(uintptr_t)m;
	pthread_mutex_unlock(&mu);
	return SUCCESS;
}

// Freeing synchronises, as the real driver's cuMemFree does.
int cuMemFree_v2(CUdeviceptr p) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	wait_idle();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].p != NULL && !allocs[i].opened && (CUdeviceptr)(uintptr_t)allocs[i].p == p) {
			char name[64];
			shm_name(name, sizeof name, getpid(), allocs[i].id);
			unlink(name);
			munmap(allocs[i].p, allocs[i].mapped);
			allocs[i].p = NULL;
			pthread_mutex_unlock(&mu);
			return SUCCESS;
		}
	}
	pthread_mutex_unlock(&mu);
	return INVALID_VALUE;
}

int cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	int i = find(p, 1);
	if (attr != 6 || i < 0 || *(const unsigned int *)value != 1) {
		return INVALID_VALUE;
	}
	allocs[i].sync = 1;
	return SUCCESS;
}

int cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	int i = find(dst, n);
	if (i < 0 || !allocs[i].sync) {
		return INVALID_VALUE;
	}
	memcpy((void *)(uintptr_t)dst, src, n);
	return SUCCESS;
}

int cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	int i = find(src, n);
	if (i < 0 || !allocs[i].sync) {
		return INVALID_VALUE;
	}
	memcpy(dst, (void *)(uintptr_t)src, n);
	return SUCCESS;
}

int cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	long page = sysconf(_SC_PAGESIZE);
	if (type != 1 || flags != 0 || find(p, n) < 0 || p % page != 0 || n % page != 0) {
		return INVALID_VALUE;
	}
	int fd = memfd_create("fakecuda-dmabuf", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, n) != 0) {
		return OUT_OF_MEMORY;
	}
	*(int *)handle = fd;
	return SUCCESS;
}

int cuGetErrorName(int code, const char **s) {
	switch (code) {
	case INVALID_VALUE:
		*s = "CUDA_ERROR_INVALID_VALUE";
		return SUCCESS;
	case NO_DEVICE:
		*s = "CUDA_ERROR_NO_DEVICE";
		return SUCCESS;
	case INVALID_CONTEXT:
		*s = "CUDA_ERROR_INVALID_CONTEXT";
		return SUCCESS;
	case INVALID_HANDLE:
		*s = "CUDA_ERROR_INVALID_HANDLE";
		return SUCCESS;
	case NOT_READY:
		*s = "CUDA_ERROR_NOT_READY";
		return SUCCESS;
	case HOST_MEMORY_ALREADY_REGISTERED:
		*s = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
		return SUCCESS;
	case HOST_MEMORY_NOT_REGISTERED:
		*s = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
		return SUCCESS;
	case OUT_OF_MEMORY:
		*s = "CUDA_ERROR_OUT_OF_MEMORY";
		return SUCCESS;
	case UNKNOWN:
		*s = "CUDA_ERROR_UNKNOWN";
		return SUCCESS;
	}
	return INVALID_VALUE;
}

int cuGetErrorString(int code, const char **s) {
	switch (code) {
	case INVALID_VALUE:
		*s = "invalid argument";
		return SUCCESS;
	case NO_DEVICE:
		*s = "no CUDA-capable device is detected";
		return SUCCESS;
	case INVALID_CONTEXT:
		*s = "invalid device context";
		return SUCCESS;
	}
	return INVALID_VALUE;
}


// ---- The failure switch: FAKECUDA_FAIL=name:N[:code].

static int fail_point(const char *name) {
	static int calls;
	static char last[128]; // the setting calls counts for: a new one starts again
	const char *e = getenv("FAKECUDA_FAIL");
	if (e == NULL) {
		return SUCCESS;
	}
	pthread_mutex_lock(&mu);
	if (strncmp(last, e, sizeof last - 1) != 0) {
		strncpy(last, e, sizeof last - 1);
		calls = 0;
	}
	pthread_mutex_unlock(&mu);
	size_t len = strlen(name);
	if (strncmp(e, name, len) != 0 || e[len] != ':') {
		return SUCCESS;
	}
	int n = atoi(e + len + 1);
	const char *c = strchr(e + len + 1, ':');
	int code = c != NULL ? atoi(c + 1) : UNKNOWN;
	pthread_mutex_lock(&mu);
	int k = ++calls;
	pthread_mutex_unlock(&mu);
	return k == n ? code : SUCCESS;
}

#define FAIL_POINT(name)                   \
	do {                                   \
		int fail_code_ = fail_point(name); \
		if (fail_code_ != SUCCESS) {       \
			return fail_code_;             \
		}                                  \
	} while (0)

#define NEED_CTX()                      \
	do {                                \
		if (current != &primary) {      \
			return INVALID_CONTEXT;     \
		}                               \
	} while (0)

// ---- Host memory registration.

#define MAX_REGISTERED 256

static struct {
	char *p;
	size_t n;
} registered[MAX_REGISTERED];

static int host_registered(const void *p, size_t n) {
	const char *c = p;
	for (int i = 0; i < MAX_REGISTERED; i++) {
		if (registered[i].p != NULL && c >= registered[i].p && c + n <= registered[i].p + registered[i].n) {
			return 1;
		}
	}
	return 0;
}

int cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
	NEED_CTX();
	FAIL_POINT("cuMemHostRegister");
	if (p == NULL || n == 0 || (flags & ~0xfu) != 0) {
		return INVALID_VALUE;
	}
	char *c = p;
	pthread_mutex_lock(&mu);
	int free_slot = -1;
	for (int i = 0; i < MAX_REGISTERED; i++) {
		if (registered[i].p == NULL) {
			if (free_slot < 0) {
				free_slot = i;
			}
			continue;
		}
		if (c < registered[i].p + registered[i].n && registered[i].p < c + n) {
			pthread_mutex_unlock(&mu);
			return HOST_MEMORY_ALREADY_REGISTERED;
		}
	}
	if (free_slot < 0) {
		pthread_mutex_unlock(&mu);
		return OUT_OF_MEMORY;
	}
	registered[free_slot].p = c;
	registered[free_slot].n = n;
	pthread_mutex_unlock(&mu);
	return SUCCESS;
}

// Unregistering synchronises, as the real driver's does.
int cuMemHostUnregister(void *p) {
	NEED_CTX();
	FAIL_POINT("cuMemHostUnregister");
	wait_idle();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAX_REGISTERED; i++) {
		if (registered[i].p != NULL && registered[i].p == p) {
			registered[i].p = NULL;
			pthread_mutex_unlock(&mu);
			return SUCCESS;
		}
	}
	pthread_mutex_unlock(&mu);
	return HOST_MEMORY_NOT_REGISTERED;
}

// ---- Streams and events. Each stream has a worker thread that runs its
// operations in order; a copy waits FAKECUDA_COPY_DELAY_US first.

enum { OP_COPY, OP_EVENT };

struct op {
	int kind;
	void *dst;
	const void *src;
	size_t n;
	struct fc_event *ev;
	struct op *next;
};

struct fc_stream {
	pthread_t worker;
	struct op *head, *tail;
	int busy, quit;
	struct fc_stream *next_stream;
};

struct fc_event {
	int recorded, done;
};

typedef struct fc_stream *CUstream;
typedef struct fc_event *CUevent;

static struct fc_stream *streams;

static void *stream_worker(void *arg) {
	struct fc_stream *s = arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		while (s->head == NULL && !s->quit) {
			pthread_cond_wait(&changed, &mu);
		}
		if (s->head == NULL) {
			break;
		}
		struct op *o = s->head;
		s->busy = 1;
		pthread_mutex_unlock(&mu);
		if (o->kind == OP_COPY) {
			const char *d = getenv("FAKECUDA_COPY_DELAY_US");
			long us = d != NULL ? atol(d) : 0;
			if (us > 0) {
				struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
				nanosleep(&ts, NULL);
			}
			memcpy(o->dst, o->src, o->n);
		}
		pthread_mutex_lock(&mu);
		if (o->kind == OP_EVENT) {
			o->ev->done = 1;
		}
		s->head = o->next;
		if (s->head == NULL) {
			s->tail = NULL;
		}
		s->busy = 0;
		free(o);
		pthread_cond_broadcast(&changed);
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

static int valid_stream(CUstream s) {
	for (struct fc_stream *x = streams; x != NULL; x = x->next_stream) {
		if (x == s) {
			return 1;
		}
	}
	return 0;
}

// wait_idle returns when no stream has work.
static void wait_idle(void) {
	pthread_mutex_lock(&mu);
	for (;;) {
		int idle = 1;
		for (struct fc_stream *x = streams; x != NULL; x = x->next_stream) {
			if (x->head != NULL || x->busy) {
				idle = 0;
			}
		}
		if (idle) {
			break;
		}
		pthread_cond_wait(&changed, &mu);
	}
	pthread_mutex_unlock(&mu);
}

int cuStreamCreate(CUstream *s, unsigned int flags) {
	NEED_CTX();
	FAIL_POINT("cuStreamCreate");
	if (s == NULL || flags > 1) {
		return INVALID_VALUE;
	}
	struct fc_stream *x = calloc(1, sizeof *x);
	if (x == NULL) {
		return OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&mu);
	x->next_stream = streams;
	streams = x;
	pthread_mutex_unlock(&mu);
	if (pthread_create(&x->worker, NULL, stream_worker, x) != 0) {
		return OUT_OF_MEMORY;
	}
	*s = x;
	return SUCCESS;
}

static int stream_sync(CUstream s) {
	pthread_mutex_lock(&mu);
	if (!valid_stream(s)) {
		pthread_mutex_unlock(&mu);
		return INVALID_HANDLE;
	}
	while (s->head != NULL || s->busy) {
		pthread_cond_wait(&changed, &mu);
	}
	pthread_mutex_unlock(&mu);
	return SUCCESS;
}

int cuStreamSynchronize(CUstream s) {
	NEED_CTX();
	FAIL_POINT("cuStreamSynchronize");
	return stream_sync(s);
}

// Destroying a stream lets its work finish first, as the driver does.
int cuStreamDestroy_v2(CUstream s) {
	NEED_CTX();
	int r = stream_sync(s);
	if (r != SUCCESS) {
		return r;
	}
	pthread_mutex_lock(&mu);
	for (struct fc_stream **x = &streams; *x != NULL; x = &(*x)->next_stream) {
		if (*x == s) {
			*x = s->next_stream;
			break;
		}
	}
	s->quit = 1;
	pthread_cond_broadcast(&changed);
	pthread_mutex_unlock(&mu);
	pthread_join(s->worker, NULL);
	free(s);
	return SUCCESS;
}

static int enqueue(CUstream s, struct op *o) {
	pthread_mutex_lock(&mu);
	if (!valid_stream(s)) {
		pthread_mutex_unlock(&mu);
		free(o);
		return INVALID_HANDLE;
	}
	if (s->tail != NULL) {
		s->tail->next = o;
	} else {
		s->head = o;
	}
	s->tail = o;
	pthread_cond_broadcast(&changed);
	pthread_mutex_unlock(&mu);
	return SUCCESS;
}

// copy_async enqueues a copy; one to or from host memory that is not
// registered is synchronous to the host, as the real driver makes it:
// it waits for the stream's earlier work, then copies.
static int copy_async(void *dst, const void *src, size_t n, CUstream s, const void *host) {
	if (n == 0) {
		return SUCCESS;
	}
	if (host != NULL && !host_registered(host, n)) {
		int r = stream_sync(s);
		if (r == SUCCESS) {
			memcpy(dst, src, n);
		}
		return r;
	}
	struct op *o = calloc(1, sizeof *o);
	if (o == NULL) {
		return OUT_OF_MEMORY;
	}
	o->kind = OP_COPY;
	o->dst = dst;
	o->src = src;
	o->n = n;
	return enqueue(s, o);
}

int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	NEED_CTX();
	FAIL_POINT("cuMemcpyHtoDAsync");
	if (find(dst, n) < 0) {
		return INVALID_VALUE;
	}
	return copy_async((void *)(uintptr_t)dst, src, n, s, src);
}

int cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
	NEED_CTX();
	FAIL_POINT("cuMemcpyDtoHAsync");
	if (find(src, n) < 0) {
		return INVALID_VALUE;
	}
	return copy_async(dst, (void *)(uintptr_t)src, n, s, dst);
}

int cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	NEED_CTX();
	FAIL_POINT("cuMemcpyDtoDAsync");
	if (find(dst, n) < 0 || find(src, n) < 0) {
		return INVALID_VALUE;
	}
	return copy_async((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n, s, NULL);
}

int cuEventCreate(CUevent *e, unsigned int flags) {
	NEED_CTX();
	FAIL_POINT("cuEventCreate");
	if (e == NULL || flags > 0xf) {
		return INVALID_VALUE;
	}
	*e = calloc(1, sizeof **e);
	return *e == NULL ? OUT_OF_MEMORY : SUCCESS;
}

int cuEventRecord(CUevent e, CUstream s) {
	NEED_CTX();
	FAIL_POINT("cuEventRecord");
	if (e == NULL) {
		return INVALID_HANDLE;
	}
	struct op *o = calloc(1, sizeof *o);
	if (o == NULL) {
		return OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&mu);
	e->recorded = 1;
	e->done = 0;
	pthread_mutex_unlock(&mu);
	o->kind = OP_EVENT;
	o->ev = e;
	return enqueue(s, o);
}

int cuEventQuery(CUevent e) {
	NEED_CTX();
	FAIL_POINT("cuEventQuery");
	if (e == NULL) {
		return INVALID_HANDLE;
	}
	pthread_mutex_lock(&mu);
	int done = !e->recorded || e->done;
	pthread_mutex_unlock(&mu);
	return done ? SUCCESS : NOT_READY;
}

int cuEventSynchronize(CUevent e) {
	NEED_CTX();
	FAIL_POINT("cuEventSynchronize");
	if (e == NULL) {
		return INVALID_HANDLE;
	}
	pthread_mutex_lock(&mu);
	while (e->recorded && !e->done) {
		pthread_cond_wait(&changed, &mu);
	}
	pthread_mutex_unlock(&mu);
	return SUCCESS;
}

// Destroying an event still pending is allowed (the driver frees it once
// it completes): the emulator waits for it.
int cuEventDestroy_v2(CUevent e) {
	NEED_CTX();
	if (e == NULL) {
		return INVALID_HANDLE;
	}
	cuEventSynchronize(e);
	free(e);
	return SUCCESS;
}

// ---- Address ranges, device UUIDs and IPC handles.

int cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	NEED_CTX();
	pthread_mutex_lock(&mu);
	int i = find(p, 1);
	if (i >= 0) {
		if (base != NULL) {
			*base = (CUdeviceptr)(uintptr_t)allocs[i].p;
		}
		if (size != NULL) {
			*size = allocs[i].n;
		}
	}
	pthread_mutex_unlock(&mu);
	return i >= 0 ? SUCCESS : INVALID_VALUE;
}

int cuDeviceGetUuid_v2(char *uuid, int dev) {
	if (dev != HANDLE_BASE) {
		return INVALID_DEVICE;
	}
	memcpy(uuid, "fakecuda-gpu-000", 16);
	return SUCCESS;
}

// An IPC handle names an allocation's base, whatever address of it was
// asked for, as the real driver's does: the exporting process, the
// allocation's id and its size.
struct ipc_handle {
	char magic[8];
	unsigned long long id;
	size_t n, mapped;
	int pid;
	char pad[64 - 8 - sizeof(unsigned long long) - 2 * sizeof(size_t) - sizeof(int)];
};
_Static_assert(sizeof(struct ipc_handle) == 64, "CUipcMemHandle is 64 bytes");

int cuIpcGetMemHandle(void *handle, CUdeviceptr p) {
	NEED_CTX();
	FAIL_POINT("cuIpcGetMemHandle");
	pthread_mutex_lock(&mu);
	int i = find(p, 1);
	if (i < 0 || allocs[i].opened) {
		pthread_mutex_unlock(&mu);
		return INVALID_VALUE;
	}
	struct ipc_handle h;
	memset(&h, 0, sizeof h);
	memcpy(h.magic, "fakecuda", 8);
	h.pid = getpid();
	h.id = allocs[i].id;
	h.n = allocs[i].n;
	h.mapped = allocs[i].mapped;
	pthread_mutex_unlock(&mu);
	memcpy(handle, &h, sizeof h);
	return SUCCESS;
}

int cuIpcOpenMemHandle_v2(CUdeviceptr *p, struct ipc_handle h, unsigned int flags) {
	NEED_CTX();
	FAIL_POINT("cuIpcOpenMemHandle");
	if (memcmp(h.magic, "fakecuda", 8) != 0 || flags > 1) {
		return INVALID_VALUE;
	}
	if (h.pid == getpid()) {
		return INVALID_CONTEXT; // a handle cannot be opened in the process that exported it
	}
	char name[64];
	shm_name(name, sizeof name, h.pid, h.id);
	int fd = open(name, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		return INVALID_VALUE; // freed by its owner, or never there
	}
	void *m = mmap(NULL, h.mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) {
		return OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].p == NULL) {
			allocs[i].p = m;
			allocs[i].n = h.n;
			allocs[i].mapped = h.mapped;
			allocs[i].sync = 1;
			allocs[i].opened = 1;
			allocs[i].id = h.id;
			pthread_mutex_unlock(&mu);
			*p = (CUdeviceptr)(uintptr_t)m;
			return SUCCESS;
		}
	}
	pthread_mutex_unlock(&mu);
	munmap(m, h.mapped);
	return OUT_OF_MEMORY;
}

int cuIpcCloseMemHandle(CUdeviceptr p) {
	NEED_CTX();
	wait_idle();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].p != NULL && allocs[i].opened && (CUdeviceptr)(uintptr_t)allocs[i].p == p) {
			munmap(allocs[i].p, allocs[i].mapped);
			allocs[i].p = NULL;
			pthread_mutex_unlock(&mu);
			return SUCCESS;
		}
	}
	pthread_mutex_unlock(&mu);
	return INVALID_VALUE;
}
