"""Moving tensors across the C ABI: describing NumPy arrays, torch tensors,
DLPack producers and buffers as DLTensors (no copy), and turning the
DLManagedTensors the library hands out into NumPy arrays, torch tensors or
Tensor objects (no copy).

NumPy and torch are imported only when they are needed: for arrays the
caller passes (then they are imported already) or asks for (output="numpy"
or "torch", Tensor.numpy(), Tensor.torch()). Without them, bytes, buffers
and DLPack producers go in, and Tensor objects (bytes(t), t.memoryview())
come out.
"""

import ctypes
import operator
import struct
import sys
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from . import _lib
from ._lib import lib
from .errors import InvalidArgumentError

# dtype name -> DLPack (type code, bits). The names are NumPy's and
# PyTorch's spellings.
DTYPES: Dict[str, Tuple[int, int]] = {
    "bool": (6, 8),
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32), "float64": (2, 64),
    "complex64": (5, 64), "complex128": (5, 128),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_TORCH_MISSING = {"uint16", "uint32", "uint64"}  # no torch dtype in torch 1.13
OUTPUTS = ("numpy", "torch", "tensor")
# DLTensor as bytes: data, device (type, id), ndim, dtype (code, bits,
# lanes), shape, strides, byte_offset.
_DLTENSOR = struct.Struct("=QiiiBBHQQQ")
_DLTENSOR_BYTES = ctypes.c_char * _DLTENSOR.size  # read in place (unpack_from), not copied out
# ndim -> the struct of a shape array and its ctypes bytes, filled as met
_SHAPES: Dict[int, Tuple[struct.Struct, Any]] = {}
_NP_DTYPES: Dict[str, Any] = {}  # dtype name -> numpy.dtype, filled as met
_release_lock = threading.RLock()  # two threads never both delete one tensor; reentrant for GC


def _numpy() -> Any:
    """NumPy, or a clear ImportError naming what to install."""
    try:
        import numpy
    except ImportError as e:
        raise ImportError(
            "tensorrpc: NumPy is not installed; it is needed for NumPy arrays (output='numpy', the default, "
            "and Tensor.numpy()). Install it (pip install 'tensorrpc[numpy]', or apt-get install python3-numpy), "
            "or pass output='tensor' to get tensorrpc.Tensor objects (bytes(t), t.memoryview())") from e
    return numpy


