// The C half of the shim: DLManagedTensor allocation and deleter, the
// trampolines through which Go calls a handler's and a release function
// pointer, and the
// PyCapsule destructor the Python package uses. Go code cannot call C
// function pointers itself, and a file with //export may only declare C
// functions, so they live here.

#include <pthread.h>
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

// trpc_call_release calls trpc_server_publish_device's release function,
// when there is one.
void trpc_call_release(trpc_release_fn fn, void *owner) {
  if (fn != NULL) {
    fn(owner);
  }
}

// The Python package hands in PyCapsule_IsValid and PyCapsule_GetPointer so
// that this library needs no link-time dependency on libpython.
typedef int (*capsule_is_valid_fn)(void *, const char *);
typedef void *(*capsule_get_pointer_fn)(void *, const char *);
static capsule_is_valid_fn capsule_is_valid;
static capsule_get_pointer_fn capsule_get_pointer;

static const char dltensor_name[] = "dltensor";
static const char dltensor_versioned_name[] = "dltensor_versioned";

const char *trpc_dltensor_name(void) { return dltensor_name; }
const char *trpc_dltensor_versioned_name(void) {
  return dltensor_versioned_name;
}

void trpc_set_capsule_api(void *is_valid, void *get_pointer) {
  capsule_is_valid = (capsule_is_valid_fn)is_valid;
  capsule_get_pointer = (capsule_get_pointer_fn)get_pointer;
}

// trpc_dlpack_capsule_destructor is the destructor of the "dltensor" and
// "dltensor_versioned" capsules the Python package makes. The DLPack
// protocol says a consumer renames the capsule to "used_dltensor" (or
// "used_dltensor_versioned") and takes over the tensor; a capsule that
// still has its name was never consumed, so its tensor is released here.
// It runs with the GIL held. (PyCapsule_IsValid sets no exception.)
void trpc_dlpack_capsule_destructor(void *capsule) {
  if (capsule_is_valid == NULL || capsule_get_pointer == NULL) {
    return;
  }
  if (capsule_is_valid(capsule, dltensor_name)) {
    DLManagedTensor *m = capsule_get_pointer(capsule, dltensor_name);
    if (m != NULL && m->deleter != NULL) {
      m->deleter(m);
    }
  } else if (capsule_is_valid(capsule, dltensor_versioned_name)) {
    DLManagedTensorVersioned *m =
        capsule_get_pointer(capsule, dltensor_versioned_name);
    if (m != NULL && m->deleter != NULL) {
      m->deleter(m);
    }
  }
}

// A versioned tensor made by trpc_versioned_wrap owns the legacy
// DLManagedTensor in manager_ctx (whose block also holds the shape).
static void versioned_wrap_deleter(DLManagedTensorVersioned *self) {
  if (self == NULL) {
    return;
  }
  DLManagedTensor *inner = self->manager_ctx;
  if (inner != NULL && inner->deleter != NULL) {
    inner->deleter(inner);
  }
  free(self);
}

// trpc_versioned_wrap wraps inner (a DLManagedTensor of this library) in a
// DLManagedTensorVersioned that takes it over: its deleter deletes inner.
// On failure (NULL) inner is deleted.
DLManagedTensorVersioned *trpc_versioned_wrap(DLManagedTensor *inner,
                                              uint64_t flags) {
  DLManagedTensorVersioned *m = malloc(sizeof(DLManagedTensorVersioned));
  if (m == NULL) {
    if (inner->deleter != NULL) {
      inner->deleter(inner);
    }
    return NULL;
  }
  m->version.major = 1;
  m->version.minor = 0;
  m->manager_ctx = inner;
  m->deleter = versioned_wrap_deleter;
  m->flags = flags;
  m->dl_tensor = inner->dl_tensor;
  return m;
}

static void versioned_free_deleter(DLManagedTensorVersioned *self) {
  free(self);
}

