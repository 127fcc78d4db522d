"""Loading libtensorrpc.so and declaring its C ABI with ctypes.

The library is looked up in $TENSORRPC_LIB, then next to this file. ctypes
releases the GIL around every call into it (CDLL), so Go may call back into
Python (method handlers) while a Python thread waits in the library.
"""

import ctypes
import os
from typing import Any, Optional

ABI_VERSION = 7  # TRPC_ABI_VERSION of tensorrpc.h

# Flags of trpc_client_fetch and trpc_server_fetch (TRPC_FETCH_* in tensorrpc.h).
FETCH_LEASE = 1  # trpc_client_fetch: a shared-memory lease
FETCH_TAKE = 1  # trpc_server_fetch: also unpublish the key
FETCH_WAIT = 2  # both: wait until the key is published

# DLPack device types (DLDeviceType).
KDLCPU = 1
KDLCUDA = 2

# The stream argument of trpc_client_send_device: the legacy default stream
# (CU_STREAM_LEGACY; DLPack's __dlpack__(stream=1) for CUDA).
STREAM_LEGACY = 1

# Flags of trpc_server_publish_flags (TRPC_PUBLISH_* in tensorrpc.h).
PUBLISH_WRITABLE = 1  # clients may write rows of it (trpc_client_send_rows)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

# DLPack 1.0 flags (DLManagedTensorVersioned.flags).
FLAG_READ_ONLY = 1
FLAG_IS_COPIED = 2
DLPACK_VERSION = (1, 0)  # what this package produces and understands


class Options(ctypes.Structure):
    """trpc_options: the same fields in the same order as tensorrpc.h."""
    _fields_ = [
        ("transports", ctypes.c_char_p),
        ("eager_threshold", ctypes.c_int64),
        ("pool_limit", ctypes.c_int64),
        ("max_tensor_bytes", ctypes.c_int64),
        ("connect_timeout_ms", ctypes.c_int64),
        ("data_address", ctypes.c_char_p),  # server only; ABI version 2
    ]


class PoolStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "in_use", "requested", "peak", "reserved", "allocs", "total_allocs", "arenas", "waiting")]


class Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "transfers", "data_plane_bytes", "inline_bytes", "stream_bytes",
        "copies", "copied_bytes", "leases", "errors")]


class DeviceMemStats(ctypes.Structure):
    """trpc_device_mem_stats (ABI version 5)."""
    _fields_ = [(n, ctypes.c_int64) for n in ("buffers", "bytes", "arenas", "arena_bytes")]


# trpc_handler_fn; the request tensors arrive as a DLManagedTensor** array.
HANDLER = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p,
    ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64)

_c = ctypes
_u64 = _c.c_uint64
_err = _c.POINTER(_c.c_void_p)  # char** err, read as a pointer to free
_mt_out = _c.POINTER(_c.c_void_p)  # DLManagedTensor** out
_rows = _c.POINTER(_c.c_int64)  # const int64_t* rows (trpc_row_index*)