def _torch() -> Any:
    """torch, or a clear ImportError naming what to install."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "tensorrpc: PyTorch is not installed; it is needed for output='torch' and Tensor.torch(). "
            "Install it (pip install 'tensorrpc[torch]', or apt-get install python3-torch), or pass "
            "output='tensor' or 'numpy'") from e
    return torch


def _is_numpy(x: Any) -> bool:
    np = sys.modules.get("numpy")  # an ndarray means NumPy is imported
    return np is not None and isinstance(x, np.ndarray)


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(dtype: Any) -> str:
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
    np = sys.modules.get("numpy")
    dt = None
    if np is not None and not isinstance(dtype, str):
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
    if dt is not None and dt.name in DTYPES and dt.byteorder != ">":
        return str(dt.name)
    raise InvalidArgumentError("unsupported dtype %r; tensorrpc supports %s" % (dtype, ", ".join(DTYPES)))


def _dlpack_dtype(name: str) -> _lib.DLDataType:
    code, bits = DTYPES[name]
    return _lib.DLDataType(code, bits, 1)


# DLPack dtypes by name, and the CPU device: assigning a ctypes structure
# to a field copies it, so one of each serves every DLTensor.
_DL_DTYPES = {name: _dlpack_dtype(name) for name in DTYPES}
_CPU = _lib.DLDevice(1, 0)

# NumPy dtypes _describe_numpy has checked, by dtype: their names. A
# handful in a program; checking each again cost a third of a describe.
_numpy_dtypes: dict = {}


class _Described:
    """A DLTensor describing a caller's tensor, and what keeps its memory
    and shape array alive while the library reads it."""

    __slots__ = ("dl", "keep")

    def __init__(self, data: Optional[int], shape: Sequence[int], name: str, keep: Any) -> None:
        ndim = len(shape)
        shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
        dl = _lib.DLTensor()  # zeroed: strides NULL, byte_offset 0
        dl.data = data or None
        dl.device = _CPU
        dl.ndim = ndim
        dl.dtype = _DL_DTYPES[name]
        dl.shape = shape_arr  # the array's address (a ctypes array converts to a pointer)
        self.dl = dl
        self.keep = (keep, shape_arr)

    @classmethod
    def again(cls, dl: Any, keep: Any, shape_arr: Any) -> "_Described":
        """A description made before (dl and its shape array), of keep."""
        d = cls.__new__(cls)
        d.dl = dl
        d.keep = (keep, shape_arr)
        return d


def describe(x: Any, what: str = "tensor", writable: bool = False) -> _Described:
    """Describes x (a NumPy array, a torch tensor, a Tensor, a DLPack
    producer, an object with __array_interface__ when NumPy is installed,
    or a buffer: bytes, bytearray, memoryview, array.array, ...) as a
    DLTensor over its own memory. With writable, x is where the library
    writes (fetch's out): read-only memory (a lease, a read-only array or
    buffer, a DLPack 1.0 capsule flagged read-only) is refused."""
    if isinstance(x, Tensor):
        x._check()
        if writable and x.readonly:
            raise InvalidArgumentError("%s is a read-only lease; the library cannot write into it" % what)
        d = _Described(x.data_ptr, x.shape, x.dtype, x)
        dev = x.__dlpack_device__()
        if dev[0] != _lib.KDLCPU:
            if writable:
                raise InvalidArgumentError("%s is on %s; fetch(out=...) takes CPU memory only" % (what, x.device))
            d.dl.device = _lib.DLDevice(*dev)
        return d
    if _is_numpy(x):
        return _describe_numpy(x, what, writable)
    if _is_torch(x):
        return _describe_torch(x, what, writable)
    if hasattr(x, "__dlpack__"):
        return _describe_dlpack(x, what, writable)
    if isinstance(x, (bytes, bytearray, memoryview)) or _has_buffer(x):
        return _describe_buffer(x, what, writable)
    if hasattr(x, "__array_interface__"):
        return _describe_numpy(_numpy().asarray(x), what, writable)
    raise InvalidArgumentError("%s must be a NumPy array, a torch tensor, a DLPack producer or a buffer, not %s"
                               % (what, type(x).__name__))


def out_fingerprint(x: Any) -> Optional[Tuple[Any, ...]]:
    """Where and as what fetch(out=x) would write x, read cheaply (about a
    microsecond against describe's several): (address, shape, dtype) of a
    writable C-contiguous NumPy array, (address, shape, strides, dtype,
    conjugate and negative bits, device type) of a torch tensor; None for
    anything else, and for a NumPy array describe would refuse (then
    describe says why). Once describe has accepted an x, an x of an equal
    fingerprint, the same object changed in place (resize, .shape=,
    .dtype=, torch's set_ and resize_) or another, is described exactly
    the same way."""
    if _is_numpy(x):
        try:
            # The buffer protocol without PyBUF_STRIDES: NumPy refuses a
            # read-only or a non-C-contiguous array, and ctypes an empty one.
            addr = ctypes.addressof(ctypes.c_char.from_buffer(x))
        except (TypeError, ValueError, BufferError):
            return None
        return (addr, x.shape, x.dtype)
    if _is_torch(x):
        try:
            return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.is_conj(), x.is_neg(), x.device.type)
        except (RuntimeError, AttributeError):  # no data pointer (sparse), or an older torch
            return None
    return None


def _describe_numpy(a: Any, what: str, writable: bool = False) -> _Described:
    dt = a.dtype
    name = _numpy_dtypes.get(dt)
    if name is None:
        if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
            raise InvalidArgumentError("%s has big-endian dtype %s; tensors are little-endian" % (what, dt))
        if dt.fields is not None or dt.name not in DTYPES:
            raise InvalidArgumentError("%s has dtype %s, which tensorrpc does not support (supported: %s)"
                                       % (what, dt, ", ".join(DTYPES)))
        name = _numpy_dtypes[dt] = str(dt.name)
    flags = a.flags
    if not flags.c_contiguous:
        raise InvalidArgumentError("%s is not C-contiguous (shape %s, strides %s); pass np.ascontiguousarray(x)"
                                   % (what, a.shape, a.strides))
    if writable and not flags.writeable:
        raise InvalidArgumentError("%s is a read-only NumPy array; the library cannot write into it" % what)
    return _Described(a.__array_interface__["data"][0], a.shape, name, a)


def _describe_torch(t: Any, what: str, writable: bool = False) -> _Described:
    torch = _torch()
    if t.device.type == "cuda":
        if not t.is_contiguous():
            raise InvalidArgumentError("%s is not contiguous (shape %s, strides %s); call .contiguous()"
                                       % (what, tuple(t.shape), t.stride()))
        # DLPack: torch makes the tensor ready on the stream the consumer
        # names (the legacy default stream, which the library's copies
        # follow).
        return _describe_dlpack(t, what, writable)
    if t.device.type != "cpu":
        raise InvalidArgumentError("%s is on device %s; only CPU and CUDA tensors can be sent (use .cpu())"
                                   % (what, t.device))
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


# --- DLPack import: both protocols ---------------------------------------

_USED_NAMES = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}
_VOID_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Consumed:
    """A DLManagedTensor(Versioned) this package consumed from a producer's
    capsule: it calls the producer's deleter when collected (after the
    library has read the memory)."""

    __slots__ = ("addr", "deleter")

    def __init__(self, addr: int, deleter: Optional[int]) -> None:
        self.addr = addr
        self.deleter = deleter

    def __del__(self) -> None:
        d, self.deleter = self.deleter, None
        if d:
            _VOID_DELETER(d)(self.addr)


def _dlpack_capsule(x: Any, stream: Optional[int] = None) -> Any:
    """x.__dlpack__(), asking for DLPack 1.0 first: a producer that does
    not know max_version (DLPack < 1.0, e.g. NumPy 1.24, torch 1.13) raises
    TypeError, and is asked again without. stream (CUDA tensors only) is
    the consumer's stream, passed as the protocol says."""
    kw = {} if stream is None else {"stream": stream}
    try:
        return x.__dlpack__(max_version=_lib.DLPACK_VERSION, **kw)
    except TypeError:
        return x.__dlpack__(**kw)


def _dlpack_device(x: Any, what: str) -> Tuple[int, int]:
    """x.__dlpack_device__(), or the CPU for a producer without it."""
    f = getattr(x, "__dlpack_device__", None)
    if f is None:
        return (_lib.KDLCPU, 0)
    try:
        dev_type, dev_id = f()
        return int(dev_type), int(dev_id)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError("%s: __dlpack_device__() did not return (device_type, device_id): %s"
                                   % (what, e)) from None


def _describe_dlpack(x: Any, what: str, writable: bool = False) -> _Described:
    dev_type, dev_id = _dlpack_device(x, what)
    stream = None
    if dev_type == _lib.KDLCUDA:
        if writable:
            raise InvalidArgumentError("%s is on cuda:%d; fetch(out=...) takes CPU memory only "
                                       "(fetch(key, device='cuda:%d') returns a CUDA tensor)" % (what, dev_id, dev_id))
        # The consumer's stream, per the DLPack protocol: the library's
        # copies run after the legacy default stream (1), so the producer
        # makes the tensor ready there (torch: an event the legacy stream
        # waits for).
        stream = _lib.STREAM_LEGACY
    elif dev_type != _lib.KDLCPU:
        raise InvalidArgumentError("%s is on DLPack device type %d; only CPU (1) and CUDA (2) tensors can be sent"
                                   % (what, dev_type))
    cap = _dlpack_capsule(x, stream)
    if type(cap).__name__ != "PyCapsule":
        raise InvalidArgumentError("%s: __dlpack__() returned %s, not a PyCapsule" % (what, type(cap).__name__))
    name = _lib.capsule_get_name(cap)
    if name not in _USED_NAMES:
        raise InvalidArgumentError("%s: __dlpack__() returned a capsule named %r, not a DLPack tensor" % (what, name))
    addr = _lib.capsule_get_pointer(cap, name)
    if name == b"dltensor_versioned":
        mv = _lib.DLManagedTensorVersioned.from_address(addr)
        if mv.version.major != _lib.DLPACK_VERSION[0]:
            # The layout of another major version is unknown: leave the
            # capsule unconsumed, its destructor deletes the tensor.
            raise InvalidArgumentError("%s: DLPack version %d.%d is not supported (1.x is)"
                                       % (what, mv.version.major, mv.version.minor))
        if writable and mv.flags & _lib.FLAG_READ_ONLY:
            # Left unconsumed: the capsule's destructor deletes it.
            raise InvalidArgumentError("%s: its DLPack tensor is read-only; the library cannot write into it" % what)
        dl, deleter = mv.dl_tensor, ctypes.cast(mv.deleter, ctypes.c_void_p).value
    else:
        m = _lib.DLManagedTensor.from_address(addr)
        dl, deleter = m.dl_tensor, ctypes.cast(m.deleter, ctypes.c_void_p).value
    # Consume it: from now on the deleter is ours to call.
    if _lib.capsule_set_name(cap, _USED_NAMES[name]) != 0:
        raise InvalidArgumentError("%s: could not consume the DLPack capsule" % what)
    owner = _Consumed(addr, deleter)
    d = _Described.__new__(_Described)
    # The producer's DLTensor as it is (strides, byte_offset, device): the
    # library checks it and reports what it cannot take.
    d.dl = _lib.DLTensor.from_buffer_copy(dl)
    d.keep = (owner, x)
    return d


# --- buffers, without NumPy ----------------------------------------------

class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)), ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = _lib._pyapi("PyObject_GetBuffer", ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_release_buffer = _lib._pyapi("PyBuffer_Release", None, ctypes.POINTER(_PyBuffer))
_PyBUF_C_CONTIGUOUS_FORMAT = 0x0038 | 0x0004  # PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
_PyBUF_WRITABLE = 0x0001


def _has_buffer(x: Any) -> bool:
    try:
        memoryview(x).release()
    except TypeError:
        return False
    return True


class _Buffer:
    """A Py_buffer held until collected."""

    __slots__ = ("view",)

    def __init__(self, x: Any, what: str, writable: bool = False) -> None:
        self.view: Optional[_PyBuffer] = None  # for __del__, should the buffer be refused
        view = _PyBuffer()
        flags = _PyBUF_C_CONTIGUOUS_FORMAT | (_PyBUF_WRITABLE if writable else 0)
        try:
            _get_buffer(x, ctypes.byref(view), flags)
        except BufferError as e:
            raise InvalidArgumentError("%s is not a C-contiguous%s buffer: %s"
                                       % (what, " writable" if writable else "", e)) from None
        self.view = view

    def __del__(self) -> None:
        v, self.view = self.view, None
        if v is not None:
            _release_buffer(ctypes.byref(v))


_INT_FORMATS = "bhilqn"
_UINT_FORMATS = "BHILQNc"


def _buffer_dtype(fmt: str, itemsize: int) -> Optional[str]:
    if fmt[:1] in ("@", "=", "<"):
        fmt = fmt[1:]
    bits = itemsize * 8
    if fmt == "?":
        return "bool"
    if len(fmt) == 1 and fmt in _INT_FORMATS:
        return "int%d" % bits
    if len(fmt) == 1 and fmt in _UINT_FORMATS:
        return "uint%d" % bits
    if fmt in ("e", "f", "d"):
        return "float%d" % bits
    if fmt in ("Zf", "Zd"):
        return "complex%d" % bits
    return None


def _describe_buffer(x: Any, what: str, writable: bool = False) -> _Described:
    b = _Buffer(x, what, writable)
    v = b.view
    assert v is not None
    fmt = (v.format or b"B").decode("ascii", "replace")
    if fmt[:1] in (">", "!") and v.itemsize > 1:
        raise InvalidArgumentError("%s has big-endian format %r; tensors are little-endian" % (what, fmt))
    name = _buffer_dtype(fmt if fmt[:1] not in (">", "!") else fmt[1:], v.itemsize)
    if name is None or name not in DTYPES:
        raise InvalidArgumentError("%s has buffer format %r (itemsize %d), which tensorrpc does not support"
                                   % (what, fmt, v.itemsize))
    shape = tuple(v.shape[i] for i in range(v.ndim)) if v.shape else ((v.len // v.itemsize,) if v.ndim else ())
    return _Described(v.buf, shape, name, b)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def row_indices(rows: Any, what: str = "rows") -> Tuple[Any, int, Any]:
    """rows (a sequence of ints, or a 1-D integer NumPy array or torch
    tensor) as (a const int64_t* for the C ABI, their number, what keeps
    the array alive). A NumPy int64 array is passed as it is."""
    if _is_torch(rows):
        if rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() or str(rows.dtype) == "torch.bool":
            raise InvalidArgumentError("%s must be a 1-D integer tensor, not %s of shape %s"
                                       % (what, rows.dtype, tuple(rows.shape)))
        rows = rows.tolist()
    elif _is_numpy(rows):
        np = _numpy()
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise InvalidArgumentError("%s must be a 1-D integer array, not %s of shape %s"
                                       % (what, rows.dtype, rows.shape))
        if rows.dtype.kind == "u" and rows.size and int(rows.max()) > _INT64_MAX:
            raise InvalidArgumentError("%s: row index %d is out of range" % (what, int(rows.max())))
        a = np.ascontiguousarray(rows, dtype=np.int64)
        return ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_int64)), len(a), a
    if isinstance(rows, (str, bytes, bytearray)) or not hasattr(rows, "__iter__"):
        raise InvalidArgumentError("%s must be a sequence of ints or a 1-D integer array, not %s"
                                   % (what, type(rows).__name__))
    try:
        values = [operator.index(r) for r in rows]
    except TypeError:
        raise InvalidArgumentError("%s must hold ints only" % what) from None
    for v in values:
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise InvalidArgumentError("%s: row index %d is out of range" % (what, v))
    arr = (ctypes.c_int64 * max(len(values), 1))(*values)
    return ctypes.cast(arr, ctypes.POINTER(ctypes.c_int64)), len(values), arr


def check_output(output: str) -> str:
    if output not in OUTPUTS:
        raise InvalidArgumentError("output must be one of %s, not %r" % (", ".join(OUTPUTS), output))
    return output


def need_output(output: str) -> str:
    """check_output that also imports what output needs, so that a
    missing NumPy or torch fails before anything is received."""
    if output in _ready_outputs:  # checked and imported before (a call's hot path)
        return output
    check_output(output)
    if output == "numpy":
        _numpy()
    elif output == "torch":
        _torch()
    _ready_outputs.add(output)
    return output


_ready_outputs = {"tensor"}


class Tensor:
    """A tensor in tensorrpc's pool memory (or leased from a server's),
    received or allocated by the library.

    It is a DLPack producer (DLPack 1.0 and the legacy protocol):
    np.from_dlpack(t), torch.from_dlpack(t) and t.numpy() / t.torch() view
    its memory without a copy, and each view keeps the memory alive on its
    own; without NumPy, bytes(t) copies it and t.memoryview() views it. The
    memory is given back when the Tensor is released (release(), the end of
    a with block, or garbage collection) and every view of it has been
    collected. A lease (Client.fetch(lease=True)) is read-only: readonly is
    True, numpy() arrays are not writable and DLPack 1.0 capsules carry the
    read-only flag.
    """

    __slots__ = ("_m", "__weakref__")

    def __init__(self, managed: int) -> None:
        self._m: Optional[int] = managed  # address of a DLManagedTensor this object owns

    def _check(self) -> int:
        if not self._m:
            raise InvalidArgumentError("tensor used after release()")
        return self._m

    def _dl(self) -> _lib.DLTensor:
        return _lib.DLManagedTensor.from_address(self._check()).dl_tensor

    @property
    def dtype(self) -> str:
        """The dtype's name: "float32", "bfloat16", ..."""
        dt = self._dl().dtype
        return _NAMES[(dt.code, dt.bits)]

    @property
    def shape(self) -> Tuple[int, ...]:
        dl = self._dl()
        return tuple(dl.shape[i] for i in range(dl.ndim))

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1] // 8
        for d in self.shape:
            n *= d
        return n

    @property
    def data_ptr(self) -> int:
        return self._dl().data or 0

    @property
    def readonly(self) -> bool:
        """Whether the memory must not be written: a shared-memory lease of
        the server's memory."""
        return bool(lib.trpc_dlpack_flags(self._check()) & _lib.FLAG_READ_ONLY)

    @property
    def device(self) -> str:
        """Where the memory is: "cpu", or "cuda:N" for a tensor fetched
        onto a CUDA device (fetch(key, device="cuda:N"))."""
        dev_type, dev_id = self.__dlpack_device__()
        return "cpu" if dev_type == _lib.KDLCPU else "cuda:%d" % dev_id

    def _host(self, what: str) -> None:
        """Refuses, for what, a tensor in device memory (the CPU cannot
        read it)."""
        if self._dl().device.device_type != _lib.KDLCPU:
            raise InvalidArgumentError("%s: the tensor is in %s memory, which the CPU cannot read; "
                                       "use torch.from_dlpack(t) (or t.torch()) on a CUDA build of PyTorch, "
                                       "or fetch it without device=" % (what, self.device))

    def _share(self, fix_bool: bool) -> Tuple[Any, bool]:
        """A new legacy capsule over the memory, holding its own reference.
        With fix_bool, a bool tensor is described as uint8, which NumPy 1.24
        and torch 1.13 import (neither imports DLPack's bool)."""
        p = lib.trpc_dlpack_share(self._check())
        if not p:
            raise InvalidArgumentError("tensor was already released")
        dl = _lib.DLManagedTensor.from_address(p).dl_tensor
        is_bool = (dl.dtype.code, dl.dtype.bits) == DTYPES["bool"]
        if is_bool and fix_bool:
            dl.dtype.code = DTYPES["uint8"][0]
        return _lib.capsule(p), is_bool and fix_bool

    def __dlpack__(self, *, stream: Optional[int] = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None, copy: Optional[bool] = None) -> Any:
        """A DLPack capsule over the memory, holding its own reference: a
        DLPack 1.0 "dltensor_versioned" capsule when the consumer passes
        max_version >= (1, 0) (read-only flag set for a lease), else a
        legacy "dltensor" capsule. stream is ignored: CPU memory needs no
        synchronisation, and a CUDA tensor's bytes were complete on the
        device when fetch returned (no work is pending on any stream).
        dl_device must be None or the tensor's own device
        (__dlpack_device__()); copy=True makes the capsule's tensor a copy
        (DLPack 1.0 only; CPU tensors only), copy=False or None shares the
        memory."""
        own = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != own:
            raise BufferError("this tensor is in %s memory; cannot export to device %r" % (self.device, dl_device))
        if copy and own[0] != _lib.KDLCPU:
            raise BufferError("copy=True of a tensor in %s memory is not supported" % self.device)
        if max_version is None or tuple(max_version)[0] < 1:
            if copy:
                raise BufferError("copy=True needs a DLPack >= 1.0 consumer (max_version=(1, 0))")
            return self._share(False)[0]
        p = lib.trpc_dlpack_share_versioned(self._check(), 1 if copy else 0)
        if not p:
            raise BufferError("tensor was already released, or memory ran out")
        return _lib.capsule(p, versioned=True)

    def __dlpack_device__(self) -> Tuple[int, int]:
        dev = self._dl().device
        return (int(dev.device_type), int(dev.device_id))

    def _meta(self) -> Tuple[str, Tuple[int, ...], int, int]:
        """The dtype's name, the shape, the data address and the device
        type, read from the DLTensor in two reads (ctypes structure fields
        cost a Python object each)."""
        data, dev_type, _, ndim, code, bits, _, shape_p, _, _ = _DLTENSOR.unpack_from(
            _DLTENSOR_BYTES.from_address(self._check()))
        if not ndim:
            return _NAMES[(code, bits)], (), data, dev_type
        sh = _SHAPES.get(ndim)
        if sh is None:
            st = struct.Struct("=%dq" % ndim)
            sh = _SHAPES[ndim] = (st, ctypes.c_char * st.size)
        return _NAMES[(code, bits)], sh[0].unpack_from(sh[1].from_address(shape_p)), data, dev_type

    def numpy(self) -> Any:
        """A NumPy array viewing the tensor's memory, writable unless the
        tensor is read-only (a lease). (NumPy 1.24's from_dlpack makes
        read-only arrays, so this goes through __array_interface__ instead;
        np.from_dlpack(t) works too.)"""
        return self._to_numpy(False)

    def _to_numpy(self, give: bool, readonly: Optional[bool] = None) -> Any:
        """numpy(); with give, the array takes over this object's reference
        (adopt: nobody else holds this object) instead of a new one.
        readonly, when known (a fetch that asked for no lease is writable),
        saves asking the library."""
        np = _numpy()
        name, shape, data, dev_type = self._meta()
        if dev_type != _lib.KDLCPU:
            self._host("numpy()")
        if name == "bfloat16":
            raise InvalidArgumentError("bfloat16 has no NumPy dtype; use output='torch' or Tensor.torch()")
        if 0 in shape:
            return np.empty(shape, dtype=name)
        if readonly is None:
            readonly = bool(lib.trpc_dlpack_flags(self._m) & _lib.FLAG_READ_ONLY)
        if give:
            owner = self
        else:
            p = lib.trpc_dlpack_share(self._check())
            if not p:
                raise InvalidArgumentError("tensor was already released")
            owner = Tensor(p)
        dt = _NP_DTYPES.get(name)
        if dt is None:
            dt = _NP_DTYPES[name] = np.dtype(name)
        n = dt.itemsize
        for d in shape:
            n *= d
        # The array views a ctypes array over the memory, which holds the
        # reference (owner) until the last array over it is collected:
        # half the time of an __array_interface__ (2.5 -> 1.5 us for 4 KiB),
        # and np.ndarray over it in its shape half that of frombuffer and a
        # reshape (1.1 -> 0.57 us for a 2-D array, timeit).
        mem = (ctypes.c_ubyte * n).from_address(data)
        mem._tensorrpc_owner = owner
        a = np.ndarray(shape, dt, mem)
        if readonly:
            a.flags.writeable = False
        return a

    def torch(self) -> Any:
        """A torch tensor viewing the tensor's memory."""
        return self._to_torch(False)

    def _to_torch(self, give: bool) -> Any:
        """torch(); with give, the torch tensor takes over this object's
        reference (adopt: nobody else holds this object) instead of a new
        one."""
        name, shape, _, _ = self._meta()
        if name in _TORCH_MISSING:
            raise InvalidArgumentError("%s has no torch dtype in this PyTorch; use output='numpy'" % name)
        torch = _torch()
        if 0 in shape:
            # Nothing to share, and torch 1.13 never calls the deleter of an
            # empty DLPack tensor (it would leak the reference).
            return torch.empty(shape, dtype=getattr(torch, name), device=self.device)
        if give:
            # Ours alone (adopt): no release() can run beside this, no lock.
            p, self._m = self._check(), None  # the capsule owns it now (and deletes it unless consumed)
            is_bool = name == "bool"
            if is_bool:  # as _share(True) does
                _lib.DLManagedTensor.from_address(p).dl_tensor.dtype.code = DTYPES["uint8"][0]
            cap = _lib.capsule(p)
        else:
            cap, is_bool = self._share(True)
        t = torch._C._from_dlpack(cap)  # what torch.utils.dlpack.from_dlpack does with a capsule
        return t.view(torch.bool) if is_bool else t

    def memoryview(self) -> memoryview:
        """A flat unsigned-byte memoryview ("B", nbytes long) of the
        tensor's memory, without NumPy; read-only for a lease. It keeps the
        memory alive on its own."""
        self._host("memoryview()")
        n = self.nbytes
        if n == 0:
            return memoryview(b"")
        readonly = self.readonly
        p = lib.trpc_dlpack_share(self._check())
        if not p:
            raise InvalidArgumentError("tensor was already released")
        owner = Tensor(p)
        arr = (ctypes.c_ubyte * n).from_address(owner.data_ptr)
        arr._tensorrpc_owner = owner  # type: ignore[attr-defined]  # the view keeps the memory
        mv = memoryview(arr).cast("B")
        return mv.toreadonly() if readonly else mv

    def tobytes(self) -> bytes:
        """A copy of the tensor's bytes."""
        self._host("tobytes()")
        return ctypes.string_at(self.data_ptr, self.nbytes) if self.nbytes else b""

    def __bytes__(self) -> bytes:
        return self.tobytes()

    def release(self) -> None:
        """Gives this object's reference back; views made from it stay
        valid. Safe to call more than once."""
        with _release_lock:
            m, self._m = self._m, None
        if m:
            lib.trpc_managed_deleter(m)

    def __del__(self) -> None:
        # Nothing refers to this object any more, so that no release() can
        # run beside this one: no lock (a call's hot path: a fetched tensor
        # dropped). At interpreter shutdown the module globals may be gone
        # already.
        m = self._m
        if m and lib is not None:
            self._m = None
            lib.trpc_managed_deleter(m)

    def __enter__(self) -> "Tensor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        if not self._m:
            return "tensorrpc.Tensor(released)"
        dev = self.device
        return "tensorrpc.Tensor(dtype=%s, shape=%s%s%s)" % (
            self.dtype, self.shape, "" if dev == "cpu" else ", device=%s" % dev, ", readonly" if self.readonly else "")


def adopt(managed: Optional[int], output: str, readonly: Optional[bool] = None) -> Any:
    """Takes over the DLManagedTensor at address managed and returns it in
    the output form; readonly as Tensor._to_numpy takes it."""
    if not managed:
        raise InvalidArgumentError("tensorrpc: the library returned a NULL tensor")
    t = Tensor(managed)
    if output == "tensor":
        return t
    # t is ours alone: the array or torch tensor takes its reference over
    # (on failure, collecting t releases it).
    return t._to_numpy(True, readonly) if output == "numpy" else t._to_torch(True)
