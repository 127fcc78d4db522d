"""Moving tensors across the C ABI: describing NumPy arrays and torch
tensors as DLTensors (no copy), and turning the DLManagedTensors the library
hands out into NumPy arrays, torch tensors or Tensor objects (no copy)."""

import ctypes
import sys
import threading

import numpy as np

from . import _lib
from ._lib import lib
from .errors import InvalidArgumentError

# dtype name -> DLPack (type code, bits). The names are NumPy's and
# PyTorch's spellings.
DTYPES = {
    "bool": (6, 8),
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32), "float64": (2, 64),
    "complex64": (5, 64), "complex128": (5, 128),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_TORCH_MISSING = {"uint16", "uint32", "uint64"}  # no torch dtype in torch 1.13
_OUTPUTS = ("numpy", "torch", "tensor")
_release_lock = threading.RLock()  # two threads never both delete one tensor; reentrant for GC


def _torch():
    import torch
    return torch


def _is_torch(x):
    return type(x).__module__.startswith("torch") and isinstance(x, _torch().Tensor)


def dtype_name(dtype):
    """The canonical name of a dtype given as a string, a NumPy dtype or
    type, or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype[6:] if dtype.startswith("torch.") else dtype
        if name in DTYPES:
            return name
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype)[6:]
        if name in DTYPES:
            return name
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.name in DTYPES and dt.byteorder != ">":
        return dt.name
    raise InvalidArgumentError("unsupported dtype %r; tensorrpc supports %s" % (dtype, ", ".join(DTYPES)))


def _dlpack_dtype(name):
    code, bits = DTYPES[name]
    return _lib.DLDataType(code, bits, 1)


class _Described:
    """A DLTensor describing a caller's tensor, and what keeps its memory
    and shape array alive while the library reads it."""

    __slots__ = ("dl", "keep")

    def __init__(self, data, shape, name, keep):
        ndim = len(shape)
        shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
        dl = _lib.DLTensor()
        dl.data = data or None
        dl.device = _lib.DLDevice(1, 0)
        dl.ndim = ndim
        dl.dtype = _dlpack_dtype(name)
        dl.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
        dl.strides = None
        dl.byte_offset = 0
        self.dl = dl
        self.keep = (keep, shape_arr)


def describe(x, what="tensor"):
    """Describes x (a NumPy array, a torch tensor, a Tensor, or anything
    NumPy can view without a copy: a __dlpack__ or __array_interface__
    producer, a buffer) as a DLTensor over its own memory."""
    if isinstance(x, np.ndarray):
        return _describe_numpy(x, what)
    if isinstance(x, Tensor):
        x._check()
        return _Described(x.data_ptr, x.shape, x.dtype, x)
    if _is_torch(x):
        return _describe_torch(x, what)
    if hasattr(x, "__dlpack__"):
        return _describe_numpy(np.from_dlpack(x), what)
    if hasattr(x, "__array_interface__") or isinstance(x, (memoryview, bytes, bytearray)):
        return _describe_numpy(np.asarray(x), what)
    raise InvalidArgumentError("%s must be a NumPy array or a torch tensor, not %s" % (what, type(x).__name__))


def _describe_numpy(a, what):
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
        raise InvalidArgumentError("%s has big-endian dtype %s; tensors are little-endian" % (what, a.dtype))
    if a.dtype.fields is not None or a.dtype.name not in DTYPES:
        raise InvalidArgumentError("%s has dtype %s, which tensorrpc does not support (supported: %s)"
                                   % (what, a.dtype, ", ".join(DTYPES)))
    if not a.flags.c_contiguous:
        raise InvalidArgumentError("%s is not C-contiguous (shape %s, strides %s); pass np.ascontiguousarray(x)"
                                   % (what, a.shape, a.strides))
    return _Described(a.__array_interface__["data"][0], a.shape, a.dtype.name, a)


def _describe_torch(t, what):
    torch = _torch()
    if t.device.type != "cpu":
        raise InvalidArgumentError("%s is on device %s; only CPU tensors can be sent (use .cpu())" % (what, t.device))
    if t.layout != torch.strided or t.is_quantized:
        raise InvalidArgumentError("%s has layout %s; only dense tensors can be sent" % (what, t.layout))
    name = str(t.dtype)[6:]
    if name not in DTYPES:
        raise InvalidArgumentError("%s has dtype %s, which tensorrpc does not support" % (what, t.dtype))
    if not t.is_contiguous():
        raise InvalidArgumentError("%s is not contiguous (shape %s, strides %s); call .contiguous()"
                                   % (what, tuple(t.shape), t.stride()))
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError("%s is a lazy conjugate or negative view; call .resolve_conj().resolve_neg()" % what)
    return _Described(t.data_ptr(), tuple(t.shape), name, t)


def check_output(output):
    if output not in _OUTPUTS:
        raise InvalidArgumentError("output must be one of %s, not %r" % (", ".join(_OUTPUTS), output))
    return output


class _ArrayOwner:
    """The base of the NumPy arrays numpy() makes: it owns a reference to
    the memory (a Tensor), released when the last array over it is
    collected."""

    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, tensor, shape, typestr):
        self.tensor = tensor
        self.__array_interface__ = {
            "version": 3, "shape": shape, "typestr": typestr, "data": (tensor.data_ptr, False),
        }


class Tensor:
    """A tensor in tensorrpc's pool memory (or leased from a server's),
    received or allocated by the library.

    It is a DLPack producer: np.from_dlpack(t), torch.utils.dlpack
    .from_dlpack(t) and t.numpy() / t.torch() view its memory without a copy,
    and each view keeps the memory alive on its own. The memory is given
    back when the Tensor is released (release(), the end of a with block, or
    garbage collection) and every view of it has been collected.
    """

    __slots__ = ("_m", "__weakref__")

    def __init__(self, managed):
        self._m = managed  # address of a DLManagedTensor this object owns

    def _check(self):
        if not self._m:
            raise InvalidArgumentError("tensor used after release()")

    def _dl(self):
        self._check()
        return _lib.DLManagedTensor.from_address(self._m).dl_tensor

    @property
    def dtype(self):
        """The dtype's name: "float32", "bfloat16", ..."""
        dt = self._dl().dtype
        return _NAMES[(dt.code, dt.bits)]

    @property
    def shape(self):
        dl = self._dl()
        return tuple(dl.shape[i] for i in range(dl.ndim))

    @property
    def nbytes(self):
        n = DTYPES[self.dtype][1] // 8
        for d in self.shape:
            n *= d
        return n

    @property
    def data_ptr(self):
        return self._dl().data or 0

    def _share(self, fix_bool):
        """A new capsule over the memory, holding its own reference. With
        fix_bool, a bool tensor is described as uint8, which NumPy 1.24 and
        torch 1.13 import (neither imports DLPack's bool)."""
        self._check()
        p = lib.trpc_dlpack_share(self._m)
        if not p:
            raise InvalidArgumentError("tensor was already released")
        dl = _lib.DLManagedTensor.from_address(p).dl_tensor
        is_bool = (dl.dtype.code, dl.dtype.bits) == DTYPES["bool"]
        if is_bool and fix_bool:
            dl.dtype.code = DTYPES["uint8"][0]
        return _lib.capsule(p), is_bool and fix_bool

    def __dlpack__(self, stream=None):
        return self._share(False)[0]

    def __dlpack_device__(self):
        return (1, 0)

    def numpy(self):
        """A writable NumPy array viewing the tensor's memory. (NumPy 1.24's
        from_dlpack makes read-only arrays, so this goes through
        __array_interface__ instead; np.from_dlpack(t) works too.)"""
        name = self.dtype
        if name == "bfloat16":
            raise InvalidArgumentError("bfloat16 has no NumPy dtype; use output='torch' or Tensor.torch()")
        shape = self.shape
        if 0 in shape:
            return np.empty(shape, dtype=name)
        self._check()
        p = lib.trpc_dlpack_share(self._m)
        if not p:
            raise InvalidArgumentError("tensor was already released")
        return np.asarray(_ArrayOwner(Tensor(p), shape, np.dtype(name).str))

    def torch(self):
        """A torch tensor viewing the tensor's memory."""
        if self.dtype in _TORCH_MISSING:
            raise InvalidArgumentError("%s has no torch dtype in this PyTorch; use output='numpy'" % self.dtype)
        torch = _torch()
        shape = self.shape
        if 0 in shape:
            # Nothing to share, and torch 1.13 never calls the deleter of an
            # empty DLPack tensor (it would leak the reference).
            return torch.empty(shape, dtype=getattr(torch, self.dtype))
        cap, is_bool = self._share(True)
        t = torch.utils.dlpack.from_dlpack(cap)
        return t.view(torch.bool) if is_bool else t

    def release(self):
        """Gives this object's reference back; views made from it stay
        valid. Safe to call more than once."""
        with _release_lock:
            m, self._m = self._m, None
        if m:
            lib.trpc_managed_deleter(m)

    def __del__(self):
        # At interpreter shutdown the module globals may be gone already.
        if self._m and lib is not None:
            self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        if not self._m:
            return "tensorrpc.Tensor(released)"
        return "tensorrpc.Tensor(dtype=%s, shape=%s)" % (self.dtype, self.shape)


def adopt(managed, output):
    """Takes over the DLManagedTensor at address managed and returns it in
    the output form."""
    t = Tensor(managed)
    if output == "tensor":
        return t
    try:
        return t.numpy() if output == "numpy" else t.torch()
    finally:
        t.release()