_PROTOTYPES = {
    "trpc_abi_version": (_c.c_int, []),
    "trpc_free": (None, [_c.c_void_p]),
    "trpc_live_tensors": (_c.c_int64, []),
    "trpc_dlpack_share": (_c.c_void_p, [_c.c_void_p]),
    "trpc_managed_deleter": (None, [_c.c_void_p]),
    "trpc_set_capsule_api": (None, [_c.c_void_p, _c.c_void_p]),
    "trpc_dltensor_name": (_c.c_void_p, []),
    "trpc_dltensor_versioned_name": (_c.c_void_p, []),
    "trpc_dlpack_share_versioned": (_c.c_void_p, [_c.c_void_p, _c.c_int]),
    "trpc_dlpack_flags": (_c.c_uint64, [_c.c_void_p]),
    "trpc_error_details": (_c.c_void_p, []),
    "trpc_reply_set_error_details": (_c.c_int, [_u64, _c.c_char_p]),
    "trpc_server_new": (_c.c_int, [_c.c_char_p, _c.POINTER(Options), _c.POINTER(_u64), _err]),
    "trpc_server_address": (_c.c_int, [_u64, _c.POINTER(_c.c_void_p), _err]),
    "trpc_server_close": (_c.c_int, [_u64, _c.POINTER(_c.c_int64), _err]),
    "trpc_server_publish": (_c.c_int, [_u64, _c.c_char_p, _c.POINTER(DLTensor), _err]),
    "trpc_server_publish_flags": (_c.c_int, [_u64, _c.c_char_p, _c.POINTER(DLTensor), _c.c_int, _err]),
    "trpc_server_publish_device": (_c.c_int, [_u64, _c.c_char_p, _c.POINTER(DLTensor), _c.c_void_p, _c.c_void_p,
                                              _c.c_int, _err]),
    "trpc_server_unpublish": (_c.c_int, [_u64, _c.c_char_p]),
    "trpc_server_fetch": (_c.c_int, [_u64, _c.c_char_p, _c.c_int, _c.c_int64, _mt_out, _err]),
    "trpc_server_empty": (_c.c_int, [_u64, DLDataType, _c.c_int32, _c.POINTER(_c.c_int64), _mt_out, _err]),
    "trpc_server_handle": (_c.c_int, [_u64, _c.c_char_p, HANDLER, _c.c_void_p, _err]),
    "trpc_server_pool_stats": (_c.c_int, [_u64, _c.POINTER(PoolStats), _err]),
    "trpc_server_stats": (_c.c_int, [_u64, _c.POINTER(Stats), _err]),
    "trpc_reply_set_metadata": (_c.c_int, [_u64, _c.c_char_p, _c.c_int64, _err]),
    "trpc_reply_add_tensor": (_c.c_int, [_u64, _c.POINTER(DLTensor), _err]),
    "trpc_reply_set_error": (_c.c_int, [_u64, _c.c_char_p]),
    "trpc_client_dial": (_c.c_int, [_c.c_char_p, _c.POINTER(Options), _c.c_int64, _c.POINTER(_u64), _err]),
    "trpc_client_close": (_c.c_int, [_u64, _c.POINTER(_c.c_int64), _err]),
    "trpc_client_transport": (_c.c_int, [_u64, _c.POINTER(_c.c_void_p), _err]),
    # out and err as plain pointers: Client.fetch passes one array for both
    # (tensor, message) and a pointer into it.
    "trpc_client_fetch": (_c.c_int, [_u64, _c.c_char_p, _c.c_int, _c.c_int64, _c.c_void_p, _c.c_void_p]),
    "trpc_client_fetch_tensor": (_c.c_void_p, [_u64, _c.c_char_p, _c.c_int, _c.c_int64]),
    "trpc_last_error": (_c.c_int, [_c.c_void_p]),
    "trpc_client_fetch_into": (_c.c_int, [
        _u64, _c.c_char_p, _c.POINTER(DLTensor), _rows, _c.c_size_t, _c.c_int, _c.c_int64, _err]),
    "trpc_client_fetch_rows": (_c.c_int, [_u64, _c.c_char_p, _rows, _c.c_size_t, _c.c_int, _c.c_int64, _mt_out, _err]),
    "trpc_client_send": (_c.c_int, [_u64, _c.c_char_p, _c.POINTER(DLTensor), _c.c_int64, _err]),
    "trpc_client_send_rows": (_c.c_int, [
        _u64, _c.c_char_p, _rows, _c.c_size_t, _c.POINTER(DLTensor), _c.c_int64, _err]),
    "trpc_client_call": (_c.c_int, [
        _u64, _c.c_char_p, _c.c_char_p, _c.c_int64, _c.POINTER(DLTensor), _c.c_int64, _c.c_int64,
        _c.POINTER(_c.c_void_p), _c.POINTER(_c.c_int64), _c.POINTER(_c.c_void_p), _c.POINTER(_c.c_int64), _err]),
    "trpc_client_send_device": (_c.c_int, [_u64, _c.c_char_p, _c.POINTER(DLTensor), _u64, _c.c_int64, _err]),
    "trpc_client_fetch_device": (_c.c_int, [_u64, _c.c_char_p, DLDevice, _c.c_int, _c.c_int64, _mt_out, _err]),
    "trpc_cuda_device_count": (_c.c_int, [_c.POINTER(_c.c_int32), _err]),
    "trpc_device_stats": (_c.c_int, [DLDevice, _c.POINTER(DeviceMemStats), _err]),
    "trpc_client_empty": (_c.c_int, [_u64, DLDataType, _c.c_int32, _c.POINTER(_c.c_int64), _mt_out, _err]),
    "trpc_client_pool_stats": (_c.c_int, [_u64, _c.POINTER(PoolStats), _err]),
    "trpc_client_stats": (_c.c_int, [_u64, _c.POINTER(Stats), _err]),
}


