// A fake libcuda.so.1 for tests on hosts without a GPU: the CUDA driver
// entry points gpudirect uses, over host memory. It checks the protocol a
// real driver needs: a current context for memory calls, device handles
// from cuDeviceGet, balanced primary context retains and releases,
// CU_POINTER_ATTRIBUTE_SYNC_MEMOPS set before copies, page-aligned DMA-BUF
// exports, and frees of allocated pointers only.
//
// Build: gcc -shared -fPIC -o libcuda.so.1 fakecuda.c
// FAKECUDA_NO_DEVICE=1 makes cuInit fail with CUDA_ERROR_NO_DEVICE.

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
};

#define HANDLE_BASE 100 // device handles differ from ordinals, as they may in real drivers
#define MAX_ALLOCS 64

static struct ctx primary = {HANDLE_BASE};
static int retains;
static int initialized;
static __thread CUcontext current;

static struct {
	void *p;
	size_t n;
	int sync;
} allocs[MAX_ALLOCS];

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

int cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	for (int i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].p == NULL) {
			void *m = aligned_alloc(2 << 20, (n + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1));
			if (m == NULL) {
				return OUT_OF_MEMORY;
			}
			allocs[i].p = m;
			allocs[i].n = n;
			allocs[i].sync = 0;
			*p = (CUdeviceptr)(uintptr_t)m;
			return SUCCESS;
		}
	}
	return OUT_OF_MEMORY;
}

int cuMemFree_v2(CUdeviceptr p) {
	if (current != &primary) {
		return INVALID_CONTEXT;
	}
	for (int i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].p != NULL && (CUdeviceptr)(uintptr_t)allocs[i].p == p) {
			free(allocs[i].p);
			allocs[i].p = NULL;
			return SUCCESS;
		}
	}
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

