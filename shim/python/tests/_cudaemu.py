"""CUDA device memory for the tests, without a GPU or a CUDA build of
torch: the CUDA driver the library uses ($TENSORRPC_CUDA_LIBRARY, a driver
emulator that shim_test.go builds) reached through ctypes, and a DLPack
producer of kDLCUDA tensors over memory allocated from it, made by hand.

The library and this module dlopen the same file, so they share the
emulator's state (its allocations, its primary context)."""

import ctypes
import os

from tensorrpc import _lib

SYNC_MEMOPS = 6  # CU_POINTER_ATTRIBUTE_SYNC_MEMOPS

_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_is_valid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_get_pointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


# Producers with tensors a consumer still holds: DLPack has the producer
# keep a managed tensor (and its deleter) valid until the deleter is
# called, however late (a server calls it when a publish ends), so a
# producer stays alive until then, as CuPy's and torch's tensors do.
_held = set()


class CUDAError(Exception):
    pass


class Driver:
    """The driver of $TENSORRPC_CUDA_LIBRARY: allocations on device 0 and
    copies, each with the device's primary context current on the calling
    thread."""

    def __init__(self):
        path = os.environ.get("TENSORRPC_CUDA_LIBRARY")
        if not path:
            raise CUDAError("TENSORRPC_CUDA_LIBRARY is not set (shim_test.go sets it to the driver emulator)")
        self.path = path
        self.cu = ctypes.CDLL(path)
        self._call("cuInit", 0)
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), 0)
        self.dev = dev.value
        self.ctx = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), self.dev)

    def _call(self, name, *args):
        r = getattr(self.cu, name)(*args)
        if r != 0:
            raise CUDAError("%s: CUresult %d" % (name, r))

    def _current(self):
        self._call("cuCtxSetCurrent", self.ctx)

    def alloc(self, n):
        """n bytes (at least 1) of device memory; copies need
        CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the emulator, so it is set."""
        self._current()
        p = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(max(n, 1)))
        one = ctypes.c_uint(1)
        self._call("cuPointerSetAttribute", ctypes.byref(one), SYNC_MEMOPS, ctypes.c_uint64(p.value))
        return p.value

    def free(self, p):
        self._current()
        self._call("cuMemFree_v2", ctypes.c_uint64(p))

    def write(self, p, data):
        if data:
            self._current()
            self._call("cuMemcpyHtoD_v2", ctypes.c_uint64(p), data, ctypes.c_size_t(len(data)))

    def read(self, p, n):
        if n == 0:
            return b""
        self._current()
        buf = ctypes.create_string_buffer(n)
        self._call("cuMemcpyDtoH_v2", buf, ctypes.c_uint64(p), ctypes.c_size_t(n))
        return buf.raw

    def close(self):
        self._call("cuDevicePrimaryCtxRelease_v2", self.dev)


class CUDAProducer:
    """A DLPack producer of one kDLCUDA tensor (dtype name, shape) in
    device memory at ptr (the caller's, or allocated here from data), made
    by hand as CuPy or torch would make it: __dlpack_device__() is (2,
    device_id); __dlpack__(stream=..., max_version=...) records the stream
    its consumer passed and hands out a DLPack 1.0 capsule when asked for
    one, else a legacy capsule. deleted counts the deleter calls; the
    producer (its managed tensors, their deleters) stays alive until every
    tensor it handed out is deleted."""

    def __init__(self, driver, name, shape, data=None, ptr=None, device_id=0, byte_offset=0, versioned=True):
        self.driver = driver
        self.code, self.bits = _lib_dtype(name)
        self.shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.ndim = len(shape)
        self.device_id = device_id
        self.byte_offset = byte_offset
        self.versioned = versioned
        self.owned = ptr is None
        if ptr is None:
            ptr = driver.alloc(byte_offset + len(data or b""))
            driver.write(ptr + byte_offset, data or b"")
        self.ptr = ptr
        self.streams = []
        self.deleted = 0
        self.outstanding = 0
        self.made = []

    def __dlpack_device__(self):
        return (2, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        versioned = self.versioned and max_version is not None and max_version[0] >= 1
        cls = _lib.DLManagedTensorVersioned if versioned else _lib.DLManagedTensor
        m = cls()
        if versioned:
            m.version = _lib.DLPackVersion(1, 0)
            m.flags = 0

        def deleter(_p):
            self.deleted += 1
            self.outstanding -= 1
            if self.outstanding == 0:
                _held.discard(self)
        d = type(m.deleter)(deleter)
        m.deleter = d
        dl = m.dl_tensor
        dl.data = self.ptr
        dl.device = _lib.DLDevice(2, self.device_id)
        dl.ndim = self.ndim
        dl.dtype = _lib.DLDataType(self.code, self.bits, 1)
        dl.shape = ctypes.cast(self.shape_arr, ctypes.POINTER(ctypes.c_int64))
        dl.strides = None
        dl.byte_offset = self.byte_offset
        name = b"dltensor_versioned" if versioned else b"dltensor"

        def destructor(cap):  # deletes an unconsumed tensor
            if _is_valid_raw(cap, name):
                p = _get_pointer_raw(cap, name)
                s = cls.from_address(p)
                s.deleter(ctypes.pointer(s))
        dd = _DESTRUCTOR(destructor)
        self.made += [m, d, dd]
        self.outstanding += 1
        _held.add(self)
        return _capsule_new(ctypes.addressof(m), name, ctypes.cast(dd, ctypes.c_void_p))

    def free(self):
        if self.owned and self.ptr:
            self.driver.free(self.ptr)
            self.ptr = 0


def _lib_dtype(name):
    import tensorrpc
    return tensorrpc.DTYPES[name]


def device_bytes(driver, t):
    """The bytes of t, a tensorrpc.Tensor in device memory."""
    assert t.__dlpack_device__()[0] == _lib.KDLCUDA, t
    return driver.read(t.data_ptr, t.nbytes)