def library_path() -> str:
    """The path of libtensorrpc.so this package loads."""
    env = os.environ.get("TENSORRPC_LIB")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtensorrpc.so")


def _load() -> ctypes.CDLL:
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            "tensorrpc: %s not found; install the package with `pip install ./shim/python` "
            "(which builds it), or point TENSORRPC_LIB at a libtensorrpc.so" % path)
    lib = ctypes.CDLL(path)
    # The version first: a library of another version may lack functions
    # of this one's prototypes (an AttributeError, not this message).
    version = ctypes.CFUNCTYPE(ctypes.c_int)(("trpc_abi_version", lib))()
    if version != ABI_VERSION:
        raise ImportError("tensorrpc: %s has C ABI version %d; this package needs %d"
                          % (path, version, ABI_VERSION))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    # The capsule destructor (in C) needs two functions of the Python C API.
    api = ctypes.pythonapi
    lib.trpc_set_capsule_api(
        ctypes.cast(api.PyCapsule_IsValid, ctypes.c_void_p),
        ctypes.cast(api.PyCapsule_GetPointer, ctypes.c_void_p))
    return lib


lib = _load()

# PyCapsule_New(pointer, name, destructor); the name must outlive the
# capsule, so it is the library's static "dltensor" (or
# "dltensor_versioned") string.


def _pyapi(name: str, restype: Any, *argtypes: Any) -> Any:
    """A function of the Python C API with its own prototype (setting
    argtypes on ctypes.pythonapi's shared function objects would change
    them for every other user)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_new = _pyapi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_capsule_name = lib.trpc_dltensor_name()
_capsule_versioned_name = lib.trpc_dltensor_versioned_name()
_capsule_destructor = ctypes.cast(lib.trpc_dlpack_capsule_destructor, ctypes.c_void_p)

# For consuming capsules other producers make.
capsule_get_name = _pyapi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
capsule_get_pointer = _pyapi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
capsule_set_name = _pyapi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)


def capsule(managed: int, versioned: bool = False) -> Any:
    """Wraps the DLManagedTensor (versioned: DLManagedTensorVersioned) at
    address managed in a "dltensor" ("dltensor_versioned") PyCapsule. The
    capsule owns it until a consumer (np.from_dlpack, torch.from_dlpack)
    takes it over; an unconsumed capsule deletes it when collected."""
    name = _capsule_versioned_name if versioned else _capsule_name
    return _capsule_new(managed, name, _capsule_destructor)


def error_details() -> Optional[str]:
    """The details (a remote traceback, say) of the last failure of a call
    into the library on this thread, or None."""
    p = lib.trpc_error_details()
    return take_string(p) if p else None


def take_string(p: Optional[int]) -> str:
    """Returns the library-malloc'd C string at p as str and frees it."""
    if not p:
        return ""
    try:
        return ctypes.string_at(p).decode("utf-8", "replace")
    finally:
        lib.trpc_free(p)