// trpc_versioned_copy copies src (nbytes of compact data) into one malloc'd
// block holding the DLManagedTensorVersioned, its shape and the data.
DLManagedTensorVersioned *trpc_versioned_copy(const DLTensor *src,
                                              size_t nbytes) {
  size_t ndim = src->ndim > 0 ? (size_t)src->ndim : 0;
  // Data after the shape, aligned to 64 bytes for any dtype.
  size_t head = sizeof(DLManagedTensorVersioned) + ndim * sizeof(int64_t);
  head = (head + 63) & ~(size_t)63;
  DLManagedTensorVersioned *m = NULL;
  if (posix_memalign((void **)&m, 64, head + nbytes) != 0) {
    return NULL;
  }
  memset(m, 0, sizeof(DLManagedTensorVersioned));
  m->version.major = 1;
  m->version.minor = 0;
  m->deleter = versioned_free_deleter;
  m->flags = DLPACK_FLAG_BITMASK_IS_COPIED;
  m->dl_tensor = *src;
  m->dl_tensor.shape = (int64_t *)(m + 1);
  m->dl_tensor.strides = NULL;
  m->dl_tensor.byte_offset = 0;
  if (ndim > 0) {
    memcpy(m->dl_tensor.shape, src->shape, ndim * sizeof(int64_t));
  }
  m->dl_tensor.data = (char *)m + head;
  if (nbytes > 0) {
    memcpy(m->dl_tensor.data, (const char *)src->data + src->byte_offset,
           nbytes);
  }
  return m;
}

// The details of the last failure of a call on this thread (see
// trpc_error_details in tensorrpc.h). Go sets them through
// trpc_set_error_details from an exported function, which runs on the
// calling C thread.
static __thread char *error_details;

// The calling thread's last error of a function that returns NULL on
// failure (trpc_last_error in tensorrpc.h), set by Go as the details are.
static __thread int last_code;
static __thread char *last_message;

// A thread that ends with details or a message nobody took frees them:
// the first one stored on a thread sets its value of thread_strings_key,
// whose destructor runs as the thread exits (before its thread-locals
// go).
static pthread_key_t thread_strings_key;
static pthread_once_t thread_strings_once = PTHREAD_ONCE_INIT;
static __thread int thread_strings_set;

static void free_thread_strings(void *unused) {
  (void)unused;
  free(error_details);
  error_details = NULL;
  free(last_message);
  last_message = NULL;
}

static void make_thread_strings_key(void) {
  pthread_key_create(&thread_strings_key, free_thread_strings);
}

static void watch_thread_strings(void) {
  if (!thread_strings_set) {
    thread_strings_set = 1;
    pthread_once(&thread_strings_once, make_thread_strings_key);
    pthread_setspecific(thread_strings_key, &thread_strings_set);
  }
}

// trpc_set_error_details replaces this thread's details with details (a
// malloc'd string or NULL), which it takes over.
void trpc_set_error_details(char *details) {
  free(error_details);
  error_details = details;
  if (details != NULL) {
    watch_thread_strings();
  }
}

// trpc_set_last_error replaces this thread's last error with code and
// message (malloc'd, or NULL), taking message over.
void trpc_set_last_error(int code, char *message) {
  free(last_message);
  last_code = code;
  last_message = message;
  if (message != NULL) {
    watch_thread_strings();
  }
}

int trpc_last_error(char **message) {
  int code = last_code;
  char *m = last_message;
  last_code = 0;
  last_message = NULL;
  if (message != NULL) {
    *message = m;
  } else {
    free(m);
  }
  return code;
}

char *trpc_error_details(void) {
  char *d = error_details;
  error_details = NULL;
  return d;
}

// trpc_managed_set_device places m's tensor on a device: data is a device
// address (a number to the CPU), which Go does not turn into a pointer.
void trpc_managed_set_device(DLManagedTensor *m, int32_t device_type,
                             int32_t device_id, uint64_t data) {
  m->dl_tensor.device.device_type = device_type;
  m->dl_tensor.device.device_id = device_id;
  m->dl_tensor.data = (void *)(uintptr_t)data;
}
