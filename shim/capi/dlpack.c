// The C half of the shim: DLManagedTensor allocation and deleter, the
// trampoline through which Go calls a handler's function pointer, and the
// PyCapsule destructor the Python package uses. Go code cannot call C
// function pointers itself, and a file with //export may only declare C
// functions, so they live here.

#include <stdlib.h>
#include <string.h>

#include "tensorrpc.h"
#include "_cgo_export.h"

// trpc_managed_alloc allocates a DLManagedTensor and its shape array in one
// malloc'd block, which trpc_managed_deleter frees. handle names the Go
// tensor whose reference the DLManagedTensor owns.
DLManagedTensor *trpc_managed_alloc(int32_t ndim, uint64_t handle) {
  size_t n = ndim > 0 ? (size_t)ndim : 0;
  DLManagedTensor *m = malloc(sizeof(DLManagedTensor) + n * sizeof(int64_t));
  if (m == NULL) {
    return NULL;
  }
  memset(m, 0, sizeof(DLManagedTensor));
  m->dl_tensor.device.device_type = 1;  // kDLCPU
  m->dl_tensor.ndim = ndim;
  m->dl_tensor.shape = (int64_t *)(m + 1);
  m->manager_ctx = (void *)(uintptr_t)handle;
  m->deleter = trpc_managed_deleter;
  return m;
}

// trpc_managed_deleter releases the Go tensor's reference and frees the
// struct. Any thread may call it, once per DLManagedTensor.
void trpc_managed_deleter(DLManagedTensor *self) {
  if (self == NULL) {
    return;
  }
  trpcgo_tensor_unref((uint64_t)(uintptr_t)self->manager_ctx);
  free(self);
}

int trpc_invoke_handler(trpc_handler_fn fn, void *user_data, trpc_reply reply,
                        const char *method, const uint8_t *metadata,
                        int64_t metadata_len, DLManagedTensor **tensors,
                        int64_t n_tensors) {
  return fn(user_data, reply, method, metadata, metadata_len, tensors,
            n_tensors);
}

// The Python package hands in PyCapsule_IsValid and PyCapsule_GetPointer so
// that this library needs no link-time dependency on libpython.
typedef int (*capsule_is_valid_fn)(void *, const char *);
typedef void *(*capsule_get_pointer_fn)(void *, const char *);
static capsule_is_valid_fn capsule_is_valid;
static capsule_get_pointer_fn capsule_get_pointer;

static const char dltensor_name[] = "dltensor";

const char *trpc_dltensor_name(void) { return dltensor_name; }

void trpc_set_capsule_api(void *is_valid, void *get_pointer) {
  capsule_is_valid = (capsule_is_valid_fn)is_valid;
  capsule_get_pointer = (capsule_get_pointer_fn)get_pointer;
}

// trpc_dlpack_capsule_destructor is the destructor of the "dltensor"
// capsules the Python package makes. The DLPack protocol says a consumer
// renames the capsule to "used_dltensor" and takes over the tensor; a
// capsule that still has its name was never consumed, so its tensor is
// released here. It runs with the GIL held.
void trpc_dlpack_capsule_destructor(void *capsule) {
  if (capsule_is_valid == NULL || capsule_get_pointer == NULL) {
    return;
  }
  if (!capsule_is_valid(capsule, dltensor_name)) {
    return;
  }
  DLManagedTensor *m = capsule_get_pointer(capsule, dltensor_name);
  if (m != NULL && m->deleter != NULL) {
    m->deleter(m);
  }
}
